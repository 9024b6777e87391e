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
cluster with ``--lr 1 --momentum 0``); ``--mode diloco`` takes ``--sync-every`` local steps of
AdamW (``--local-lr``) per round and pushes their pseudo-gradient, which the servers' outer
optimizer steps (run it under ``--policy diloco`` or ``localsgd``; worker 0 scores the model
right after a round, so ``--eval-every`` is rounded up to a multiple of ``--sync-every``)::

    syncopate local --workers 4 --policy diloco:h=8 \
        --script examples/torch/train.py --mode diloco --sync-every 8

Models: ``--model resnet`` (the default, 77,754 parameters), ``mlp`` (784-128-10, the Rust
workload's), and ``wide`` (784-W-W-10, ``--width`` 2048: 5.8M parameters, 23 MB each way per
iteration, where communication matters; ``--depth`` hidden layers). ``--overlap`` pushes from
the backward pass (``DistributedOptimizer(overlap=True)``; start the cluster with several
``--shards``); ``--land-in-forward`` also lets the next forward pass start while the pull
still arrives, each layer waiting for its own parameters (``model=``).

``--backend ddp`` trains the same model with the same loop through
``torch.nn.parallel.DistributedDataParallel`` over gloo instead (started as torchrun starts
workers: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), for ``compare.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

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


def wide(width: int = 2048, depth: int = 2) -> nn.Module:
    """784-W-...-W-10 with ``depth`` hidden layers: a model where communication matters. At the
    defaults it has 5.8M parameters, so one iteration pushes and pulls 23 MB each way (the
    small models above move 0.3 MB); for the overlap and DDP measurements
    (``benches/torch_overlap.py``)."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(784, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


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


class Trainer:
    """What differs between training through Syncopate and through
    ``torch.nn.parallel.DistributedDataParallel``: joining, the batch size, the step, leaving.
    The model, the data, the loop and the scoring are the same."""

    def __init__(self, args: argparse.Namespace, model: nn.Module) -> None:
        self.backend = args.backend
        self.mode = args.mode
        self.model = model
        if args.backend == "ddp":
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            dist.init_process_group("gloo")
            self.dist = dist
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
            self.net: nn.Module = DistributedDataParallel(model)  # broadcasts rank 0's model
            self.opt: Any = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
            self.batch = args.batch
        elif args.mode == "diloco":
            self.opt = torch.optim.AdamW(model.parameters(), lr=args.local_lr)
            self.diloco = sps.DiLoCo(model, self.opt, sync_every=args.sync_every)
            self.diloco.__enter__()
            self.net = model
            self.rank, self.size = self.diloco.worker.rank, self.diloco.worker.size
        else:
            local = (
                torch.optim.Adam(model.parameters(), lr=args.local_lr)
                if args.mode == "delta"
                else torch.optim.SGD(model.parameters(), lr=0.0)
            )
            self.opt = sps.DistributedOptimizer(
                local,
                model.named_parameters(),
                mode=args.mode,
                overlap=args.overlap,
                bucket_mb=args.bucket_mb,
                model=model if args.land_in_forward else None,
            )
            sps.broadcast_parameters(self.opt)
            self.net = model
            self.rank, self.size = self.opt.worker.rank, self.opt.worker.size

    @property
    def done(self) -> bool:
        """Whether the cluster ended training (Syncopate: a target, a budget, an operator)."""
        if self.mode == "diloco":
            return self.diloco.done
        return self.backend != "ddp" and self.opt.done

    @property
    def batch_size(self) -> int:
        """The batch size in force (a Syncopate policy may change it)."""
        if self.mode == "diloco":
            return self.diloco.batch_size
        return self.batch if self.backend == "ddp" else self.opt.batch_size

    def step(self, loss: torch.Tensor, samples: int) -> None:
        """Backward and the optimizer's step (DDP averages the gradients in backward)."""
        self.opt.zero_grad()
        loss.backward()
        if self.mode == "diloco":
            self.diloco.record_loss(loss.item())
            self.opt.step()  # every --sync-every steps, DiLoCo's hook syncs
        elif self.backend == "ddp":
            self.opt.step()
        else:
            self.opt.step(loss=loss.item(), samples=samples)

    def score(self, acc: float, loss: float) -> None:
        """Reports rank 0's score (to the launcher's watcher, under Syncopate)."""
        if self.mode == "diloco":
            self.diloco.worker.score(acc, loss)
        elif self.backend != "ddp":
            self.opt.worker.score(acc, loss)

    def agree_to_stop(self, stop: bool) -> bool:
        """Under DDP every rank must stop at the same iteration: rank 0 decides."""
        if self.backend != "ddp":
            return stop
        flag = torch.tensor([1 if stop else 0])
        self.dist.broadcast(flag, src=0)
        return bool(flag.item())

    def leave(self) -> None:
        """Leaves the cluster (or the process group) and prints this worker's summary."""
        if self.backend == "ddp":
            self.dist.destroy_process_group()
            return
        if self.mode == "diloco":
            self.diloco.__exit__(None, None, None)
            report = self.diloco.leave()
        else:
            report = self.opt.leave()
        if report is not None:
            its, deferred = report["iterations"], report["deferred_pulls"]
            print(f"worker {self.rank}: {its} iterations, {deferred} deferred pulls", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains as one worker, with the command line ``argv`` (default: ``sys.argv``); returns
    this worker's summary (worker 0's has the final and best test accuracy). Called in-process
    by ``examples/ray/launch.py``, which runs it in Ray actors."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["resnet", "mlp", "wide"], default="resnet")
    p.add_argument("--width", type=int, default=2048, help="hidden width of --model wide")
    p.add_argument("--depth", type=int, default=2, help="hidden layers of --model wide")
    p.add_argument(
        "--overlap",
        action="store_true",
        help="push from the backward pass (DistributedOptimizer(overlap=True); server mode)",
    )
    p.add_argument("--bucket-mb", type=float, default=4.0, help="overlap's bucket size")
    p.add_argument(
        "--land-in-forward",
        action="store_true",
        help="with --overlap: step() returns with the pull under way, each layer waits for its "
        "own parameters in the next forward pass (DistributedOptimizer(model=...))",
    )
    p.add_argument(
        "--backend",
        choices=["syncopate", "ddp"],
        default="syncopate",
        help="ddp: torch DistributedDataParallel over gloo (torchrun's environment), to compare",
    )
    p.add_argument("--mode", choices=["server", "delta", "diloco"], default="server")
    p.add_argument("--sync-every", type=int, default=8, help="local steps per round (diloco)")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over this worker's part")
    p.add_argument(
        "--local-lr", type=float, default=1e-3, help="Adam (delta) or AdamW (diloco) learning rate"
    )
    p.add_argument("--lr", type=float, default=0.05, help="SGD's learning rate (ddp)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum (ddp)")
    p.add_argument("--batch", type=int, default=32, help="batch size per worker (ddp)")
    p.add_argument(
        "--slow",
        default="",
        help="RANK:FACTOR: that rank sleeps (FACTOR-1)x each step's time (ddp; for Syncopate "
        "the launcher's --slow does the same)",
    )
    p.add_argument("--train-limit", type=int, default=0, help="use only this many training images")
    p.add_argument("--test-limit", type=int, default=0, help="score on only this many test images")
    p.add_argument(
        "--eval-every",
        type=int,
        default=100,
        help="iterations between scores (worker 0)",
    )
    p.add_argument("--target", type=float, default=0.0, help="stop once worker 0 scores this")
    p.add_argument(
        "--snapshots", default="", help="worker 0 saves its model here at every score, timed"
    )
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.mode == "diloco":
        # Score right after a round: the model is then the servers', not one worker's.
        args.eval_every = -(-args.eval_every // args.sync_every) * args.sync_every
    if args.threads:
        torch.set_num_threads(args.threads)

    seed = int(os.environ.get("SYNCOPATE_SEED", "1"))
    torch.manual_seed(seed)
    models = {"resnet": resnet, "mlp": mlp, "wide": lambda: wide(args.width, args.depth)}
    model = models[args.model]()
    t = Trainer(args, model)
    params = sum(p.numel() for p in model.parameters())
    if t.rank == 0:
        print(f"model {args.model}: {params:,} parameters ({4 * params / 1e6:.1f} MB)", flush=True)
    rank, parts = t.rank, t.size
    part = rank
    if args.backend == "syncopate":
        part, parts = (int(v) for v in os.environ.get("SYNCOPATE_PART", "0/1").split("/"))
    slow_rank, factor = (
        (int(args.slow.split(":")[0]), float(args.slow.split(":")[1])) if args.slow else (-1, 1.0)
    )
    x, y = fashion_mnist.load("train")
    if args.train_limit:
        x, y = x[: args.train_limit], y[: args.train_limit]
    x, y = x[part::parts], y[part::parts]
    tx, ty = fashion_mnist.load("test")
    if args.test_limit:
        tx, ty = tx[: args.test_limit], ty[: args.test_limit]
    snapshots = Path(args.snapshots) if args.snapshots and rank == 0 else None
    if snapshots is not None:
        snapshots.mkdir(parents=True, exist_ok=True)

    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    budget = int(args.epochs * len(x))
    seen, it, best, t0 = 0, 0, 0.0, time.monotonic()
    slow_steps: list[float] = []  # the slow DDP rank's measured steps, before each sleep
    order = torch.randperm(len(x), generator=gen)
    at = 0
    while not t.done and seen < budget:
        began = time.monotonic()
        b = t.batch_size
        if at + b > len(x):
            order, at = torch.randperm(len(x), generator=gen), 0
        idx = order[at : at + b]
        at += b
        loss = F.cross_entropy(t.net(x[idx]), y[idx])
        t.step(loss, b)
        if args.backend == "ddp" and rank == slow_rank:
            measured = time.monotonic() - began
            slow_steps.append(measured)
            time.sleep((factor - 1.0) * measured)
        seen += b
        it += 1
        if it % args.eval_every == 0:
            stop = False
            if rank == 0:
                acc, test_loss = evaluate(model, tx, ty)
                # The launcher's watcher records it: its --target-accuracy, plots and report.
                t.score(acc, test_loss)
                best = max(best, acc)
                elapsed = time.monotonic() - t0
                if snapshots is not None:
                    torch.save(model.state_dict(), snapshots / f"{it:07d}.pt")
                    with open(snapshots / "index.jsonl", "a") as f:
                        row = {
                            "iteration": it,
                            "t_s": elapsed,
                            "accuracy": acc,
                            "file": f"{it:07d}.pt",
                        }
                        f.write(json.dumps(row) + "\n")
                print(
                    f"iteration {it} time {elapsed:.1f} s loss {loss.item():.4f} "
                    f"test accuracy {acc:.4f}",
                    flush=True,
                )
                stop = bool(args.target and acc >= args.target)
            if t.agree_to_stop(stop):
                break
    summary: dict[str, Any] = {"rank": rank, "iterations": it}
    if rank == 0:
        acc, _ = evaluate(model, tx, ty)
        best = max(best, acc)
        elapsed = time.monotonic() - t0
        print(
            f"final test accuracy {acc:.4f} best {best:.4f} after {it} iterations, {elapsed:.1f} s",
            flush=True,
        )
        summary |= {"final_accuracy": acc, "best_accuracy": best, "seconds": elapsed}
    if slow_steps:
        mean_ms = 1000 * sum(slow_steps) / len(slow_steps)
        print(f"rank {rank}: mean measured step {mean_ms:.1f} ms before its sleep", flush=True)
    t.leave()
    return summary


if __name__ == "__main__":
    main()
