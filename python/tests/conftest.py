"""Real clusters for the tests: the `syncopate` binary's coordinator and servers as processes on
loopback, with their own certificates and token. Nothing is mocked."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from netguard import Watch

from syncopate.cluster import Cluster, clean_env

__all__ = [
    "ROOT",
    "Cluster",
    "Lines",
    "Procs",
    "binary",
    "clean_env",
    "cluster_at",
    "finish",
    "run_syncopate",
    "start_local",
]

ROOT = Path(__file__).resolve().parents[2]

# Ray on loopback only. Ray finds its node's address itself, and rewrites 127.0.0.1 in
# `ray.init(address=...)` into it: the machine's external address, unless Ray clusters across
# machines are off, which this variable says (Ray's switch for one-machine Ray, named for the
# platforms where that is the default). Set before anything imports ray; every process the
# tests start, Ray's included, inherits it. The Ray tests also start their nodes with
# node_ip_address 127.0.0.1.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Ray runs its worker processes, the actors among them, at niceness 15: beside anything else
# busy on the machine (scripts/test-under-load.sh's hog) they would hardly run. At 0 they
# compete as every other process of the tests does.
os.environ["RAY_worker_niceness"] = "0"
# Ray reports usage statistics to usage-stats.ray.io unless told not to: its dashboard looked
# the name up (a DNS query to the machine's resolver, outside loopback) during a CI run.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


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


def start_local(procs: Procs, run: Path, *args: str) -> subprocess.Popen[str]:
    """Starts ``syncopate local --run-dir RUN ARGS`` as one of the test's ``procs`` (so its
    whole cluster is killed when the test ends) and returns once the cluster is up (its
    ``cluster.json`` written), for a test to act on the running cluster."""
    cmd = [str(binary()), "local", "--run-dir", str(run), *args]
    p = procs.start(cmd, env=_env(), cwd=ROOT)
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


@pytest.fixture(scope="session")
def netguard() -> Iterator[Watch]:
    """The loopback guard (:mod:`netguard`), watching every process of the run from its start
    to its end."""
    watch = Watch()
    watch.start()
    yield watch
    watch.stop()


@pytest.fixture(autouse=True)
def loopback_only(netguard: Watch) -> Iterator[None]:
    """Fails the test if, while it ran, a process of the run listened on or connected to an
    address outside loopback (outside a network namespace a test made)."""
    before = len(netguard.seen())
    yield
    netguard.sample()
    new = netguard.seen()[before:]
    if new:
        pytest.fail(
            "traffic outside loopback: tests may listen on and dial 127.0.0.0/8 and ::1 only\n"
            + "\n".join(map(str, new)),
            pytrace=False,
        )


class Procs:
    """The processes a test starts (:meth:`start`): each leads a process group of its own, and
    every group still there when the test ends, however it ends, is killed with all it holds,
    so nothing a test started outlives it and trips the next one."""

    def __init__(self) -> None:
        self.started: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], env: dict[str, str], **kw: Any) -> subprocess.Popen[str]:
        """Starts ``args`` with ``env``; its output is a text pipe (``stdout``, with stderr in
        it) unless ``kw`` says otherwise."""
        kw = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} | kw
        p = subprocess.Popen(args, env=env, start_new_session=True, **kw)
        self.started.append(p)
        return p

    def kill_all(self) -> None:
        """Kills every group started (idempotent) and reaps its leader."""
        for p in self.started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()


class Lines:
    """A process's output read line by line, every read with a time limit: a test that waits for
    a line fails when none comes instead of hanging (a plain ``readline`` blocks for ever if the
    process hangs without writing or exiting). A thread reads the pipe into a queue; nothing
    else may read ``p.stdout`` once this does."""

    def __init__(self, p: subprocess.Popen[str]) -> None:
        assert p.stdout is not None, "the process's output must be a pipe"
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        out = p.stdout

        def pump() -> None:
            for line in out:
                self.queue.put(line)
            self.queue.put(None)

        self.thread = threading.Thread(target=pump, daemon=True)
        self.thread.start()

    def line(self, within: float = 60) -> str:
        """The next line, stripped; fails if none comes within ``within`` seconds (a liveness
        limit) or the output ends."""
        try:
            line = self.queue.get(timeout=within)
        except queue.Empty:
            raise AssertionError(f"no line within {within} s; so far: {self.seen}") from None
        assert line is not None, f"the output ended; it was: {self.seen}"
        self.seen.append(line)
        return line.strip()

    def until(self, wanted: str, within: float = 60) -> list[str]:
        """Reads lines until one is ``wanted`` (stripped); all of them, that one last."""
        deadline = time.monotonic() + within
        lines = []
        while True:
            lines.append(self.line(max(0.0, deadline - time.monotonic())))
            if lines[-1] == wanted:
                return lines

    def rest(self, within: float = 60) -> str:
        """Everything until the output ends (the process exited), within ``within`` seconds."""
        deadline = time.monotonic() + within
        rest = []
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"the output did not end within {within} s") from None
            if line is None:
                return "".join(rest)
            rest.append(line)


@pytest.fixture
def procs() -> Iterator[Procs]:
    """Starts a test's own processes (:class:`Procs`); kills what is left of them afterwards."""
    owned = Procs()
    yield owned
    owned.kill_all()


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
