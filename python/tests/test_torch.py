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


def test_diloco_trains_the_example_with_adamw_and_a_round_every_8_steps(
    cluster: ClusterFactory, procs: Procs
) -> None:
    # DiLoCo on the servers (outer Nesterov, lr 0.7, momentum 0.9), AdamW on the workers.
    c = cluster(workers=2, servers=2, policy="diloco:h=8", lr=0.05, momentum=0.9)
    outs = train(procs, c, "diloco", "--sync-every", "8", "--local-lr", "0.002")
    assert final_accuracy(outs[0]) > 0.72, outs[0]
    for out in outs:
        m = re.search(r"worker \d: (\d+) iterations", out)
        # About 190 local steps each: 23 or 24 rounds of 8 (iterations are rounds).
        assert m and 20 <= int(m.group(1)) <= 24, out


@pytest.mark.parametrize("land", [(), ("--land-in-forward",)], ids=["step", "forward"])
def test_the_wide_model_trains_through_the_cluster_pushing_from_backward(
    cluster: ClusterFactory, procs: Procs, land: tuple[str, ...]
) -> None:
    # The model where communication matters: 5.8M parameters, 23 MB each way per iteration;
    # a short run (20 iterations per worker) shows it goes through and learns, with the push
    # overlapped with backward (1 MB buckets) and the next pull sent shard by shard as the
    # push is acknowledged. Four shards on one server: the setting where the early pulls'
    # answers, unread, once filled the connection's flow-control window and the worker's
    # report of its iteration waited behind them for ever (both workers hung). Landed by
    # step(), or in the next forward pass, each layer as its parameters arrive.
    c = cluster(workers=2, servers=1, shards=4, policy="bsp", lr=0.05, momentum=0.9)
    outs = train(
        procs,
        c,
        "server",
        "--model",
        "wide",
        "--train-limit",
        "1280",
        "--overlap",
        "--bucket-mb",
        "1",
        *land,
    )
    assert "model wide: 5,824,522 parameters (23.3 MB)" in outs[0], outs[0]
    # 0.54 on this machine after 20 iterations of BSP; chance is 0.10.
    assert final_accuracy(outs[0]) > 0.4, outs[0]
    for out in outs:
        m = re.search(r"worker \d: (\d+) iterations", out)
        assert m and int(m.group(1)) == 20, out


# Each exact test runs on the CPU and, where there is one, on a CUDA device: the same code
# (syncopate._staging) stages both, so the CPU runs test the staging path too.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="no CUDA device on this machine"
        ),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_diloco_pushes_the_pseudo_gradient_and_the_servers_average_it(
    cluster: ClusterFactory, device: str
) -> None:
    # One worker under local SGD (averaging, lr 1): after a round of 3 plain-SGD steps the
    # servers' model is exactly the worker's local model, and the report counts 3 steps.
    c = cluster(workers=1, servers=2, policy="localsgd:h=3", lr=0.05, momentum=0.9)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)).to(device)
    inner = torch.optim.SGD(model.parameters(), lr=0.125)
    with sps.DiLoCo(model, inner, **c.settings, iterations=2) as diloco:
        assert diloco.step_info is not None and diloco.step_info.local_steps == 3
        for _ in range(3):
            inner.zero_grad()
            model(torch.ones(5, 3, device=device)).sum().backward()
            inner.step()
            local = [p.detach().clone() for p in model.parameters()]
        # The third step's hook pushed and pulled: the model is the servers' (the local one).
        assert diloco.local_step == 0 and diloco.step_info.iteration == 1
        for a, p in zip(local, model.parameters(), strict=True):
            assert p.device == a.device and torch.allclose(a, p.detach(), rtol=0, atol=1e-6)
        with pytest.raises(ValueError):
            sps.DiLoCo(model, inner, sync_every=0)
    report = diloco.leave()
    assert report["steps"] == 3 and report["local_iterations"] == 1, report


def test_delta_mode_refuses_servers_with_momentum(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1, lr=0.05, momentum=0.9)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(syncopate.UsageError, match="plain SGD"):
        sps.DistributedOptimizer(opt, model.named_parameters(), mode="delta", **c.settings)


@pytest.mark.parametrize("device", DEVICES)
def test_server_mode_applies_the_servers_step_exactly(cluster: ClusterFactory, device: str) -> None:
    # One worker, lr 0.5, no momentum: every parameter moves by exactly -0.5 * its gradient.
    c = cluster(workers=1, servers=2, lr=0.5, momentum=0.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1)).to(device)
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
    model(torch.ones(5, 3, device=device)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step(loss=1.0)
    for b, g, p in zip(before, grads, model.parameters(), strict=True):
        assert torch.equal(p.detach(), b - 0.5 * g)
    assert opt.step_info is not None and opt.step_info.iteration == 1
    opt.zero_grad()
    model(torch.ones(5, 3, device=device)).sum().backward()
    opt.step()
    assert opt.done
    report = opt.leave()
    assert report["iterations"] == 2


def test_staging_copies_what_is_pushed_and_pulls_into_cpu_parameters_in_place() -> None:
    """The device abstraction on the CPU (the path every CPU test runs): staged tensors are
    copies (``None`` is zeros), a pull's targets are the parameters themselves, and a model on
    no device, on several, or of another dtype is refused."""
    from syncopate._staging import Staging

    params = [torch.ones(2, 3), torch.full((4,), 2.0)]
    st = Staging(params)
    out = st.stage([params[0], None])
    assert out[0] is not params[0] and torch.equal(out[0], params[0])
    assert torch.equal(out[1], torch.zeros(4))
    params[0].fill_(7.0)
    assert torch.equal(out[0], torch.ones(2, 3)), "a copy, not a view"
    targets = st.pull_targets(params)
    assert [t.data_ptr() for t in targets] == [p.data_ptr() for p in params], "in place"
    st.finish_pull(params)
    for bad in ([], [torch.zeros(2, dtype=torch.float64)], [torch.zeros(2, device="meta")]):
        with pytest.raises(syncopate.TensorError):
            Staging(bad)


def three_layers(device: str) -> torch.nn.Module:
    """A small model with an unused parameter (no gradient reaches it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(3, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4), torch.nn.Linear(4, 1)
    )
    model.register_parameter("unused", torch.nn.Parameter(torch.ones(5)))
    return model.to(device)


def overlapped(
    cluster: ClusterFactory,
    model: torch.nn.Module,
    bucket_mb: float,
    *,
    iterations: int,
    land_in_forward: bool,
) -> sps.DistributedOptimizer:
    """``model``'s overlapped optimizer (lr 0 locally) on a cluster of one worker, two servers
    and three shards whose servers step plain SGD at lr 0.5; trains ``iterations``."""
    c = cluster(workers=1, servers=2, shards=3, lr=0.5, momentum=0.0)
    return sps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model.named_parameters(),
        overlap=True,
        bucket_mb=bucket_mb,
        model=model if land_in_forward else None,
        **c.settings,
        iterations=iterations,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bucket_mb", [1e-5, 4.0])
def test_the_overlapped_step_pushes_from_backward_what_the_serial_step_pushes(
    cluster: ClusterFactory, device: str, bucket_mb: float
) -> None:
    # One worker, lr 0.5, three shards over two servers: every parameter moves by exactly
    # -0.5 * its gradient, as under the serial step; the unused one (no gradient) stays.
    # Buckets of one parameter each (1e-5 MB), or one bucket for the whole model.
    model = three_layers(device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = overlapped(cluster, model, bucket_mb, iterations=3, land_in_forward=False)
    sps.broadcast_parameters(opt)
    for it in range(2):
        opt.zero_grad()
        model(torch.ones(5, 3, device=device)).sum().backward()
        grads = [
            torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()
        ]
        opt.step(loss=0.25 * (it + 1))
        for b, g, p in zip(before, grads, model.parameters(), strict=True):
            assert torch.equal(p.detach(), b - 0.5 * g)
        before = [p.detach().clone() for p in model.parameters()]
        assert opt.step_info is not None and opt.step_info.iteration == it + 1
    report = opt.worker.report()
    assert report["iterations"] == 2 and report["last_loss"] == 0.5, report
    overlap = report["timeline_overlap"]
    assert len(overlap) == 2 and all(o >= 0.0 for o in overlap), overlap
    if bucket_mb < 1:
        # The last layer's shard went before the first layer's gradient was in.
        assert all(o > 0.0 for o in overlap), overlap
    opt.zero_grad()
    model(torch.ones(5, 3, device=device)).sum().backward()
    opt.step()
    assert opt.done
    assert opt.leave()["iterations"] == 3


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bucket_mb", [1e-5, 4.0])
def test_landing_in_the_next_forward_pass_trains_as_the_serial_step_does(
    cluster: ClusterFactory, device: str, bucket_mb: float
) -> None:
    # model=: step() returns with the pull in flight, and each module's forward pre-hook lands
    # its own parameters. One worker, lr 0.5, three shards over two servers: the parameters a
    # forward pass computes with are exactly those of the one before minus 0.5 * its
    # gradient, as under the serial step, and until a forward pass (or synchronize) they are
    # still the last iteration's.
    model = three_layers(device)
    opt = overlapped(cluster, model, bucket_mb, iterations=4, land_in_forward=True)
    sps.broadcast_parameters(opt)
    x = torch.ones(5, 3, device=device)
    before: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for it in range(3):
        opt.zero_grad()
        out = model(x)
        used = [p.detach().clone() for p in model.parameters()]
        if it > 0:
            for b, g, u in zip(before, grads, used, strict=True):
                assert torch.equal(u, b - 0.5 * g)
        out.sum().backward()
        grads = [
            torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()
        ]
        before = used
        assert opt.step(loss=0.25 * (it + 1)) is None
        # The next iteration, pulled early: nothing landed yet.
        assert opt.step_info is not None and opt.step_info.iteration == it + 1
        assert not opt.done
        for u, p in zip(used, model.parameters(), strict=True):
            assert torch.equal(p.detach(), u)
    opt.synchronize()  # lands without a forward pass
    for b, g, p in zip(before, grads, model.parameters(), strict=True):
        assert torch.equal(p.detach(), b - 0.5 * g)
    report = opt.worker.report()
    assert report["iterations"] == 3 and report["last_loss"] == 0.75, report
    # The last iteration of the budget: no early pull, step() waits, and training is over.
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    assert opt.done
    assert opt.leave()["iterations"] == 4


def test_model_needs_overlap_and_the_optimizers_parameters(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1, shards=1)
    model = three_layers("cpu")
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="overlap=True"):
        sps.DistributedOptimizer(sgd, model.named_parameters(), model=model, **c.settings)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(syncopate.TensorError, match="not in named_parameters"):
        sps.DistributedOptimizer(
            sgd, model.named_parameters(), overlap=True, model=other, **c.settings
        )


def test_the_overlapped_step_refuses_what_it_cannot_push_from_backward(
    cluster: ClusterFactory,
) -> None:
    c = cluster(workers=1, servers=1, shards=2, lr=0.5, momentum=0.0)
    model = three_layers("cpu")
    with pytest.raises(ValueError, match="delta"):
        sps.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), model.named_parameters(), "delta", overlap=True
        )
    opt = sps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model.named_parameters(),
        overlap=True,
        **c.settings,
    )
    sps.broadcast_parameters(opt)
    x = torch.ones(2, 3)
    model(x).sum().backward()
    with pytest.raises(syncopate.UsageError, match="second backward pass"):
        model(x).sum().backward()  # gradient accumulation: the first pass was pushed
    with pytest.raises(syncopate.UsageError, match="samples=7"):
        opt.step(samples=7)
    opt.step()  # what the first pass pushed, and zeros where the second stopped it
    assert opt.step_info is not None and opt.step_info.iteration == 1
    opt.leave()


def test_a_fed_push_refuses_overlapping_and_outside_pieces_and_is_pushed_once(
    cluster: ClusterFactory,
) -> None:
    # The native half the overlap stands on, abused directly.
    c = cluster(workers=1, servers=2, shards=2, lr=1.0, momentum=0.0)
    w = syncopate.Worker([torch.zeros(6)], **c.settings)
    assert w.pull([torch.zeros(6)]) is not None
    feed = w._feed()
    assert feed.put(4, [torch.ones(2)]) == 0  # values 3..6 are shard 1's: it lacks 3
    with pytest.raises(syncopate.TensorError, match="overlap"):
        feed.put(3, [torch.ones(2)])
    with pytest.raises(syncopate.TensorError, match="not all in the model"):
        feed.put(5, [torch.ones(2)])
    with pytest.raises(syncopate.TensorError):
        feed.put(0, [torch.ones(2, dtype=torch.float64)])
    assert feed.put(3, [torch.full((1,), 3.0)]) == 1  # shard 1 whole: sent
    assert not feed.complete
    h = w._exchange_async(feed)
    assert feed.put(0, [torch.full((2,), 2.0), torch.full((1,), 2.0)]) == 1
    assert feed.complete
    dropped, step = h.wait(timeout=30)
    assert dropped == 0 and step is not None and step.iteration == 1
    with pytest.raises(syncopate.UsageError, match="pushed already"):
        w._session().exchange(feed, 1)
    out = torch.zeros(6)
    assert w._land_part(0, [out])
    # lr 1: the model moved by minus the push.
    assert out.tolist() == [-2.0, -2.0, -2.0, -3.0, -1.0, -1.0]
    w.leave()


def test_tensorboard_gets_each_steps_figures_at_the_workers_iteration(
    cluster: ClusterFactory, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    c = cluster(workers=1, servers=1, lr=0.1, momentum=0.0)
    model = torch.nn.Linear(3, 1)
    writer = SummaryWriter(str(tmp_path))
    opt = sps.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0),
        model.named_parameters(),
        tensorboard=writer,
        **c.settings,
        iterations=5,
    )
    sps.broadcast_parameters(opt)
    losses = []
    while not opt.done:
        opt.zero_grad()
        loss = model(torch.ones(4, 3)).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        opt.step(loss=losses[-1])
    opt.leave()
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    assert [s for s, _ in scalars["syncopate/exchange_s"]] == [0, 1, 2, 3, 4]
    assert [round(v, 5) for _, v in scalars["syncopate/loss"]] == [round(x, 5) for x in losses]
    batches = {v for _, v in scalars["syncopate/batch_size"]}
    assert len(batches) == 1 and batches.pop() > 0, "the batch in force, at every step"
    assert [s for s, _ in scalars["syncopate/step_s"]] == [1, 2, 3, 4], "from the second step on"
    assert all(0 <= v <= 1 for _, v in scalars["syncopate/waiting_share"])
    assert all(v > 0 for _, v in scalars["syncopate/exchange_s"])
    with pytest.raises(TypeError, match="SummaryWriter"):
        sps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), [], tensorboard="runs/"
        )


def test_diloco_refuses_a_sync_every_the_policy_does_not_ask_for(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1, policy="localsgd:h=4", lr=1.0, momentum=0.0)
    model = torch.nn.Linear(3, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(syncopate.UsageError, match=r"sync_every=8, but .* rounds of 4 local steps"):
        sps.DiLoCo(model, inner, sync_every=8, **c.settings, iterations=2)
    # The policy's own length trains (the refused worker left, so this one may join).
    with sps.DiLoCo(model, inner, sync_every=4, **c.settings, iterations=1) as diloco:
        assert diloco.step_info is not None and diloco.step_info.local_steps == 4
        for _ in range(4):
            inner.zero_grad()
            model(torch.ones(2, 3)).sum().backward()
            inner.step()
        assert diloco.done
    assert diloco.leave() is not None


@pytest.mark.parametrize("given", ["named", "bare", "none"])
def test_the_parameters_may_be_named_bare_or_left_to_the_optimizer(
    cluster: ClusterFactory, given: str
) -> None:
    # As with Horovod: model.named_parameters(), model.parameters(), or the optimizer's own.
    c = cluster(workers=1, servers=1, lr=0.5, momentum=0.0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    params = {"named": model.named_parameters(), "bare": model.parameters(), "none": None}[given]
    dist = sps.DistributedOptimizer(opt, params, **c.settings, iterations=2)
    sps.broadcast_parameters(dist)
    for _ in range(2):
        dist.zero_grad()
        model(torch.ones(5, 3)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        dist.step()
        if not dist.done:
            # Every parameter moved by exactly -0.5 * its gradient, whatever its name.
            for b, g, p in zip(before, grads, model.parameters(), strict=True):
                assert torch.equal(p.detach(), b - 0.5 * g)
    assert dist.leave()["iterations"] == 2
    with pytest.raises(TypeError, match=r"model.named_parameters\(\), model.parameters\(\)"):
        sps.DistributedOptimizer(opt, ["weight"])
