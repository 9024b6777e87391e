"""``syncopate.ray``: whole clusters launched on a real local Ray instance (Ray from PyPI, on this
machine; ``ray.cluster_utils.Cluster`` for several nodes). The coordinator and servers are the
``syncopate`` binary in Ray actors, the workers are training functions in Ray actors, and
nothing is mocked."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
from ray.cluster_utils import Cluster as RayCluster

import syncopate
import syncopate.ray as sray
from conftest import ROOT, Lines, Procs, binary

DIM = 16
LOOPBACK = "127.0.0.1"


def counter(config: dict[str, Any]) -> dict[str, Any]:
    """Known values: worker ``rank`` pushes ``rank + 1`` in every parameter at every iteration,
    ``config["pace_s"]`` apart. With SGD at rate 1, no momentum and summed pushes, every
    parameter ends at exactly minus the sum of all pushes."""
    weights = np.zeros(DIM, dtype=np.float32)
    worker = syncopate.Worker([weights])
    grad = np.full(DIM, worker.rank + 1, dtype=np.float32)
    while worker.pull([weights]) is not None:
        time.sleep(config["pace_s"])
        worker.push([grad])
    report = worker.leave()
    assert report is not None
    return {"rank": report["worker"], "iterations": report["iterations"], "pid": os.getpid()}


EXACT = {"lr": 1.0, "momentum": 0.0, "push_weight": "sum"}


def syncopate_processes() -> list[tuple[int, str]]:
    """Every live ``syncopate`` process that an actor of :mod:`syncopate.ray` started (its
    certificate is in the actor's ``syncopate-<role>-*`` directory), and every live actor
    (Ray names an actor's process ``ray::<class>``), as (pid, command line)."""
    exe = str(binary())
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(") ")[-1][0]
        except OSError:
            continue
        first = cmd[0].decode(errors="replace") if cmd else ""
        line = b" ".join(cmd).decode(errors="replace")
        actor = first.startswith(("ray::_Role", "ray::_Worker"))
        ours = first == exe and re.search(r"/syncopate-(coordinator|server-\d+)-", line)
        if (ours or actor) and state != "Z":
            found.append((int(entry.name), line))
    return found


NODES = 3


class RunProcesses:
    """The test's own processes of :func:`syncopate_processes`: those that were not there when
    the test began (tests run one at a time, and an actor's process hosts one actor)."""

    def __init__(self) -> None:
        self.before = {pid for pid, _ in syncopate_processes()}

    def mine(self) -> list[tuple[int, str]]:
        """This test's processes still alive."""
        return [p for p in syncopate_processes() if p[0] not in self.before]

    def assert_none_left(self) -> None:
        """None of the test's processes is left: the binary's at once, the actors' within 30 s
        (Ray kills an actor's process asynchronously)."""
        assert not [p for p in self.mine() if not p[1].startswith("ray::")]
        deadline = time.monotonic() + 30
        while left := self.mine():
            assert time.monotonic() < deadline, left
            time.sleep(0.2)

    def kill_left(self) -> None:
        """Kills whatever of the test's processes is still alive."""
        for pid, _ in self.mine():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def own() -> Iterator[RunProcesses]:
    """The test's own run processes; any left when it ends are killed, so that a test that
    fails or times out leaves nothing to trip the next one."""
    watch = RunProcesses()
    yield watch
    watch.kill_left()


@pytest.fixture(scope="module")
def local_ray() -> Iterator[str]:
    """A Ray cluster of three nodes on this machine (``ray.cluster_utils.Cluster``: a raylet
    each), for the module's tests; shut down after them."""
    os.environ["SYNCOPATE_BIN"] = str(binary())
    # A small object store each (the runs pass only small objects): three default ones would
    # ask for most of the machine's shared memory. Every node, and so everything Ray and
    # syncopate.ray start on it, on loopback.
    node = {"num_cpus": 2, "object_store_memory": 200 << 20, "node_ip_address": LOOPBACK}
    # No dashboard: the tests do not use it, and it is one more process on a 2-core machine.
    cluster = RayCluster(initialize_head=True, head_node_args=node | {"include_dashboard": False})
    for _ in range(NODES - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    # The actors unpickle this module's training functions by name: they import it from here.
    here = str(Path(__file__).parent)
    env = {"PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    ray.init(address=cluster.address, _node_ip_address=LOOPBACK, runtime_env={"env_vars": env})
    yield cluster.address
    ray.shutdown()
    cluster.shutdown()


def exact_model(report: dict[str, Any], workers: int, iterations: int) -> None:
    model = np.fromfile(Path(report["run_dir"]) / "model.bin", dtype="<f4")
    assert model.shape == (DIM,)
    expected = -sum(r + 1 for r in range(workers)) * iterations
    assert np.all(model == expected), (model, expected)


def test_a_counter_run_on_ray_applies_every_push_once_and_leaves_nothing_running(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    report = sray.launch(
        counter,
        workers=3,
        servers=2,
        policy="ssp:s=2",
        iterations=40,
        config={"pace_s": 0.01},
        run_dir=tmp_path / "run",
        timeout_s=120,
        host=LOOPBACK,
        **EXACT,
    )
    # The roles listened where `host` said.
    cluster = json.loads((tmp_path / "run" / "cluster.json").read_text())
    assert cluster["coordinator"].startswith(f"{LOOPBACK}:"), cluster
    assert [r["iterations"] for r in report["results"]] == [40, 40, 40]
    assert [w["iterations"] for w in report["workers"]] == [40, 40, 40]
    exact_model(report, 3, 40)
    assert report["startup_s"] is not None and 0 < report["startup_s"] < report["elapsed_s"]
    assert report["policy"] == "builtin:ssp"
    # Spread over the nodes: the servers on two, the workers on more than one.
    placed = report["placement"]
    assert placed["server-0"] != placed["server-1"], placed
    assert len({placed[f"worker-{w}"] for w in range(3)}) > 1, placed
    own.assert_none_left()


def until_min_clock(run: sray.RayRun, clock: int) -> None:
    """Waits until every worker has pushed ``clock`` iterations."""
    deadline = time.monotonic() + 60
    while (run._look() or {}).get("min_clock") is None or run.timeline[-1]["min_clock"] < clock:
        assert run.running() and time.monotonic() < deadline, run.timeline[-3:]
        time.sleep(0.1)


def counter_run_killed(
    tmp_path: Path, at_clock: int, kill: Callable[[sray.RayRun], None], **kw: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A counter run under BSP (exact arithmetic, 20 ms per iteration) in which ``kill(run)``
    is called once every worker has pushed ``at_clock`` iterations. Returns the report and the
    progress last seen before the kill."""
    run = sray.start(
        counter, policy="bsp", config={"pace_s": 0.02}, run_dir=tmp_path / "run", **EXACT, **kw
    )
    try:
        until_min_clock(run, at_clock)
        before = run.timeline[-1]
        kill(run)
    except BaseException:
        run.stop()
        raise
    return run.wait(timeout_s=240), before


def test_killing_a_server_actor_mid_run_loses_no_push(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    report, _ = counter_run_killed(
        tmp_path, 30, lambda run: run.kill_server(0), workers=3, servers=2, shards=3, iterations=150
    )
    assert report["lost_servers"] == [0], report["status"]
    assert [w["iterations"] for w in report["workers"]] == [150] * 3
    exact_model(report, 3, 150)
    own.assert_none_left()


def torch_example(argv: list[str]) -> dict[str, Any]:
    """The PyTorch example's ``main``, run in the worker actor."""
    sys.path.insert(0, str(ROOT / "examples" / "torch"))
    import train  # noqa: PLC0415 (imported in the actor)

    return train.main(argv)


def test_the_torch_example_trains_on_ray_across_a_hot_swap(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    # The example's MLP on 6,000 images per worker, scored on 2,000 every 20 iterations.
    argv = ["--model", "mlp", "--threads", "1", "--train-limit", "12000", "--test-limit", "2000"]
    argv += ["--eval-every", "20", "--epochs", "5"]
    run = sray.start(
        torch_example,
        workers=2,
        servers=2,
        policy="bsp",
        config=argv,
        run_dir=tmp_path / "run",
        progress_every_s=1.0,
    )
    try:
        deadline = time.monotonic() + 180
        while not (run._look() or {}).get("accuracy"):
            assert run.running() and time.monotonic() < deadline, "no score before the swap"
            time.sleep(0.2)
        assert run.swap("ssp:s=2") == (1, 2)
    except BaseException:
        run.stop()
        raise
    report = run.wait(timeout_s=420)
    assert report["swaps"] == 1 and report["policy"] == "builtin:ssp", report["policy"]
    scored = [(p["policy"], p["accuracy"]) for p in report["timeline"] if p["accuracy"]]
    before = [a for policy, a in scored if "bsp" in policy]
    after = [a for policy, a in scored if "ssp" in policy]
    # Scores were seen under both policies, and training went on improving across the swap.
    assert before and after, scored
    assert max(after) > before[0], scored
    # Chance is 0.10; three passes gave 0.79-0.81 under `syncopate local`, five 0.84 here.
    assert report["results"][0]["final_accuracy"] > 0.75, report["results"][0]
    assert all(r["iterations"] >= 930 for r in report["results"]), report["results"]
    assert report["startup_s"] is not None
    own.assert_none_left()


def fails(config: Any) -> None:
    """Worker 1 raises at its first iteration; worker 0 waits for it at BSP's barrier."""
    weights = np.zeros(DIM, dtype=np.float32)
    worker = syncopate.Worker([weights])
    while worker.pull([weights]) is not None:
        if worker.rank == 1:
            raise ValueError("worker 1 gives up")
        worker.push([weights])


def test_a_failing_train_fn_stops_everything_and_raises(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    with pytest.raises(ray.exceptions.RayTaskError, match="worker 1 gives up"):
        sray.launch(fails, workers=2, servers=1, iterations=1000, run_dir=tmp_path / "r")
    own.assert_none_left()


def test_ctrl_c_in_the_driver_stops_everything(
    local_ray: str, tmp_path: Path, own: RunProcesses, procs: Procs
) -> None:
    here = Path(__file__).parent
    env = os.environ | {
        "RAY_ADDRESS": local_ray,
        "PYTHONPATH": f"{here}{os.pathsep}{here / 'scripts'}",
    }
    driver = [sys.executable, str(here / "scripts" / "ray_driver.py"), str(tmp_path / "run")]
    p = procs.start(driver, env=env)
    out = Lines(p)
    lines = out.until("training", within=300)
    assert own.mine(), "the run was not under way:\n" + "\n".join(lines)
    p.send_signal(signal.SIGINT)
    # A liveness limit: stopping takes seconds (RayRun.stop bounds each of its steps).
    p.wait(timeout=120)
    out = "\n".join(lines) + out.rest()
    assert p.returncode != 0, out
    assert "KeyboardInterrupt" in out, out
    own.assert_none_left()


def test_more_workers_than_the_cluster_can_run_at_once_is_refused(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    # The workers wait for each other: if some could not be placed, the run would hang.
    with pytest.raises(
        ValueError, match="the 7 workers need 7 CPU in all and the Ray cluster has 6"
    ):
        sray.launch(counter, workers=7, servers=1, config={"pace_s": 0}, run_dir=tmp_path / "r")
    own.assert_none_left()


def test_a_killed_worker_actor_is_restarted_and_no_push_is_doubled(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    after: list[dict[str, Any]] = []

    def kill_and_look(run: sray.RayRun) -> None:
        run.kill_worker(1)
        deadline = time.monotonic() + 30
        while (point := run._look()) is None:
            assert time.monotonic() < deadline, "the coordinator answered nobody for 30 s"
            time.sleep(0.1)
        after.append(point)

    report, before = counter_run_killed(
        tmp_path,
        30,
        kill_and_look,
        workers=3,
        servers=2,
        iterations=120,
        restart_workers=1,
    )
    assert report["restarts"] == {1: 1} and report["lost_workers"] == []
    assert [r["iterations"] for r in report["results"]][0::2] == [120, 120]
    # The servers dropped the dead process; the new one joined as a late joiner does, at the
    # slowest worker's iteration, and went on to the end of the budget.
    again = report["results"][1]["iterations"]
    assert 0 < again < 120 - 30
    model = np.fromfile(Path(report["run_dir"]) / "model.bin", dtype="<f4")
    # Workers 0 and 2 push 1 and 3 every iteration; what is left is worker 1's pushes of 2:
    # those of its first process and every one of the second's, each once. The first process's
    # pushes that reached a shard (every one is applied) number at least the clocks seen before
    # the kill; under BSP it pushed iteration i only once every worker's clock there was at least
    # i, so at most one more than the clocks of the others seen after it. A push is not atomic
    # across shards: the one the kill interrupted may have reached some shards and not others,
    # so the shards' counts differ by one at most. (A shard that took the new process afresh at
    # the others' clock while another still counted the dead one must not acknowledge the new
    # one's first push as a duplicate: its clocks are levelled first, `worker::join`.)
    firsts = set()
    for value in set(model.tolist()):
        first = (-value - (1 + 3) * 120) / 2 - again
        assert first == int(first), model
        seen = (first, before, after, again)
        assert before["min_clock"] <= first <= after[0]["max_clock"] + 1, seen
        firsts.add(int(first))
    assert max(firsts) - min(firsts) <= 1, model
    own.assert_none_left()


def test_without_restarts_a_killed_worker_actor_is_dropped_and_the_others_finish(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    report, _ = counter_run_killed(
        tmp_path,
        20,
        lambda run: run.kill_worker(1),
        workers=2,
        servers=1,
        iterations=80,
        peer_timeout_ms=2000,
    )
    assert report["lost_workers"] == [1]
    assert [r["iterations"] for r in report["results"]] == [80]
    own.assert_none_left()


def test_killing_the_coordinator_actor_mid_run_restarts_it_and_loses_no_push(
    local_ray: str, tmp_path: Path, own: RunProcesses
) -> None:
    kw: dict[str, Any] = {"workers": 3, "servers": 2, "shards": 3, "iterations": 150}
    report, _ = counter_run_killed(tmp_path, 30, lambda run: run.kill_coordinator(), **kw)
    assert len(report["coordinator_restarts"]) == 1, report["coordinator_restarts"]
    assert report["lost_servers"] == [], report["status"]
    assert [w["iterations"] for w in report["workers"]] == [150] * 3
    exact_model(report, 3, 150)
    log = (Path(report["run_dir"]) / "logs" / "coordinator.log").read_text()
    assert "cluster rebuilt from the servers' holdings" in log, log
    own.assert_none_left()
