"""``--tensorboard DIR`` on ``syncopate local`` and ``syncopate ab``: the event files are read
back by TensorBoard's own reader (``EventAccumulator``), and hold what the runs' reports say,
look for look."""

from __future__ import annotations

import json
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from conftest import run_syncopate

TINY = """
name = "tiny"
workload = "fashion-mlp"
workers = 2
servers = 1
compute_ms = 20
time_limit_s = 3

[[slow]]
worker = 0
factor = 3.0
"""


def scalars(run: Path) -> dict[str, list[tuple[float, int, float]]]:
    """Every scalar series in the event files under ``run``, as TensorBoard reads them:
    (wall time, step, value) by tag."""
    acc = EventAccumulator(str(run))
    acc.Reload()
    return {
        tag: [(e.wall_time, e.step, e.value) for e in acc.Scalars(tag)]
        for tag in acc.Tags()["scalars"]
    }


def check_against_report(series: dict[str, list[tuple[float, int, float]]], report: dict) -> None:
    """The accuracy series is the report's looks: one event per look that scored the model,
    at the look's iterations, wall time the run's start plus the look's time."""
    looks = [p for p in report["watch"] if p.get("accuracy") is not None]
    assert looks, "the run scored its model"
    accuracy = series["train/accuracy"]
    assert [s for _, s, _ in accuracy] == [p["iterations"] for p in looks]
    for (wall, _, value), p in zip(accuracy, looks, strict=True):
        assert abs(value - p["accuracy"]) < 1e-6
        assert abs(wall - (report["started_unix_s"] + p["t_s"])) < 1e-3
    loss = [v for *_, v in series["train/loss"]]
    assert len(loss) == len(looks)
    assert all(abs(v - p["loss"]) < 1e-5 for v, p in zip(loss, looks, strict=True))
    deferred = [v for *_, v in series["cluster/deferred_pulls"]]
    assert deferred == sorted(deferred), "a cumulative count"
    assert all(v >= 0 for *_, v in series["cluster/iterations_per_s"])
    assert max(v for *_, v in series["cluster/iterations_per_s"]) > 0
    assert all(0 <= v <= 1 for *_, v in series["cluster/waiting_share"])
    # Staleness and the servers' traffic (a simulated run's as its links modelled it).
    assert all(v >= 0 for *_, v in series["cluster/staleness_mean"])
    traffic = [v for *_, v in series["cluster/server_bytes"]]
    assert traffic == sorted(traffic) and traffic[-1] > 0, "a cumulative count that grew"
    assert all(v >= 0 for *_, v in series["cluster/server_bytes_per_s"])


def test_ab_writes_one_run_per_policy_and_seed_that_tensorboard_reads(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.toml"
    scenario.write_text(TINY)
    tb, out = tmp_path / "tb", tmp_path / "ab"
    done = run_syncopate(
        "ab",
        "--simulate",
        "--scenario",
        str(scenario),
        "--policies",
        "bsp,asp",
        "--repeat",
        "2",
        "--tensorboard",
        str(tb),
        "--out",
        str(out),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout
    runs = sorted(str(p.parent.relative_to(tb)) for p in tb.rglob("events.out.tfevents.*"))
    assert runs == ["asp/seed-1", "asp/seed-2", "bsp/seed-1", "bsp/seed-2"]
    for run in runs:
        report = json.loads((out / run / "report.json").read_text())
        check_against_report(scalars(tb / run), report)
    # BSP makes the fast worker wait for the slow one at its barrier; ASP never defers a pull.
    assert scalars(tb / "asp/seed-1")["cluster/deferred_pulls"][-1][2] == 0
    assert scalars(tb / "bsp/seed-1")["cluster/deferred_pulls"][-1][2] > 0


def test_a_local_run_writes_its_looks_as_it_runs(tmp_path: Path) -> None:
    tb, run = tmp_path / "tb", tmp_path / "run"
    done = run_syncopate(
        "local",
        "--run-dir",
        str(run),
        "--workers",
        "2",
        "--servers",
        "1",
        "--iterations",
        "150",
        "--policy",
        "ssp:s=2",
        "--tensorboard",
        str(tb),
        timeout=300,
    )
    assert done.returncode == 0, done.stdout
    assert f"tensorboard: {tb}" in done.stdout
    check_against_report(scalars(tb), json.loads((run / "report.json").read_text()))
