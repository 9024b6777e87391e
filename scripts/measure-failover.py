#!/usr/bin/env python3
"""Measures the time from a server's (or the coordinator's) death to training resuming, with
`--replicas 1`.

Each round runs `syncopate local` (3 workers, 2 servers, 3 shards, the `counter` workload,
20 ms per iteration, release build), SIGKILLs one server 3 s in (with `--kill coordinator`,
the coordinator, which the launcher starts again), and reads the run report: for
each worker, training resumes at the first iteration that starts after the longest pause
following the kill. The figure is the latest worker's resume time minus the kill time. The
script checks that every parameter ends at the exact sum (no acknowledged push lost or
doubled) and prints the median and range over the rounds.

Usage: cargo build --release --bins && scripts/measure-failover.py [--rounds 5] [--policy bsp]
       [--kill server|coordinator]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "target" / "release" / "syncopate"
ITERATIONS = 600


def role_pids(run_dir: Path, role: str) -> list[int]:
    """The pids of the run's processes of ``role`` (server, coordinator), found by their
    command lines."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f" {role} " in cmd and str(run_dir / "tls") in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def one_round(policy: str, victim: str, base: Path, n: int) -> float:
    """Runs one round; returns seconds from the kill to training resuming."""
    run_dir = base / f"round-{n}"
    args = [
        str(BIN),
        "local",
        "--run-dir",
        str(run_dir),
        "--workload",
        "counter",
        "--lr",
        "1",
        "--momentum",
        "0",
        "--push-weight",
        "sum",
        "--workers",
        "3",
        "--servers",
        "2",
        "--shards",
        "3",
        "--iterations",
        str(ITERATIONS),
        "--params",
        "1024",
        "--delay-ms",
        "20",
        "--replicas",
        "1",
        "--policy",
        policy,
        "--checkpoint-every-s",
        "0",
    ]
    log = open(base / f"round-{n}.out", "w")
    local = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    time.sleep(3.0)
    pids = role_pids(run_dir, victim)
    if len(pids) != (2 if victim == "server" else 1):
        local.kill()
        sys.exit(f"round {n}: found {victim} processes {pids}")
    killed_at = time.time()
    os.kill(pids[0], signal.SIGKILL)
    if local.wait(timeout=300) != 0:
        sys.exit(f"round {n}: the run failed; see {base / f'round-{n}.out'}")
    model = (run_dir / "model.bin").read_bytes()
    values = set(struct.unpack(f"<{len(model) // 4}f", model))
    if values != {-6.0 * ITERATIONS}:
        sys.exit(f"round {n}: parameters {sorted(values)[:4]}, expected {-6.0 * ITERATIONS}")
    report = json.loads((run_dir / "report.json").read_text())
    resumed = []
    for w in report["workers"]:
        starts = sorted(t[0] for t in w["timeline"])
        pairs = zip(starts, starts[1:], strict=False)
        after = [(b - a, b) for a, b in pairs if b > killed_at]
        resumed.append(max(after)[1])
    return max(resumed) - killed_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--policy", default="bsp")
    parser.add_argument("--kill", choices=["server", "coordinator"], default="server")
    a = parser.parse_args()
    if not BIN.exists():
        sys.exit(f"{BIN} is missing: cargo build --release --bins")
    base = Path(tempfile.mkdtemp(prefix="syncopate-failover-"))
    times = [one_round(a.policy, a.kill, base, n) for n in range(a.rounds)]
    for n, t in enumerate(times):
        print(f"round {n}: {t:.2f} s from the {a.kill}'s kill to training resuming")
    print(
        f"{a.policy}, {a.kill} killed: median {statistics.median(times):.2f} s "
        f"(range {min(times):.2f}-{max(times):.2f}) over {len(times)} rounds; "
        "sums exact in every round"
    )


if __name__ == "__main__":
    main()
