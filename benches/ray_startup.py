"""The Ray launcher's start-up cost: seconds from ``syncopate.ray.launch`` to the first
iteration the servers admit, on a Ray instance already running.

Each round launches a counter run (numpy, 16 parameters, a few iterations) of ``--workers``
workers and ``--servers`` servers on the same Ray instance, and reads the report's
``startup_s``: the certificate, the coordinator's and servers' actors and processes, the worker
actors (a Python process each, importing numpy and the package), their joining, and the first
push. The time to start Ray itself (``ray.init`` of a local instance) is printed apart. Prints
each round, then the median and the range.

    cargo build --release --bin syncopate
    SYNCOPATE_BIN=target/release/syncopate .venv/bin/python benches/ray_startup.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Loopback only, as the tests run Ray: without this Ray takes the machine's external address
# for its node (see python/tests/conftest.py). Set before ray is imported.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import numpy as np  # noqa: E402
import ray  # noqa: E402

import syncopate
import syncopate.ray


def counter(config: Any) -> int:
    """A few iterations of a constant gradient."""
    weights = np.zeros(16, dtype=np.float32)
    worker = syncopate.Worker([weights])
    grad = np.ones(16, dtype=np.float32)
    while worker.pull([weights]) is not None:
        worker.push([grad])
    worker.leave()
    return worker.rank


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=2)
    args = p.parse_args()
    t = time.monotonic()
    ray.init(num_cpus=max(args.workers, 2), include_dashboard=False, _node_ip_address="127.0.0.1")
    print(f"ray.init (a local instance): {time.monotonic() - t:.2f} s", flush=True)
    startup: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            report = syncopate.ray.launch(
                counter,
                workers=args.workers,
                servers=args.servers,
                iterations=20,
                run_dir=Path(tmp) / f"run-{r}",
                progress_every_s=60,
            )
            startup.append(report["startup_s"])
            print(
                f"round {r + 1}: start-up {report['startup_s']:.2f} s, "
                f"whole run {report['elapsed_s']:.2f} s",
                flush=True,
            )
    print(
        f"start-up, {args.workers} workers and {args.servers} servers: median "
        f"{statistics.median(startup):.2f} s, range {min(startup):.2f}-{max(startup):.2f} s"
    )
    ray.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
