"""Train the PyTorch example (``examples/torch/train.py``) on a Syncopate cluster on Ray.

On this machine (Ray starts a local instance)::

    python examples/ray/launch.py --workers 4 --servers 2 --policy ssp:s=3 -- --epochs 2

On a Ray cluster, from its head node (the ``syncopate`` binary and this checkout at the same
paths on every node, as in the container image of ``deploy/``)::

    RAY_ADDRESS=auto python examples/ray/launch.py --workers 16 --servers 4 -- --epochs 2

Everything after ``--`` goes to ``train.py``. The coordinator and servers run as Ray actors,
the workers are ``train.py``'s ``main`` in Ray actors; see ``docs/deploy.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import syncopate.ray

EXAMPLE = str(Path(__file__).resolve().parents[1] / "torch")


def train(argv: list[str]) -> dict[str, Any]:
    """One worker: the example's ``main``, in the worker actor's process."""
    sys.path.insert(0, EXAMPLE)
    import train as example  # noqa: PLC0415 (imported where it runs: in the actor)

    return example.main(argv)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--policy", default="bsp")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("script_args", nargs="*", help="train.py's arguments (after --)")
    args = p.parse_args()
    argv = ["--threads", "1", *args.script_args]
    report = syncopate.ray.launch(
        train,
        config=argv,
        workers=args.workers,
        servers=args.servers,
        policy=args.policy,
        lr=args.lr,
        momentum=args.momentum,
        resources={"num_cpus": args.cpus_per_worker},
        run_dir=args.run_dir,
    )
    print(json.dumps(report["results"][0], indent=2))
    print(f"start-up {report['startup_s']:.1f} s, run {report['elapsed_s']:.1f} s")


if __name__ == "__main__":
    main()
