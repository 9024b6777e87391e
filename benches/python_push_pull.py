"""Push and pull of a large model from Python against the Rust client, side by side on one
cluster.

A coordinator and two servers (release build, ASP so that no request waits on a policy, no
backups, as the figures in docs/performance.md were taken) hold a model of ``--params``
float32 values (default 25M: 100 MB), split over both. Each round runs
two worker processes one after the other, in alternating order:

- **rust**: ``syncopate worker --workload counter``: the engine's worker and Rust client, which
  pulls the whole model and pushes a gradient of the same size every iteration;
- **python**: this script as a worker, ``syncopate.Worker`` on numpy arrays (the model as
  ``--tensors`` arrays), doing the same.

Per iteration both fill the gradient (the counter workload's ``fill``; ``ndarray.fill``) and
time the rest: the Rust worker's report gives its time outside computing; the Python worker
times its ``pull`` and ``push`` calls with ``perf_counter`` (so everything Python adds counts).
Throughput is 2 x the model's bytes over that time. Prints each round, then medians, ranges
and the Python/Rust ratio per round.

Needs release builds::

    cargo build --release --bin syncopate
    (cd python && VIRTUAL_ENV=$PWD/../.venv ../.venv/bin/maturin develop --release -q)
    .venv/bin/python benches/python_push_pull.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def python_worker(params: int, tensors: int, iterations: int) -> None:
    """One worker of this process: pulls and pushes ``iterations`` times, prints its timing."""
    import numpy as np

    import syncopate

    sizes = [params // tensors + (1 if t < params % tensors else 0) for t in range(tensors)]
    model = [np.zeros(n, dtype=np.float32) for n in sizes]
    grads = [np.zeros(n, dtype=np.float32) for n in sizes]
    w = syncopate.Worker(model, iterations=iterations)
    comm = 0.0
    while True:
        t = time.perf_counter()
        step = w.pull(model)
        comm += time.perf_counter() - t
        if step is None:
            break
        for g in grads:
            g.fill(float(w.rank + 1))
        t = time.perf_counter()
        w.push(grads)
        comm += time.perf_counter() - t
    report = w.leave() or {}
    print(json.dumps({"iterations": report.get("iterations", 0), "comm_s": comm}))


def rust_run(
    exe: Path, env: dict[str, str], params: int, iterations: int, spin_us: int, out: Path
) -> float:
    """Seconds per iteration outside computing, as the Rust worker's report counts them."""
    args = [str(exe), "worker", "--workload", "counter", "--params", str(params)]
    args += ["--iterations", str(iterations), "--delay-ms", "0", "--report", str(out)]
    args += ["--spin-us", str(spin_us)]
    subprocess.run(args, env=env, check=True, capture_output=True, timeout=600)
    r = json.loads(out.read_text())
    return (r["elapsed_ns"] - r["compute_ns"]) / 1e9 / r["iterations"]


def python_run(env: dict[str, str], params: int, tensors: int, iterations: int) -> float:
    """Seconds per iteration in ``pull`` and ``push``, as the Python worker times them."""
    args = [sys.executable, __file__, "--worker", "--params", str(params)]
    args += ["--tensors", str(tensors), "--iterations", str(iterations)]
    p = subprocess.run(args, env=env, check=True, capture_output=True, text=True, timeout=600)
    r = json.loads(p.stdout.strip().splitlines()[-1])
    return r["comm_s"] / r["iterations"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=25_000_000, help="model size in float32 values")
    p.add_argument("--tensors", type=int, default=1, help="tensors the Python worker splits it in")
    p.add_argument("--iterations", type=int, default=20, help="pull+push rounds per run")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds")
    p.add_argument("--servers", type=int, default=2)
    p.add_argument(
        "--rust-spin-us",
        type=int,
        default=0,
        help="the Rust worker's spinning (default 0, as a Python worker's runtime; 100 is the "
        "node's default)",
    )
    p.add_argument("--exe", default=str(ROOT / "target" / "release" / "syncopate"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        python_worker(a.params, a.tensors, a.iterations)
        return

    import syncopate._native as native
    from syncopate.cluster import Cluster

    if native.DEBUG_BUILD:
        sys.exit("the syncopate extension is a debug build: rebuild it with --release (see above)")
    gb = 2 * a.params * 4 / 1e9
    rows: list[tuple[float, float]] = []
    with (
        tempfile.TemporaryDirectory() as tmp,
        Cluster(
            Path(tmp) / "cluster",
            exe=a.exe,
            servers=a.servers,
            policy="asp",
            lr=1e-9,
            extra=["--replicas", "0"],
        ) as c,
    ):
        print(
            f"{a.params:,} parameters ({a.params * 4 / 1e6:.0f} MB) in {a.tensors} tensor(s), "
            f"{a.servers} servers, ASP, {a.iterations} iterations per run, "
            f"Rust worker spinning {a.rust_spin_us} us"
        )
        for r in range(a.rounds):
            order = ["rust", "python"] if r % 2 == 0 else ["python", "rust"]
            got = {}
            for arm in order:
                if arm == "rust":
                    out = Path(tmp) / f"rust-{r}.json"
                    got[arm] = rust_run(c.exe, c.env, a.params, a.iterations, a.rust_spin_us, out)
                else:
                    got[arm] = python_run(c.env, a.params, a.tensors, a.iterations)
            rust, py = gb / got["rust"], gb / got["python"]
            rows.append((rust, py))
            print(
                f"round {r + 1} ({' then '.join(order)}): rust {rust:.2f} GB/s, "
                f"python {py:.2f} GB/s, python/rust {py / rust:.2f}",
                flush=True,
            )
    for name, vals in (
        ("rust GB/s", [x for x, _ in rows]),
        ("python GB/s", [y for _, y in rows]),
        ("python/rust", [y / x for x, y in rows]),
    ):
        lo, hi = min(vals), max(vals)
        print(f"{name:12} median {statistics.median(vals):.2f}  range {lo:.2f}-{hi:.2f}")


if __name__ == "__main__":
    main()
