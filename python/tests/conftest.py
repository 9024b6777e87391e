"""Real clusters for the tests: the `syncopate` binary's coordinator and servers as processes on
loopback, with their own certificates and token. Nothing is mocked."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def binary() -> Path:
    """The `syncopate` executable: $SYNCOPATE_BIN, or cargo's debug build (`cargo build`)."""
    exe = Path(os.environ.get("SYNCOPATE_BIN", ROOT / "target" / "debug" / "syncopate"))
    if not exe.exists():
        pytest.fail(f"{exe} not found: run `cargo build --bin syncopate` (scripts/test.sh does)")
    return exe


def clean_env() -> dict[str, str]:
    """This environment without any SYNCOPATE_* setting (tests pass theirs explicitly)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SYNCOPATE_")}


class Cluster:
    """A coordinator and servers, started; workers are the tests' own."""

    def __init__(
        self,
        tmp: Path,
        *,
        workers: int = 1,
        servers: int = 2,
        policy: str = "bsp",
        lr: float = 1.0,
        momentum: float = 0.0,
        peer_timeout_ms: int = 2000,
        shards: int | None = None,
    ) -> None:
        self.dir = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.tls = tmp / "tls"
        self.procs: list[subprocess.Popen[bytes]] = []
        exe = str(binary())
        subprocess.run(
            [exe, "certs", str(self.tls)], check=True, env=clean_env(), capture_output=True
        )
        ready = tmp / "coordinator.addr"
        args = [exe, "coordinator", "--listen", "127.0.0.1:0", "--servers", str(servers)]
        args += ["--workers", str(workers), "--ready-file", str(ready), "--tls-dir", str(self.tls)]
        args += ["--policy", policy, "--lr", str(lr), "--momentum", str(momentum)]
        args += ["--peer-timeout-ms", str(peer_timeout_ms)]
        if shards is not None:
            args += ["--shards", str(shards)]
        self._spawn("coordinator", args)
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError("the coordinator did not start: " + self.log("coordinator"))
            time.sleep(0.02)
        self.addr = ready.read_text().strip()
        self.servers = []
        for s in range(servers):
            a = [exe, "server", "--coordinator", self.addr, "--tls-dir", str(self.tls)]
            self.servers.append(self._spawn(f"server-{s}", a))

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 (the process owns it)
        env = clean_env() | {"SYNCOPATE_TOKEN": self.token}
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        """A process's log."""
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def settings(self) -> dict[str, str]:
        """What a worker joins with."""
        return {"coordinator": self.addr, "ca": str(self.tls / "cert.pem"), "token": self.token}

    @property
    def env(self) -> dict[str, str]:
        """The same, as the environment a worker script reads."""
        return clean_env() | {
            "SYNCOPATE_COORDINATOR": self.addr,
            "SYNCOPATE_CA": str(self.tls / "cert.pem"),
            "SYNCOPATE_TOKEN": self.token,
        }

    def stop(self) -> None:
        """Kills every process."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=10)


ClusterFactory = Callable[..., Cluster]
"""What the ``cluster`` fixture gives: ``cluster(workers=2, policy="ssp:s=1")`` starts one."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[ClusterFactory]:
    """Starts clusters (`cluster(workers=2, policy="ssp:s=1")`); all are stopped afterwards."""
    started: list[Cluster] = []

    def start(**kw: object) -> Cluster:
        c = Cluster(tmp_path / f"cluster-{len(started)}", **kw)  # type: ignore[arg-type]
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()
