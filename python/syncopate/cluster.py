"""A coordinator and servers of the ``syncopate`` binary, started as processes on this machine
with their own certificate and token, for scripts that bring their own workers: tests,
benchmarks, notebooks. (``syncopate local`` runs whole clusters, workers included.)

::

    from syncopate.cluster import Cluster

    with Cluster("/tmp/c", exe="target/release/syncopate", servers=2, policy="asp") as c:
        w = syncopate.Worker(tensors, **c.settings)
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path


def clean_env() -> dict[str, str]:
    """This process's environment without any ``SYNCOPATE_*`` setting."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SYNCOPATE_")}


def find_binary(exe: str | os.PathLike[str] | None = None) -> Path:
    """The ``syncopate`` executable: ``exe``, else ``$SYNCOPATE_BIN``, else ``syncopate`` on the
    ``PATH``; ``FileNotFoundError`` saying how to build it otherwise."""
    name = exe if exe is not None else os.environ.get("SYNCOPATE_BIN")
    path = Path(name) if name is not None else None
    if path is None:
        found = shutil.which("syncopate")
        path = Path(found) if found else None
    if path is None or not path.exists():
        raise FileNotFoundError(
            f"no syncopate executable ({name or 'none on the PATH'}): build it with "
            "`cargo build --release --bin syncopate` and set SYNCOPATE_BIN to it"
        )
    return path


class Cluster:
    """A coordinator and ``servers`` servers, started in ``dir`` (logs, certificate, address);
    workers are the caller's. ``workers`` is the coordinator's start barrier (how many it waits
    for before training starts). With two servers or more every shard has a backup (the
    coordinator's default; ``extra=["--replicas", "0"]`` runs without). Stopped (killed) by
    :meth:`stop` or on leaving a ``with``.

    The coordinator and servers listen on ``host`` (loopback by default); ``netns`` runs them
    inside that network namespace (``ip netns exec``, which needs root), for measurements
    across a link the caller built (``benches/torch_overlap.py --link-mbit``)."""

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        exe: str | os.PathLike[str] | None = None,
        workers: int = 1,
        servers: int = 2,
        policy: str = "bsp",
        lr: float = 1.0,
        momentum: float = 0.0,
        peer_timeout_ms: int = 2000,
        shards: int | None = None,
        extra: list[str] | None = None,
        host: str = "127.0.0.1",
        netns: str | None = None,
    ) -> None:
        self.dir = Path(dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.exe = find_binary(exe)
        self.token = secrets.token_hex(16)
        self.tls = self.dir / "tls"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.netns = netns
        exe_s = str(self.exe)
        subprocess.run(
            [exe_s, "certs", str(self.tls)], check=True, env=clean_env(), capture_output=True
        )
        ready = self.dir / "coordinator.addr"
        ready.unlink(missing_ok=True)
        args = [exe_s, "coordinator", "--listen", f"{host}:0", "--servers", str(servers)]
        args += ["--workers", str(workers), "--ready-file", str(ready), "--tls-dir", str(self.tls)]
        args += ["--policy", policy, "--lr", str(lr), "--momentum", str(momentum)]
        args += ["--peer-timeout-ms", str(peer_timeout_ms)]
        if shards is not None:
            args += ["--shards", str(shards)]
        args += extra or []
        self._spawn("coordinator", args)
        deadline = time.monotonic() + 30
        while not ready.exists() or not ready.read_text().strip():
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                self.stop()
                raise RuntimeError("the coordinator did not start: " + self.log("coordinator"))
            time.sleep(0.02)
        self.addr = ready.read_text().strip()
        self.servers: list[subprocess.Popen[bytes]] = []
        for s in range(servers):
            a = [exe_s, "server", "--coordinator", self.addr, "--tls-dir", str(self.tls)]
            a += ["--listen", f"{host}:0"]
            self.servers.append(self._spawn(f"server-{s}", a))
        self.cluster_file = self.dir / "cluster.json"
        """How operators reach the cluster, as ``syncopate local`` writes it:
        ``syncopate.status(cluster=c.cluster_file)``, ``syncopate policy swap --cluster``."""
        names = ["coordinator"] + [f"server-{s}" for s in range(servers)]
        cluster = {
            "coordinator": self.addr,
            "token": self.token,
            "ca": str(self.tls / "cert.pem"),
            "server_name": "syncopate",
            "pids": [[n, p.pid] for n, p in zip(names, self.procs, strict=True)],
        }
        self.cluster_file.write_text(json.dumps(cluster, indent=2))

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.dir / f"{name}.log", "wb")  # noqa: SIM115 (the process owns it)
        env = clean_env() | {"SYNCOPATE_TOKEN": self.token}
        if self.netns is not None:
            args = ["ip", "netns", "exec", self.netns, *args]
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        """A process's log (``coordinator``, ``server-0``, ...)."""
        path = self.dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    @property
    def settings(self) -> dict[str, str]:
        """What a worker joins with: ``syncopate.Worker(tensors, **cluster.settings)``."""
        return {"coordinator": self.addr, "ca": str(self.tls / "cert.pem"), "token": self.token}

    @property
    def env(self) -> dict[str, str]:
        """The same, as the environment a worker script (or ``syncopate worker``) reads."""
        return clean_env() | {
            "SYNCOPATE_COORDINATOR": self.addr,
            "SYNCOPATE_CA": str(self.tls / "cert.pem"),
            "SYNCOPATE_TOKEN": self.token,
        }

    def stop(self) -> None:
        """Kills every process (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait(timeout=10)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
