"""Every failure is a typed exception, raised promptly: bad settings, no cluster, a wrong token,
a server that dies, Ctrl-C in a deferred pull."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import syncopate
from conftest import Cluster, ClusterFactory, Lines, Procs


def test_missing_settings_raise_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in list(os.environ):
        if k.startswith("SYNCOPATE_"):
            monkeypatch.delenv(k)
    with pytest.raises(syncopate.ConfigError, match="coordinator"):
        syncopate.init()
    with pytest.raises(syncopate.ConfigError, match="cluster.json"):
        syncopate.init(cluster="/nonexistent/cluster.json")
    with pytest.raises(syncopate.ConfigError, match="slow-factor"):
        syncopate.init(coordinator="127.0.0.1:1", token="t", ca="/x", slow_factor="fast")
    s = syncopate.init(coordinator="127.0.0.1:9", token="t", ca="/x.pem", batch=64)
    assert s["coordinator"] == "127.0.0.1:9" and s["batch"] == 64
    syncopate._defaults.clear()


def test_wrong_token_raises_token_refused(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1)
    t = time.monotonic()
    with pytest.raises(syncopate.TokenRefused):
        syncopate.Worker([np.zeros(4, dtype=np.float32)], **{**c.settings, "token": "wrong"})
    assert time.monotonic() - t < 15


def test_nothing_listening_raises_cluster_unreachable(cluster: ClusterFactory) -> None:
    c = cluster(workers=1, servers=1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    with pytest.raises(syncopate.ClusterUnreachable):
        syncopate.Worker(
            [np.zeros(4, dtype=np.float32)], **{**c.settings, "coordinator": f"127.0.0.1:{port}"}
        )
    assert time.monotonic() - t < 60


def test_a_dead_server_raises_server_lost(cluster: ClusterFactory) -> None:
    # Without backups (with them, the default for two servers, the run goes on).
    c = cluster(workers=1, servers=2, peer_timeout_ms=1500, extra=["--replicas", "0"])
    w = syncopate.Worker([np.zeros(100, dtype=np.float32)], **c.settings, iterations=1000)
    buf = [np.zeros(100, dtype=np.float32)]
    w.pull(buf)
    w.push(buf)
    c.servers[1].send_signal(signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(syncopate.ServerLost):
        for _ in range(1000):
            w.pull(buf)
            w.push(buf)
    assert time.monotonic() - t < 30
    w.leave()


def wait_for(what: str, ok: Callable[[], bool], p: subprocess.Popen[str], within: float) -> None:
    """Waits until ``ok()``; fails if ``p`` exits first or ``within`` seconds pass (a liveness
    limit, generous for a loaded machine)."""
    deadline = time.monotonic() + within
    while not ok():
        assert p.poll() is None, f"the worker exited before {what}"
        assert time.monotonic() < deadline, f"no {what} within {within} s"
        time.sleep(0.05)


def asleep(pid: int) -> bool:
    """Whether process ``pid``'s main thread is sleeping (blocked, not runnable)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "S"


def shard_stats(c: Cluster) -> dict[str, int]:
    """The first shard's counters, from the coordinator's status."""
    return syncopate.status(c.cluster_file)["servers"][0]["shards"][0]["stats"]


@pytest.mark.parametrize("call", ["join", "pull", "push"])
def test_ctrl_c_interrupts_a_blocked_call_and_leaves(
    cluster: ClusterFactory, procs: Procs, call: str
) -> None:
    """SIGINT ends a worker blocked in a join (the start barrier waits for a worker that never
    comes), a pull (BSP defers it) or a push (its server is stopped): the call raises
    KeyboardInterrupt from inside, and the worker still leaves cleanly. The wait is woken by
    the signal, not polled, so this holds however busy the CPU is
    (``scripts/test-under-load.sh``)."""
    c = cluster(workers=2, servers=1, policy="bsp", peer_timeout_ms=120_000)
    script = str(Path(__file__).parent / "scripts" / "blocked.py")
    if call != "join":
        # The other worker joins (so the start barrier opens) and stays, never pushing.
        keep = "import numpy as np, syncopate, time;"
        keep += "w = syncopate.Worker([np.zeros(8, dtype=np.float32)], id=1); time.sleep(600)"
        procs.start([sys.executable, "-c", keep], env=c.env)
    stdin = subprocess.PIPE if call == "push" else subprocess.DEVNULL
    p = procs.start([sys.executable, script, call], env=c.env | {"SYNCOPATE_ID": "0"}, stdin=stdin)
    out = Lines(p)
    if call == "push":
        # Its server stopped before the push leaves, so no answer can come (one sent before
        # the stop once returned the call, and the signal landed after it).
        assert out.line() == "ready"
        c.servers[0].send_signal(signal.SIGSTOP)
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    assert out.line() == f"calling {call}"
    if call == "join":
        # Registered with the coordinator: inside the join, at the start barrier.
        wait_for("join", lambda: bool(syncopate.status(c.cluster_file)["workers"]), p, 60)
    elif call == "pull":
        wait_for("deferred pull", lambda: shard_stats(c)["pulls_deferred"] >= 1, p, 60)
    else:
        # Printing done, the script's main thread next sleeps in the push's wait (no server
        # answers): a signal sent before that would land in the printing, not in the push.
        wait_for("push", lambda: asleep(p.pid), p, 60)
    # The innermost Python frame of each call's wait (a push's is after its copy).
    method = {"join": "__init__", "push": "_push_staged"}.get(call, call)
    try:
        p.send_signal(signal.SIGINT)
        assert out.line() == f"interrupted in {method}"
    finally:
        if call == "push":
            c.servers[0].send_signal(signal.SIGCONT)
    p.wait(timeout=60)
    rest = out.rest()
    assert p.returncode == 3, rest
    assert rest.split() == ["left"]


def test_leave_cancels_a_background_pull(cluster: ClusterFactory, procs: Procs) -> None:
    """A pull_async that the policy defers does not keep leave() waiting: it gives up with a
    UsageError, and the worker leaves."""
    c = cluster(workers=2, servers=1, policy="bsp", peer_timeout_ms=120_000)
    keep = "import numpy as np, syncopate, time;"
    keep += "w = syncopate.Worker([np.zeros(8, dtype=np.float32)], id=1); time.sleep(600)"
    procs.start([sys.executable, "-c", keep], env=c.env)
    buf = [np.zeros(8, dtype=np.float32)]
    w = syncopate.Worker(buf, **c.settings, id=0)
    w.pull(buf)
    w.push(buf)
    h = w.pull_async(buf)
    deadline = time.monotonic() + 60
    while shard_stats(c)["pulls_deferred"] < 1:
        assert not h.done() and time.monotonic() < deadline
        time.sleep(0.05)
    assert w.leave() is not None
    with pytest.raises(syncopate.UsageError, match="left the cluster while this call waited"):
        h.wait(timeout=60)


def test_a_killed_worker_does_not_hang_the_others(cluster: ClusterFactory, procs: Procs) -> None:
    c = cluster(workers=3, servers=2, policy="bsp", lr=0.05, peer_timeout_ms=1500)
    script = Path(__file__).parent / "scripts" / "linear.py"
    workers = [
        procs.start(
            [sys.executable, str(script)],
            env=c.env
            | {"SYNCOPATE_ID": str(i), "SYNCOPATE_ITERATIONS": "300", "SYNCOPATE_DELAY_MS": "5"},
        )
        for i in range(3)
    ]
    time.sleep(1.0)
    workers[2].kill()
    outs = []
    for p in workers[:2]:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        outs.append(out)
    for out in outs:
        assert "iterations 300" in out
