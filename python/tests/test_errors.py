"""Every failure is a typed exception, raised promptly: bad settings, no cluster, a wrong token,
a server that dies, Ctrl-C in a deferred pull."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import syncopate
from conftest import ClusterFactory


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


def test_ctrl_c_interrupts_a_deferred_pull_and_leaves(
    cluster: ClusterFactory, tmp_path: Path
) -> None:
    # Two workers under BSP; only one runs, so its second pull is deferred for ever.
    c = cluster(workers=2, servers=1, policy="bsp")
    script = tmp_path / "stuck.py"
    script.write_text(
        textwrap.dedent(
            """
            import sys
            import numpy as np
            import syncopate
            w = syncopate.Worker([np.zeros(8, dtype=np.float32)], id=0)
            buf = [np.zeros(8, dtype=np.float32)]
            w.pull(buf)
            w.push(buf)
            print("waiting", flush=True)
            try:
                w.pull(buf)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
                w.leave()
                print("left", flush=True)
                sys.exit(3)
            """
        )
    )
    # The other worker joins (so the start barrier opens) and stays, never pushing.
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import numpy as np, syncopate, time;"
            "w = syncopate.Worker([np.zeros(8, dtype=np.float32)], id=1); time.sleep(120)",
        ],
        env=c.env,
    )
    p = subprocess.Popen(
        [sys.executable, str(script)], env=c.env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "waiting"
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        t = time.monotonic()
        out, _ = p.communicate(timeout=30)
        assert time.monotonic() - t < 10
        assert p.returncode == 3, out
        assert out.split() == ["interrupted", "left"]
    finally:
        for proc in (p, other):
            if proc.poll() is None:
                proc.kill()


def test_a_killed_worker_does_not_hang_the_others(cluster: ClusterFactory) -> None:
    c = cluster(workers=3, servers=2, policy="bsp", lr=0.05, peer_timeout_ms=1500)
    script = Path(__file__).parent / "scripts" / "linear.py"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=c.env
            | {"SYNCOPATE_ID": str(i), "SYNCOPATE_ITERATIONS": "300", "SYNCOPATE_DELAY_MS": "5"},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(3)
    ]
    time.sleep(1.0)
    procs[2].kill()
    outs = []
    for p in procs[:2]:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out
        outs.append(out)
    for out in outs:
        assert "iterations 300" in out
