"""Python workers across a failover: ``syncopate local --replicas 1 --script`` with a server
killed mid-run. The scripts' pushes and pulls to the lost server are retried on the backups
that take over, and no acknowledged push is lost or applied twice. The same across the
coordinator's death and restart."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np

import syncopate
from conftest import Procs, finish, start_local

SCRIPT = Path(__file__).parent / "scripts" / "counter.py"
ITERATIONS = 200


def role_pids(run: Path, role: str = "server") -> list[int]:
    """The pids of the run's processes of ``role``, found by their command lines."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f" {role} " in cmd and str(run / "tls") in cmd:
            pids.append(int(entry.name))
    return sorted(pids)


def min_clock(cluster: Path) -> int:
    """The slowest worker's clock over every shard."""
    status = syncopate.status(cluster)
    clocks = [w["clock"] for s in status["servers"] for sh in s["shards"] for w in sh["workers"]]
    return min(clocks, default=0)


def wait_for_clock(cluster: Path, clock: int) -> None:
    """Waits until every script has pushed ``clock`` iterations."""
    deadline = time.monotonic() + 60
    while min_clock(cluster) < clock:
        assert time.monotonic() < deadline, f"the scripts did not reach iteration {clock}"
        time.sleep(0.1)


def assert_exact(run: Path) -> np.ndarray:
    """Checks that every script ran every iteration and that the model is exactly minus the sum
    of every push (none lost or applied twice); returns the model."""
    model = np.fromfile(run / "model.bin", dtype="<f4")
    assert np.all(model == -(1 + 2 + 3) * ITERATIONS), model
    workers = [json.loads((run / "workers" / f"worker-{w}.json").read_text()) for w in range(3)]
    assert [w["iterations"] for w in workers] == [ITERATIONS] * 3
    return model


def test_python_workers_go_on_past_a_killed_server_and_every_push_counts_once(
    tmp_path: Path,
    procs: Procs,
) -> None:
    run = tmp_path / "run"
    args = ["--workers", "3", "--servers", "2", "--shards", "3", "--policy", "ssp:s=2"]
    args += ["--lr", "1", "--momentum", "0", "--push-weight", "sum", "--replicas", "1"]
    args += ["--iterations", str(ITERATIONS), "--script", str(SCRIPT)]
    p = start_local(procs, run, *args)
    wait_for_clock(run / "cluster.json", 50)
    pids = role_pids(run)
    assert len(pids) == 2, pids
    os.kill(pids[0], signal.SIGKILL)
    out = finish(p, timeout=120)
    assert "failover:" in out, out
    model = assert_exact(run)
    assert model.shape == (16,)


def test_python_workers_ride_out_a_coordinator_restart_and_every_push_counts_once(
    tmp_path: Path,
    procs: Procs,
) -> None:
    """The coordinator SIGKILLed mid-run and started again by ``local``: the scripts' pushes
    wait out the servers' lapsed leases, and each script rejoins the new coordinator."""
    run = tmp_path / "run"
    args = ["--workers", "3", "--servers", "2", "--shards", "3", "--policy", "bsp"]
    args += ["--lr", "1", "--momentum", "0", "--push-weight", "sum"]
    args += ["--iterations", str(ITERATIONS), "--script", str(SCRIPT)]
    p = start_local(procs, run, *args)
    wait_for_clock(run / "cluster.json", 50)
    coordinator = role_pids(run, "coordinator")
    assert len(coordinator) == 1, coordinator
    os.kill(coordinator[0], signal.SIGKILL)
    out = finish(p, timeout=120)
    assert "starting it again" in out, out
    report = json.loads((run / "report.json").read_text())
    assert len(report["coordinator_restarts"]) == 1, report["coordinator_restarts"]
    assert_exact(run)
    rebuilt = (run / "logs" / "coordinator-2.log").read_text()
    assert "cluster rebuilt from the servers' holdings" in rebuilt, rebuilt
