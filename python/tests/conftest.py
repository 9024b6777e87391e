"""Real clusters for the tests: the `syncopate` binary's coordinator and servers as processes on
loopback, with their own certificates and token. Nothing is mocked."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from syncopate.cluster import Cluster, clean_env

__all__ = [
    "ROOT",
    "Cluster",
    "binary",
    "clean_env",
    "cluster_at",
    "finish",
    "run_syncopate",
    "start_local",
]

ROOT = Path(__file__).resolve().parents[2]


def binary() -> Path:
    """The `syncopate` executable: $SYNCOPATE_BIN, or cargo's debug build (`cargo build`)."""
    exe = Path(os.environ.get("SYNCOPATE_BIN", ROOT / "target" / "debug" / "syncopate"))
    if not exe.exists():
        pytest.fail(f"{exe} not found: run `cargo build --bin syncopate` (scripts/test.sh does)")
    return exe


def cluster_at(tmp: Path, **kw: object) -> Cluster:
    """A coordinator and servers of :func:`binary`, in ``tmp``."""
    return Cluster(tmp, exe=binary(), **kw)  # type: ignore[arg-type]


def _env() -> dict[str, str]:
    """The environment the binary runs in: no inherited SYNCOPATE_* settings, and this Python
    (with the package and torch) for the worker scripts it starts."""
    return clean_env() | {"SYNCOPATE_PYTHON": sys.executable}


def run_syncopate(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs ``syncopate ARGS`` from the checkout to its end; its output is in ``stdout``."""
    return subprocess.run(
        [str(binary()), *args],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def start_local(run: Path, *args: str) -> subprocess.Popen[str]:
    """Starts ``syncopate local --run-dir RUN ARGS`` and returns once its cluster is up (its
    ``cluster.json`` written), for a test to act on the running cluster."""
    cmd = [str(binary()), "local", "--run-dir", str(run), *args]
    p = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 60
    while not (run / "cluster.json").exists():
        if p.poll() is not None or time.monotonic() > deadline:
            p.kill()
            pytest.fail(f"the cluster did not start: {p.communicate()[0]}")
        time.sleep(0.05)
    return p


def finish(p: subprocess.Popen[str], timeout: float) -> str:
    """Waits for a process of :func:`start_local` to end (killing it if the test fails first)
    and checks it succeeded; returns its output."""
    try:
        out, _ = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    return out


ClusterFactory = Callable[..., Cluster]
"""What the ``cluster`` fixture gives: ``cluster(workers=2, policy="ssp:s=1")`` starts one."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Starts clusters (`cluster(workers=2, policy="ssp:s=1")`); all are stopped afterwards."""
    started: list[Cluster] = []

    def start(**kw: object) -> Cluster:
        c = cluster_at(tmp_path / f"cluster-{len(started)}", **kw)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()
