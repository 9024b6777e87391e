"""Train a PyTorch model on Fashion-MNIST through a Syncopate cluster, as one worker.

Run it as every worker of a local cluster::

    syncopate local --workers 4 --policy ssp:s=3 --lr 0.05 \
        --script examples/torch/train.py --epochs 2

Each worker trains on its part of the training set (``SYNCOPATE_PART``, set by the launcher);
worker 0 scores the model on the test set every ``--eval-every`` iterations, prints it and
reports it to the cluster (``Worker.score``), so the launcher's ``--target-accuracy`` stops the
run and its report and plots show the accuracy.
``--mode server`` pushes gradients (the servers' SGD steps: the cluster's ``--lr`` and
``--momentum``); ``--mode delta`` steps a local Adam and pushes its weight changes (run the
cluster with ``--lr 1 --momentum 0``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fashion_mnist  # noqa: E402
import syncopate.torch as sps  # noqa: E402


class Block(nn.Module):
    """A residual block: two 3x3 convolutions with batch norm, and a projection when the shape
    changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.b1 = nn.BatchNorm2d(cout)
        self.c2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.b2 = nn.BatchNorm2d(cout)
        self.skip = (
            nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            if stride != 1 or cin != cout
            else nn.Identity()
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(y)) + self.skip(x))


def resnet(width: int = 16) -> nn.Module:
    """A small ResNet for 28x28 images: a stem and three stages of one block each."""
    return nn.Sequential(
        nn.Conv2d(1, width, 3, 1, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        Block(width, width, 1),
        Block(width, 2 * width, 2),
        Block(2 * width, 4 * width, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4 * width, 10),
    )


def mlp() -> nn.Module:
    """784-128-10, as the built-in Rust workload."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Share of ``x`` classified right, and the mean cross-entropy loss."""
    model.eval()
    right, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            out = model(x[i : i + 1000])
            right += int((out.argmax(1) == y[i : i + 1000]).sum())
            loss += float(F.cross_entropy(out, y[i : i + 1000], reduction="sum"))
    model.train()
    return right / len(x), loss / len(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["resnet", "mlp"], default="resnet")
    p.add_argument("--mode", choices=["server", "delta"], default="server")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over this worker's part")
    p.add_argument("--local-lr", type=float, default=1e-3, help="Adam's learning rate (delta mode)")
    p.add_argument("--train-limit", type=int, default=0, help="use only this many training images")
    p.add_argument("--test-limit", type=int, default=0, help="score on only this many test images")
    p.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="iterations between scores (worker 0)",
    )
    p.add_argument("--target", type=float, default=0.0, help="stop once worker 0 scores this")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    part, parts = (int(v) for v in os.environ.get("SYNCOPATE_PART", "0/1").split("/"))
    seed = int(os.environ.get("SYNCOPATE_SEED", "1"))
    torch.manual_seed(seed)
    x, y = fashion_mnist.load("train")
    if args.train_limit:
        x, y = x[: args.train_limit], y[: args.train_limit]
    x, y = x[part::parts], y[part::parts]
    tx, ty = fashion_mnist.load("test")
    if args.test_limit:
        tx, ty = tx[: args.test_limit], ty[: args.test_limit]

    model = resnet() if args.model == "resnet" else mlp()
    local = (
        torch.optim.Adam(model.parameters(), lr=args.local_lr)
        if args.mode == "delta"
        else torch.optim.SGD(model.parameters(), lr=0.0)
    )
    opt = sps.DistributedOptimizer(local, model.named_parameters(), mode=args.mode)
    sps.broadcast_parameters(opt)
    rank = opt.worker.rank
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    budget = int(args.epochs * len(x))
    seen, it, best, t0 = 0, 0, 0.0, time.monotonic()
    order = torch.randperm(len(x), generator=gen)
    at = 0
    while not opt.done and seen < budget:
        b = opt.batch_size
        if at + b > len(x):
            order, at = torch.randperm(len(x), generator=gen), 0
        idx = order[at : at + b]
        at += b
        opt.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step(loss=loss.item(), samples=b)
        seen += b
        it += 1
        if rank == 0 and it % args.eval_every == 0:
            acc, test_loss = evaluate(model, tx, ty)
            # The launcher's watcher records it: its --target-accuracy, plots and report.
            opt.worker.score(acc, test_loss)
            best = max(best, acc)
            elapsed = time.monotonic() - t0
            print(
                f"iteration {it} time {elapsed:.1f} s loss {loss.item():.4f} "
                f"test accuracy {acc:.4f}",
                flush=True,
            )
            if args.target and acc >= args.target:
                break
    if rank == 0:
        acc, _ = evaluate(model, tx, ty)
        best = max(best, acc)
        elapsed = time.monotonic() - t0
        print(
            f"final test accuracy {acc:.4f} best {best:.4f} after {it} iterations, {elapsed:.1f} s",
            flush=True,
        )
    report = opt.leave()
    if report is not None:
        its, deferred = report["iterations"], report["deferred_pulls"]
        print(f"worker {rank}: {its} iterations, {deferred} deferred pulls", flush=True)


if __name__ == "__main__":
    main()
