"""`syncopate local --script`: user scripts as the workers of a local cluster, with the
launcher's heterogeneity injection, reports and hot swap from Python."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import syncopate
from conftest import Procs, finish, run_syncopate, start_local

SCRIPT = Path(__file__).parent / "scripts" / "linear.py"


def test_scripts_run_as_workers_with_slowdowns_reports_and_a_hot_swap(
    tmp_path: Path, procs: Procs
) -> None:
    run = tmp_path / "run"
    args = ["--workers", "2", "--servers", "2", "--policy", "ssp:s=1", "--lr", "0.05"]
    args += ["--momentum", "0", "--iterations", "150", "--delay-ms", "10", "--slow", "1:3"]
    p = start_local(procs, run, *args, "--script", str(SCRIPT))
    time.sleep(0.5)
    cluster = run / "cluster.json"
    number, shards = syncopate.swap("asp", cluster=cluster)
    assert number == 1 and shards == 2
    status = syncopate.status(cluster)
    assert status["swaps"] == 1 and "asp" in status["policy"], status
    finish(p, timeout=120)
    report = json.loads((run / "report.json").read_text())
    assert report["swaps"] == 1
    workers = [json.loads((run / "workers" / f"worker-{w}.json").read_text()) for w in range(2)]
    assert [w["iterations"] for w in workers] == [150, 150]
    # Worker 1 computes 3x slower (its 10 ms of pacing stretched to 30): worker 0 waits on it
    # under SSP until the swap.
    assert workers[0]["deferred_pulls"] > 0
    logs = (run / "logs" / "worker-0.log").read_text()
    assert "iterations 150" in logs
    # The launcher shares the cores out among the scripts' math libraries unless told otherwise.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert f"OMP_NUM_THREADS={threads}" in logs, logs


def test_a_script_reports_its_accuracy_and_the_launcher_stops_at_the_target(tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = ["local", "--workers", "2", "--servers", "1", "--policy", "bsp", "--lr", "0.05"]
    args += ["--momentum", "0", "--delay-ms", "5", "--eval-every-ms", "100"]
    args += ["--target-accuracy", "0.9", "--run-dir", str(run), "--script", str(SCRIPT)]
    # No iteration budget: only the target, which the script's own scores reach, ends the run.
    p = run_syncopate(*args, timeout=120)
    assert p.returncode == 0, p.stdout
    assert "target test accuracy 90.0% reached" in p.stdout, p.stdout
    report = json.loads((run / "report.json").read_text())
    assert report["time_to_target_s"] is not None
    assert report["final_accuracy"] >= 0.9 and report["best_accuracy"] >= 0.9
    scored = [w for w in report["watch"] if w["accuracy"] is not None]
    # The scores rose as the model trained, and the loss came with them.
    assert scored and scored[0]["accuracy"] < 0.9 <= scored[-1]["accuracy"], scored
    assert all(w["loss"] is not None for w in scored)
    status_lines = [ln for ln in p.stdout.splitlines() if "test accuracy" in ln]
    assert status_lines, p.stdout
    assert any(f.endswith("accuracy.svg") for f in report["plots"]), report["plots"]
