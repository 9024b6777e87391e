"""Syncopate on Ray: a whole cluster started, run and torn down from one call.

::

    import syncopate
    import syncopate.ray

    def train(config):                      # runs in every worker actor, already configured
        weights = np.zeros(20, dtype=np.float32)
        worker = syncopate.Worker([weights])
        while worker.pull([weights]) is not None:
            worker.push([gradient(weights)])
        return worker.leave()

    report = syncopate.ray.launch(train, workers=4, servers=2, policy="ssp:s=3")

:func:`launch` starts the coordinator and the servers as Ray actors, each running the
``syncopate`` binary (spread over the cluster's nodes where it has several), hands every process
the run's certificate and token, runs ``train_fn(config)`` in ``workers`` worker actors with the
worker's settings in its environment (:func:`syncopate.init` has checked them), prints progress,
and returns the run's report once every worker is done. Whatever happens (success, an exception
in ``train_fn``, Ctrl-C), every actor and every process it started is stopped before it returns
or raises. :func:`start` does the same without waiting, for hot swaps and status from the driver
while training runs.

The binary must be at the same path on every node (``exe``, ``$SYNCOPATE_BIN`` or ``syncopate``
on the ``PATH``), as in the container image of ``deploy/``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import status as _status
from . import swap as _swap
from .cluster import clean_env, find_binary

__all__ = ["RayRun", "launch", "start"]

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Run in the child before ``exec``: the kernel kills it when the actor that started it
    dies, however it dies (``ray.kill`` is a SIGKILL, which no handler sees)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _write_files(dir: Path, files: Mapping[str, bytes]) -> None:
    dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        path = dir / name
        path.write_bytes(data)
        path.chmod(0o600)


class _Role:
    """An actor that runs one ``syncopate`` process (the coordinator or a server) on its node.

    ``{dir}`` in the arguments is the actor's directory (certificate, ready file, log) and
    ``{ip}`` the address it listens on: ``host``, else its node's Ray address."""

    def __init__(
        self, name: str, files: dict[str, bytes], exe: str | None, host: str | None
    ) -> None:
        self.name = name
        self.dir = Path(tempfile.mkdtemp(prefix=f"syncopate-{name}-"))
        _write_files(self.dir / "tls", files)
        self.exe = str(find_binary(exe))
        self.ip = host or ray.util.get_node_ip_address()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, args: list[str], env: dict[str, str]) -> str:
        """Starts the process with ``env`` added to a clean environment; returns the node's
        address."""
        subst = [a.replace("{dir}", str(self.dir)).replace("{ip}", self.ip) for a in args]
        # Appended to: a coordinator started again keeps its first process's log before it.
        log = open(self.dir / "log", "ab")  # noqa: SIM115 (the process owns it)
        self.proc = subprocess.Popen(
            [self.exe, *subst],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=clean_env() | env,
            preexec_fn=_die_with_parent,
        )
        return self.ip

    def ready(self, timeout_s: float) -> str:
        """The address the coordinator wrote to its ready file."""
        path = self.dir / "ready"
        deadline = time.monotonic() + timeout_s
        while not path.exists() or not path.read_text().strip():
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited at start:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start in {timeout_s} s:\n{self.log()}")
            time.sleep(0.02)
        return path.read_text().strip()

    def node(self) -> str:
        """The Ray node this actor runs on."""
        return ray.get_runtime_context().get_node_id()

    def exit_code(self) -> int | None:
        """The process's exit status, or None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def pid(self) -> int | None:
        """The process's id (for tests that kill it)."""
        return None if self.proc is None else self.proc.pid

    def log(self) -> str:
        """The process's output so far (the last 20,000 characters)."""
        path = self.dir / "log"
        return path.read_text(errors="replace")[-20_000:] if path.exists() else ""

    def stop(self) -> str:
        """Stops the process (a clean shutdown has usually stopped it already), removes the
        actor's directory and returns the process's log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        log = self.log()
        shutil.rmtree(self.dir, ignore_errors=True)
        return log


class _Worker:
    """An actor that runs the user's training function as one worker of the cluster."""

    def __init__(self, worker: int, files: dict[str, bytes], env: dict[str, str]) -> None:
        self.worker = worker
        self.dir = Path(tempfile.mkdtemp(prefix=f"syncopate-worker-{worker}-"))
        _write_files(self.dir, files)
        # The cluster file names the CA by path: this node's copy of it.
        cluster = json.loads(files["cluster.json"])
        cluster["ca"] = str(self.dir / "ca.pem")
        (self.dir / "cluster.json").write_text(json.dumps(cluster))
        for key in [k for k in os.environ if k.startswith("SYNCOPATE_")]:
            del os.environ[key]
        os.environ.update(env)
        os.environ["SYNCOPATE_CLUSTER"] = str(self.dir / "cluster.json")
        os.environ["SYNCOPATE_REPORT"] = str(self.dir / "report.json")

    def node(self) -> str:
        """The Ray node this actor runs on."""
        return ray.get_runtime_context().get_node_id()

    def run(
        self, train_fn: Callable[[Any], Any], config: Any, rejoin: bool = False
    ) -> dict[str, Any]:
        """Runs ``train_fn(config)``; returns what it returned and the worker's report. With
        ``rejoin`` (a restarted worker), first waits until the coordinator has noticed that the
        worker's dead process is gone, so that it takes the id back; the servers dropped the
        old process, so it joins as a late joiner does, at the slowest worker's iteration."""
        import syncopate

        try:
            deadline = time.monotonic() + 120
            while rejoin:
                status = syncopate.status()
                me = [w for w in status["workers"] if w["worker"] == self.worker]
                if not me or not me[0]["connected"]:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"worker {self.worker}'s old process is still connected")
                time.sleep(0.1)
            syncopate.init()
            result = train_fn(config)
            syncopate.leave()
            path = self.dir / "report.json"
            report = json.loads(path.read_text()) if path.exists() else None
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)
        return {"worker": self.worker, "result": result, "report": report}


_RoleActor = ray.remote(num_cpus=0, max_restarts=0)(_Role)
_WorkerActor = ray.remote(max_restarts=0)(_Worker)


#: How many times a run starts its coordinator again if it dies.
COORDINATOR_RESTARTS = 3
#: How often :meth:`RayRun.wait` checks that the coordinator is alive, in seconds.
CHECK_EVERY_S = 0.5
#: The longest :meth:`RayRun.stop` waits for each of its two steps, in seconds: the cluster's
#: clean shutdown, then the roles' logs. Every actor is killed after them whatever answered, and
#: the processes the actors started die with them, so stopping is bounded on a busy machine.
STOP_STEP_S = 20.0


def restart_args(first: list[str], addr: str) -> list[str]:
    """The arguments a coordinator that died is started again with: the first one's, listening
    at the address it had (``addr``), where the servers and workers look for it, and never
    resuming from a checkpoint, since the servers that ran on hold newer state."""
    out: list[str] = []
    it = iter(first)
    for a in it:
        if a == "--listen":
            next(it, None)
            out += ["--listen", addr]
        elif a == "--resume":
            next(it, None)
        else:
            out.append(a)
    return out


def _say(msg: str) -> None:
    print(f"[syncopate] {msg}", file=sys.stderr, flush=True)


def _progress(status: dict[str, Any], t: float) -> dict[str, Any]:
    """One line of progress, from the coordinator's status."""
    shards = [sh for s in status["servers"] for sh in s["shards"]]
    clocks = [w["clock"] for sh in shards for w in sh["workers"]]
    score = (status.get("score") or {}).get("score") or {}
    return {
        "t_s": round(t, 3),
        "pushes": sum(sh["stats"]["pushes_admitted"] for sh in shards),
        "min_clock": min(clocks, default=None),
        "max_clock": max(clocks, default=None),
        "accuracy": score.get("accuracy"),
        "policy": status["policy"],
        "swaps": status["swaps"],
        "lost_servers": list(status.get("lost_servers", [])),
    }


@dataclass(frozen=True)
class _Options:
    """What :func:`start` was given (its docstring says what each means)."""

    workers: int
    servers: int
    policy: str
    config: Any
    replicas: int | None
    shards: int | None
    iterations: int | None
    lr: float
    momentum: float
    weight_decay: float
    push_weight: str
    resources: Mapping[str, Any] | None
    worker_env: Mapping[int, Mapping[str, str]] | None
    exe: str | None
    run_dir: str | os.PathLike[str] | None
    peer_timeout_ms: int
    progress_every_s: float
    coordinator_args: list[str] | None
    restart_workers: int
    host: str | None


class RayRun:
    """A Syncopate cluster running on Ray, as :func:`start` returns it. :meth:`wait` ends it."""

    def __init__(self, train_fn: Callable[[Any], Any], o: _Options) -> None:
        workers, servers, replicas = o.workers, o.servers, o.replicas
        if workers < 1 or servers < 1:
            raise ValueError("a run needs at least one worker and one server")
        if replicas is None:
            replicas = 1 if servers >= 2 else 0
        if replicas > 0 and servers < 2:
            raise ValueError("replicas need at least two servers")
        self.t0 = time.monotonic()
        resources = dict(o.resources or {"num_cpus": 1})
        need = {
            "CPU": workers * float(resources.get("num_cpus", 1)),
            "GPU": workers * float(resources.get("num_gpus", 0)),
        }
        if not ray.is_initialized():
            # A local instance for this run: enough CPUs declared for every worker at once
            # (they may share the cores), or the last workers would wait for the first to end
            # while those wait for them at the policy's barrier.
            ray.init(num_cpus=max(os.cpu_count() or 1, math.ceil(need["CPU"])))
        have = ray.cluster_resources()
        for key, n in need.items():
            if n > have.get(key, 0):
                raise ValueError(
                    f"the {workers} workers need {n:g} {key} in all and the Ray cluster has "
                    f"{have.get(key, 0):g}: every worker must run at once (they wait for each "
                    "other), so ask for less per worker (resources=...) or add nodes"
                )
        self.workers = workers
        self.dir = Path(o.run_dir or Path("runs") / f"ray-{time.strftime('%Y%m%d-%H%M%S')}")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.progress_every_s = o.progress_every_s
        self.timeline: list[dict[str, Any]] = []
        self.startup_s: float | None = None
        self.roles: list[Any] = []
        self.worker_actors: list[Any] = []
        self.old_actors: list[Any] = []
        self.max_restarts = o.restart_workers
        self.restarts: dict[int, int] = {}
        self.lost_workers: list[int] = []
        self.coordinator_restarts: list[float] = []
        self.logs: dict[str, str] = {}
        self._stopped = False
        self._shut = False
        self.exe = find_binary(o.exe)
        try:
            self._start(train_fn, o, replicas, resources)
        except BaseException:
            self.stop()
            raise

    def _start(
        self, train_fn: Callable[[Any], Any], o: _Options, replicas: int, resources: dict[str, Any]
    ) -> None:
        tls = self.dir / "tls"
        subprocess.run(
            [str(self.exe), "certs", str(tls)], check=True, env=clean_env(), capture_output=True
        )
        self.token = secrets.token_hex(32)
        files = {
            "cert.pem": (tls / "cert.pem").read_bytes(),
            "key.pem": (tls / "key.pem").read_bytes(),
        }
        spread = {"scheduling_strategy": "SPREAD"}
        # The roles take no CPU from Ray's accounting, which SPREAD then ignores: each is pinned
        # to a live node in turn, so servers share a node only when nodes run out. (A soft pin
        # was seen to land on another node while the pinned one was starting a worker.)
        alive = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))

        def on_node(i: int) -> dict[str, Any]:
            node = alive[i % len(alive)]
            return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}

        coordinator = _RoleActor.options(**on_node(0)).remote(
            "coordinator", files, str(self.exe), o.host
        )
        self.roles.append(coordinator)
        args = ["coordinator", "--listen", "{ip}:0", "--ready-file", "{dir}/ready"]
        args += [
            "--tls-dir",
            "{dir}/tls",
            "--servers",
            str(o.servers),
            "--workers",
            str(self.workers),
        ]
        args += ["--policy", o.policy, "--replicas", str(replicas), "--lr", str(o.lr)]
        args += ["--momentum", str(o.momentum), "--weight-decay", str(o.weight_decay)]
        args += ["--push-weight", o.push_weight, "--peer-timeout-ms", str(o.peer_timeout_ms)]
        if o.shards is not None:
            args += ["--shards", str(o.shards)]
        # The token, and the driver's log filter (SYNCOPATE_LOG=info shows the roles' progress).
        role_env = {"SYNCOPATE_TOKEN": self.token}
        if "SYNCOPATE_LOG" in os.environ:
            role_env["SYNCOPATE_LOG"] = os.environ["SYNCOPATE_LOG"]
        args += o.coordinator_args or []
        ray.get(coordinator.start.remote(args, role_env))
        self.addr = ray.get(coordinator.ready.remote(60.0))
        # What starting it again takes: the same node (so the same address), the same files.
        self._coordinator = (on_node(0), files, args, role_env, o.host)
        self.cluster_file = self.dir / "cluster.json"
        cluster = {
            "coordinator": self.addr,
            "token": self.token,
            "ca": str((tls / "cert.pem").resolve()),
            "server_name": "syncopate",
            "pids": [],
        }
        self.cluster_file.write_text(json.dumps(cluster, indent=2))
        self.servers = []
        for s in range(o.servers):
            actor = _RoleActor.options(**on_node(s + 1)).remote(
                f"server-{s}", files, str(self.exe), o.host
            )
            self.roles.append(actor)
            self.servers.append(actor)
            server_args = ["server", "--coordinator", self.addr, "--tls-dir", "{dir}/tls"]
            ray.get(actor.start.remote(server_args + ["--listen", "{ip}:0"], role_env))
        _say(f"coordinator at {self.addr}, {o.servers} servers, policy {o.policy}; in {self.dir}")
        worker_files = {"ca.pem": files["cert.pem"], "cluster.json": json.dumps(cluster).encode()}
        self.pending = {}
        self.envs: list[dict[str, str]] = []
        for w in range(self.workers):
            env = {"SYNCOPATE_ID": str(w), "SYNCOPATE_PART": f"{w}/{self.workers}"}
            if o.iterations is not None:
                env["SYNCOPATE_ITERATIONS"] = str(o.iterations)
            env.update((o.worker_env or {}).get(w, {}))
            self.envs.append(env)
            actor = _WorkerActor.options(**resources, **spread).remote(w, worker_files, env)
            self.worker_actors.append(actor)
        # What a restarted worker needs.
        self._new_worker = lambda w: _WorkerActor.options(**resources, **spread).remote(
            w, worker_files, self.envs[w]
        )
        self._train = (train_fn, o.config)
        # Where each actor runs (asked before training: an actor answers its calls in order).
        names = ["coordinator"] + [f"server-{s}" for s in range(o.servers)]
        names += [f"worker-{w}" for w in range(self.workers)]
        nodes = ray.get([a.node.remote() for a in self.roles + self.worker_actors])
        self.placement = dict(zip(names, nodes, strict=True))
        for w, actor in enumerate(self.worker_actors):
            self.pending[actor.run.remote(train_fn, o.config)] = w

    def running(self) -> bool:
        """Whether some worker is still training."""
        if not self.pending:
            return False
        ready, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=0)
        return len(ready) < len(self.pending)

    def status(self) -> dict[str, Any]:
        """The cluster's status (as ``syncopate policy status --json`` prints it)."""
        return _status(self.cluster_file)

    def swap(self, policy: str) -> tuple[int, int]:
        """Hot-swaps the running cluster's policy; see :func:`syncopate.swap`."""
        return _swap(policy, self.cluster_file)

    def _look(self) -> dict[str, Any] | None:
        try:
            point = _progress(self.status(), time.monotonic() - self.t0)
        except Exception:  # noqa: BLE001 (a look that fails is retried at the next)
            return None
        self.timeline.append(point)
        if self.startup_s is None and point["pushes"] > 0:
            self.startup_s = point["t_s"]
        return point

    def _check_roles(self) -> None:
        """Starts the coordinator again, on its node and at its address, if its process or its
        actor died: the servers and workers rejoin it, and it rebuilds the cluster from what the
        servers hold. Raises after :data:`COORDINATOR_RESTARTS` restarts. (A server that dies
        is failed over instead.)"""
        try:
            code = ray.get(self.roles[0].exit_code.remote(), timeout=30)
            why = None if code is None else f"exited ({code})"
        except ray.exceptions.RayActorError:
            why = "lost its actor"
        if why is None:
            return
        if len(self.coordinator_restarts) >= COORDINATOR_RESTARTS:
            raise RuntimeError(
                f"the coordinator {why}, and it was started again {COORDINATOR_RESTARTS} times "
                f"already:\n{self._log(0)}"
            )
        self.coordinator_restarts.append(time.monotonic() - self.t0)
        _say(f"the coordinator {why}; starting it again at {self.addr}")
        node, files, args, env, host = self._coordinator
        if why == "lost its actor":
            self.old_actors.append(self.roles[0])
            self.roles[0] = _RoleActor.options(**node).remote(
                "coordinator", files, str(self.exe), host
            )
        ray.get(self.roles[0].start.remote(restart_args(args, self.addr), env))

    def _log(self, i: int) -> str:
        try:
            return ray.get(self.roles[i].log.remote(), timeout=10)
        except Exception as e:  # noqa: BLE001
            return f"(log unavailable: {e})"

    def wait(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Waits for every worker, stops the cluster and returns the run report (also written
        to ``report.json`` in the run's directory). Raises what a worker raised, after stopping
        everything; Ctrl-C stops everything too."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        results: dict[int, dict[str, Any]] = {}
        next_say = time.monotonic() + self.progress_every_s
        next_check = time.monotonic() + CHECK_EVERY_S
        try:
            while self.pending:
                if self.startup_s is None:
                    self._look()
                ready, _ = ray.wait(list(self.pending), num_returns=1, timeout=0.05)
                for ref in ready:
                    w = self.pending.pop(ref)
                    try:
                        results[w] = ray.get(ref)
                        _say(f"worker {w} finished")
                    except ray.exceptions.RayActorError as e:
                        # Its process died (train_fn's own exceptions are RayTaskErrors).
                        self._worker_died(w, e)
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + CHECK_EVERY_S
                    self._check_roles()
                if time.monotonic() >= next_say:
                    next_say += self.progress_every_s
                    point = self._look()
                    if point is not None:
                        _say(_line(point))
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run did not finish in {timeout_s} s")
            final = self._look()
            last_status = self.status()
            self._shutdown(save_model=self.dir / "model.bin")
        finally:
            self.stop()
        report = {
            "run_dir": str(self.dir),
            "elapsed_s": time.monotonic() - self.t0,
            "startup_s": self.startup_s,
            "policy": last_status["policy"],
            "swaps": last_status["swaps"],
            "lost_servers": last_status.get("lost_servers", []),
            "final": final,
            "placement": self.placement,
            "restarts": self.restarts,
            "lost_workers": self.lost_workers,
            "coordinator_restarts": self.coordinator_restarts,
            "workers": [results[w]["report"] for w in sorted(results)],
            "results": [results[w]["result"] for w in sorted(results)],
            "status": last_status,
            "timeline": self.timeline,
        }
        (self.dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
        _say(f"done in {report['elapsed_s']:.1f} s; report in {self.dir / 'report.json'}")
        return report

    def _worker_died(self, w: int, e: Exception) -> None:
        """Restarts worker ``w`` if it has restarts left; otherwise the cluster goes on
        without it, as it does without any lost worker (the servers drop it after the peer
        timeout)."""
        done = self.restarts.get(w, 0)
        if done >= self.max_restarts:
            self.lost_workers.append(w)
            _say(f"worker {w}'s actor died ({type(e).__name__}); the cluster goes on without it")
            return
        self.restarts[w] = done + 1
        _say(f"worker {w}'s actor died; restarting it ({done + 1} of {self.max_restarts})")
        self.old_actors.append(self.worker_actors[w])
        actor = self._new_worker(w)
        self.worker_actors[w] = actor
        train_fn, config = self._train
        self.pending[actor.run.remote(train_fn, config, True)] = w

    def kill_worker(self, worker: int) -> None:
        """Kills worker ``worker``'s actor (for failure drills and tests)."""
        ray.kill(self.worker_actors[worker], no_restart=True)

    def kill_coordinator(self) -> None:
        """Kills the coordinator's actor, and so its process (for failure drills and tests):
        :meth:`wait` starts it again."""
        ray.kill(self.roles[0], no_restart=True)

    def kill_server(self, server: int) -> None:
        """Kills server ``server``'s actor, and so its process (for failure drills and tests)."""
        ray.kill(self.servers[server], no_restart=True)

    def _shutdown(self, save_model: Path | None, timeout_s: float = 60.0) -> None:
        """Asks the coordinator to stop the servers and itself, first saving the model."""
        if self._shut or getattr(self, "cluster_file", None) is None:
            return
        self._shut = True
        args = [str(self.exe), "shutdown", "--cluster", str(self.cluster_file)]
        args += ["--save-model", str(save_model)] if save_model is not None else []
        out = subprocess.run(
            args, env=clean_env(), capture_output=True, text=True, timeout=timeout_s
        )
        if out.returncode != 0:
            raise RuntimeError(f"the cluster did not shut down cleanly: {out.stderr.strip()}")

    def stop(self) -> None:
        """Stops every worker, the servers and the coordinator, and their actors (idempotent),
        within about twice :data:`STOP_STEP_S` whatever state the run is in. The coordinator
        is asked to shut the cluster down first, so servers exit cleanly, and each role gives
        its log; then every actor is killed, and with it any process it started."""
        if self._stopped:
            return
        self._stopped = True
        for actor in self.worker_actors + self.old_actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        with contextlib.suppress(Exception):
            self._shutdown(None, timeout_s=STOP_STEP_S)
        names = ["coordinator"] + [f"server-{s}" for s in range(len(self.roles) - 1)]
        refs = [r.stop.remote() for r in self.roles]
        answered, _ = ray.wait(refs, num_returns=len(refs), timeout=STOP_STEP_S)
        for name, ref in zip(names, refs, strict=True):
            if ref not in answered:
                self.logs[name] = f"(no answer within {STOP_STEP_S:g} s)"
                continue
            try:
                self.logs[name] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 (a dead actor has no log to give)
                self.logs[name] = f"(gone: {type(e).__name__})"
        for actor in self.roles:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        logs_dir = self.dir / "logs"
        logs_dir.mkdir(exist_ok=True)
        for name, text in self.logs.items():
            (logs_dir / f"{name}.log").write_text(text)


def _line(p: dict[str, Any]) -> str:
    acc = "" if p["accuracy"] is None else f", accuracy {p['accuracy']:.1%}"
    lost = f", servers lost {p['lost_servers']}" if p["lost_servers"] else ""
    return (
        f"{p['t_s']:.0f} s: iterations {p['min_clock']}-{p['max_clock']}, "
        f"{p['pushes']} pushes, policy {p['policy']}{acc}{lost}"
    )


def start(
    train_fn: Callable[[Any], Any],
    *,
    workers: int,
    servers: int = 1,
    policy: str = "bsp",
    config: Any = None,
    replicas: int | None = None,
    shards: int | None = None,
    iterations: int | None = None,
    lr: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    push_weight: str = "mean",
    resources: Mapping[str, Any] | None = None,
    worker_env: Mapping[int, Mapping[str, str]] | None = None,
    exe: str | None = None,
    run_dir: str | os.PathLike[str] | None = None,
    peer_timeout_ms: int = 5000,
    progress_every_s: float = 5.0,
    coordinator_args: list[str] | None = None,
    restart_workers: int = 0,
    host: str | None = None,
) -> RayRun:
    """Starts a cluster on Ray and the workers' training; returns at once with a
    :class:`RayRun` (:meth:`RayRun.swap`, :meth:`RayRun.status`, :meth:`RayRun.wait`).

    - ``train_fn(config)`` runs in each of ``workers`` actors, with ``resources`` each (Ray's
      actor options: ``{"num_cpus": 1}`` by default, ``{"num_gpus": 1}``, ...) and the worker's
      ``SYNCOPATE_*`` settings in its environment (its id, its part ``I/N``, the budget
      ``iterations``, and ``worker_env[i]``: ``{"SYNCOPATE_SLOW_FACTOR": "3"}``). Inside it,
      ``syncopate.Worker(...)``, ``syncopate.torch.DistributedOptimizer(...)``,
      ``syncopate.swap(...)`` and ``syncopate.status()`` reach the cluster with no arguments.
    - ``servers`` servers, each in an actor of its own, spread over the nodes; ``replicas``
      backups per shard (default 1 with two servers or more, so a server actor that dies is
      failed over; see ``docs/fault-tolerance.md`` for the cost). A coordinator that dies is
      started again on its node, at its address (up to :data:`COORDINATOR_RESTARTS` times),
      and rebuilds the cluster from the servers.
    - ``policy``, ``lr``, ``momentum``, ``weight_decay``, ``push_weight``, ``shards``,
      ``peer_timeout_ms``: as ``syncopate coordinator`` takes them; ``coordinator_args`` adds
      any other flag (``["--checkpoint-dir", "/shared/ckpt"]``).
    - ``restart_workers``: how many times a worker whose actor dies is started again (0: the
      cluster goes on without it, as ``syncopate local`` does). A restarted worker takes its id
      back once the coordinator has noticed the old process gone (the peer timeout) and goes
      on from the iteration after the last one the shards acknowledged; ``train_fn`` runs
      again from its start, so it must rebuild its state from the pulled model.
    - ``host``: the address the coordinator and servers listen on and give workers. By
      default each listens on its node's Ray address (``ray.util.get_node_ip_address()``),
      so a Ray cluster whose nodes were started with ``node_ip_address="127.0.0.1"`` (one
      machine, as the tests run it) keeps the whole run on loopback; ``"127.0.0.1"`` does so
      on any one-machine Ray.
    - ``run_dir`` (default ``runs/ray-<time>``) gets ``cluster.json`` (for ``syncopate policy
      swap|status --cluster``), the processes' logs and ``report.json``.
    """
    settings = {k: v for k, v in locals().items() if k != "train_fn"}
    return RayRun(train_fn, _Options(**settings))


def launch(
    train_fn: Callable[[Any], Any], *, timeout_s: float | None = None, **kw: Any
) -> dict[str, Any]:
    """Runs ``train_fn`` on a Syncopate cluster on Ray to its end and returns the run report:
    ``start(train_fn, **kw).wait(timeout_s)``. See :func:`start` for the arguments. The report
    has every worker's report and ``train_fn``'s return value, the final status, the progress
    timeline, the servers lost, the coordinator's restarts (seconds from the start), and
    ``startup_s``: seconds from this call to the first push the servers admitted."""
    return start(train_fn, **kw).wait(timeout_s)
