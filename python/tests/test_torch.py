"""syncopate.torch on real Fashion-MNIST: both optimizer modes train the example's model with
two worker processes, and the optimizer's guards hold."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import syncopate
import syncopate.torch as sps
from conftest import Cluster, ClusterFactory, Procs

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torch" / "train.py"


def train(procs: Procs, c: Cluster, mode: str, *extra: str) -> list[str]:
    """Runs the example as both workers of cluster ``c``; returns their outputs."""
    args = ["--model", "mlp", "--mode", mode, "--train-limit", "12000", "--test-limit", "2000"]
    args += ["--epochs", "1", "--eval-every", "1000", "--threads", "1", *extra]
    workers = [
        procs.start(
            [sys.executable, str(EXAMPLE), *args],
            env=c.env
            | {
                "SYNCOPATE_ID": str(i),
                "SYNCOPATE_PART": f"{i}/2",
                "SYNCOPATE_ITERATIONS": "1000000",
            },
        )
        for i in range(2)
    ]
    outs = []
    for p in workers:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out
        outs.append(out)
    return outs


def final_accuracy(out: str) -> float:
    m = re.search(r"final test accuracy ([0-9.]+)", out)
    assert m, out
    return float(m.group(1))


@pytest.mark.parametrize(
    ("mode", "lr", "momentum", "extra"),
    [("server", 0.05, 0.9, ()), ("delta", 1.0, 0.0, ("--local-lr", "0.002"))],
)
def test_both_modes_train_the_example(
    cluster: ClusterFactory,
    procs: Procs,
    mode: str,
    lr: float,
    momentum: float,
    extra: tuple[str, ...],
) -> None:
    c = cluster(workers=2, servers=2, policy="ssp:s=2", lr=lr, momentum=momentum)
    outs = train(procs, c, mode, *extra)
    # 6,000 images per worker, batch 32: about 190 iterations each. Chance is 0.10.
    assert final_accuracy(outs[0]) > 0.72, outs[0]
    for out in outs:
        m = re.search(r"worker \d: (\d+) iterations", out)
        assert m and int(m.group(1)) >= 180, out


def test_delta_mode_refuses_servers_with_momentum(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1, lr=0.05, momentum=0.9)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(syncopate.UsageError, match="plain SGD"):
        sps.DistributedOptimizer(opt, model.named_parameters(), mode="delta", **c.settings)


def test_server_mode_applies_the_servers_step_exactly(cluster: ClusterFactory) -> None:
    # One worker, lr 0.5, no momentum: every parameter moves by exactly -0.5 * its gradient.
    c = cluster(workers=1, servers=2, lr=0.5, momentum=0.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    before = [p.detach().clone() for p in model.parameters()]
    opt = sps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model.named_parameters(),
        **c.settings,
        iterations=2,
    )
    sps.broadcast_parameters(opt)
    for b, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(b, p.detach())
    with pytest.raises(syncopate.TensorError):
        sps.DistributedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), [])
    opt.zero_grad()
    model(torch.ones(5, 3)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step(loss=1.0)
    for b, g, p in zip(before, grads, model.parameters(), strict=True):
        assert torch.equal(p.detach(), b - 0.5 * g)
    assert opt.step_info is not None and opt.step_info.iteration == 1
    opt.zero_grad()
    model(torch.ones(5, 3)).sum().backward()
    opt.step()
    assert opt.done
    report = opt.leave()
    assert report["iterations"] == 2
