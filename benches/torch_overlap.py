"""The overlapped ``step()`` against the serial one, and against DDP, on a model where
communication matters: time per iteration, side by side, rounds in rotating order.

Every arm trains ``examples/torch/train.py``'s wide MLP (``--width``, ``--depth``; the defaults
are its 5.8M parameters, 23 MB each way per iteration) on Fashion-MNIST with ``--workers``
worker processes of one torch thread each, batch ``--batch``, plain SGD:

- **compute**: the workers compute alone (forward, backward, a local SGD step; no
  communication at all): the floor, and what the others' extra time is measured against;
- **serial**: ``DistributedOptimizer`` (server mode) on a Syncopate cluster under BSP
  (``--servers`` servers, ``--shards`` shards, no backups): ``step()`` pushes every gradient,
  waits, and pulls;
- **overlap**: the same with ``overlap=True`` (``--bucket-mb`` buckets): pushes start from the
  gradient hooks during backward;
- **forward**: the same with ``model=`` too: ``step()`` returns with the pull under way, and
  each layer of the next forward pass waits only for its own parameters (ByteScheduler's
  order: the first layers' parts and pulls go first);
- **ddp**: ``torch.nn.parallel.DistributedDataParallel`` over gloo on loopback (its own
  bucketed all-reduce, overlapped with backward), the same processes.

Each worker times ``--iterations`` iterations after ``--warmup`` (from one loop start to the
next: forward, backward, step); an arm's figure is the mean over its workers of their median
iteration. Per round the **exposed communication** of an arm is its time minus compute's, and
the **share hidden** by an overlapping arm is ``(serial - arm) / (serial - compute)``. Prints every
round, then each figure's median and range, and writes them to ``--out`` (JSON).

Needs release builds (the extension's copies are 10x slower in debug)::

    cargo build --release --bin syncopate
    (cd python && VIRTUAL_ENV=$PWD/../.venv ../.venv/bin/maturin develop --release -q)
    .venv/bin/python benches/torch_overlap.py --rounds 5

Everything talks over 127.0.0.1 only (gloo is pinned to the loopback interface), unless
``--link-mbit R`` is given: then the bench builds two network namespaces joined by a veth pair
(MTU 9000) whose every direction a token bucket limits to R Mbit/s, runs the cluster in one and
the workers in the other (DDP: rank 0 in one, the others in the other, so that its all-reduce
crosses the link), and removes them when it ends. That needs root; it is the regime where the
network, not the CPU, bounds communication.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "torch"
ARMS = ["compute", "serial", "overlap", "forward", "ddp"]
# The arms that train through a Syncopate cluster.
CLUSTER_ARMS = ("serial", "overlap", "forward")
# The --link-mbit namespaces: the cluster's side (and DDP's rank 0) and the workers'.
SRV_NS, WRK_NS = "sy-ovl-srv", "sy-ovl-wrk"
SRV_DEV, WRK_DEV = "sy-os", "sy-ow"
SRV_IP, WRK_IP = "10.79.0.1", "10.79.0.2"


def link_down() -> None:
    """Removes the namespaces (and with them the veth pair), if they exist."""
    for ns in (SRV_NS, WRK_NS):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def link_up(mbit: int) -> None:
    """Two namespaces joined by a veth pair, each direction limited to ``mbit`` Mbit/s."""
    link_down()
    sh = lambda *a: subprocess.run(list(a), check=True)  # noqa: E731
    sh("ip", "netns", "add", SRV_NS)
    sh("ip", "netns", "add", WRK_NS)
    sh("ip", "link", "add", SRV_DEV, "type", "veth", "peer", "name", WRK_DEV)
    burst = max(64 * 1024, mbit * 1_000_000 // 8 // 100)  # 10 ms of traffic
    for ns, dev, ip in ((SRV_NS, SRV_DEV, SRV_IP), (WRK_NS, WRK_DEV, WRK_IP)):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
        sh("ip", "-n", ns, "link", "set", dev, "mtu", "9000")
        sh("ip", "-n", ns, "link", "set", dev, "up")
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
           "rate", f"{mbit}mbit", "burst", str(burst), "latency", "50ms")  # fmt: skip


def worker(a: argparse.Namespace) -> None:
    """One worker process of arm ``a.worker``: trains, prints its iteration times as JSON."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(EXAMPLES))
    import train

    import fashion_mnist

    torch.set_num_threads(1)
    torch.manual_seed(1)
    rank = int(os.environ.get("RANK", os.environ.get("SYNCOPATE_ID", "0")))
    model = train.wide(a.width, a.depth)
    x, y = fashion_mnist.load("train")
    x, y = x[rank :: a.workers], y[rank :: a.workers]
    total = a.warmup + a.iterations
    arm = a.worker
    opt: Any
    if arm == "ddp":
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        dist.init_process_group("gloo")
        net: torch.nn.Module = DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    elif arm == "compute":
        net = model
        opt = torch.optim.SGD(model.parameters(), lr=a.lr)
    else:
        import syncopate.torch as sps

        net = model
        opt = sps.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0),
            model.named_parameters(),
            overlap=arm in ("overlap", "forward"),
            bucket_mb=a.bucket_mb,
            model=model if arm == "forward" else None,
            iterations=total,
        )
        sps.broadcast_parameters(opt)
    times: list[float] = []
    at = 0
    last = time.perf_counter()
    window = (0.0, 0.0)
    cpu = 0.0
    for i in range(total):
        if i == a.warmup:
            window, cpu = (time.monotonic(), 0.0), time.process_time()
        idx = slice(at, at + a.batch)
        at = (at + a.batch) % (len(x) - a.batch)
        loss = F.cross_entropy(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        if arm in CLUSTER_ARMS:
            opt.step(loss=float(loss))
        else:
            opt.step()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    window = (window[0], time.monotonic())
    cpu = time.process_time() - cpu
    if arm == "ddp":
        dist.destroy_process_group()
    breakdown: dict[str, float] = {}
    if arm in CLUSTER_ARMS:
        assert opt.done, "the cluster should have ended training after the budget"
        r = opt.leave() or {}
        # The worker's own timeline, per timed iteration (medians, ms): waiting for the pull,
        # computing before the push started, computing while it was in flight, and waiting
        # for its acknowledgements.
        line = r.get("timeline", [])[a.warmup :]
        acks = r.get("timeline_acks", [])[a.warmup :]
        over = (r.get("timeline_overlap", []) + [0.0] * len(r.get("timeline", [])))[a.warmup :]
        if line:
            rows = [
                (w, b - k, min(o, k), k - min(o, k))
                for (_, w, b), k, o in zip(line, acks, over, strict=False)
            ]
            for j, name in enumerate(("pull_wait", "compute", "push_while_computing", "ack_wait")):
                breakdown[name] = 1000 * statistics.median(row[j] for row in rows)
    out = {
        "rank": rank,
        "times": times[a.warmup :],
        "window": window,
        "cpu_s": cpu,
        "breakdown": breakdown,
    }
    print(json.dumps(out), flush=True)


def cpu_seconds(pid: int) -> float:
    """CPU time (user and system, all threads) process ``pid`` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Samples the CPU time of the cluster's processes every 20 ms (in a thread), to read what
    they used over the workers' timed window."""

    def __init__(self, pids: list[int]) -> None:
        import threading

        self.pids = pids
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                total = sum(cpu_seconds(p) for p in self.pids)
            except (OSError, IndexError):
                return
            self.samples.append((time.monotonic(), total))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def between(self, start: float, end: float) -> float:
        """CPU seconds used from ``start`` to ``end`` (the nearest samples)."""
        if not self.samples:
            return 0.0
        at = lambda t: min(self.samples, key=lambda s: abs(s[0] - t))[1]  # noqa: E731
        return at(end) - at(start)


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (gloo's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_arm(a: argparse.Namespace, arm: str, tmp: Path) -> tuple[float, float]:
    """Runs one arm; returns the mean over its workers of their median iteration (s), and the
    CPU seconds every process of the arm (workers, and the cluster's) used per iteration."""
    from syncopate.cluster import Cluster

    args = [sys.executable, __file__, "--worker", arm]
    for k in ("width", "depth", "batch", "iterations", "warmup", "workers", "bucket_mb", "lr"):
        args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    base = {k: v for k, v in os.environ.items() if not k.startswith("SYNCOPATE_")}
    cluster = None
    envs: list[dict[str, str]]
    link = a.link_mbit > 0
    # Where each worker runs: the workers' namespace, or (DDP's rank 0) the cluster's.
    nets = [WRK_NS if link else None] * a.workers
    if arm in CLUSTER_ARMS:
        cluster = Cluster(
            tmp / f"cluster-{arm}",
            exe=a.exe,
            workers=a.workers,
            servers=a.servers,
            shards=a.shards,
            policy="bsp",
            lr=a.lr,
            extra=["--replicas", "0"],
            host=SRV_IP if link else "127.0.0.1",
            netns=SRV_NS if link else None,
        )
        envs = [cluster.env | {"SYNCOPATE_ID": str(i)} for i in range(a.workers)]
    elif arm == "ddp":
        port = str(free_port())
        if link:
            nets[0] = SRV_NS
        envs = [
            base
            | {
                "RANK": str(i),
                "WORLD_SIZE": str(a.workers),
                "MASTER_ADDR": SRV_IP if link else "127.0.0.1",
                "MASTER_PORT": port,
                "GLOO_SOCKET_IFNAME": (SRV_DEV if i == 0 else WRK_DEV) if link else "lo",
            }
            for i in range(a.workers)
        ]
    else:
        envs = [base | {"RANK": str(i)} for i in range(a.workers)]
    sampler = Sampler([p.pid for p in cluster.procs]) if cluster is not None else None
    try:
        procs = [
            subprocess.Popen(
                (["ip", "netns", "exec", ns] if ns else []) + args,
                env=e,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for e, ns in zip(envs, nets, strict=True)
        ]
        medians, cpu, windows, parts = [], 0.0, [], []
        for p in procs:
            out, err = p.communicate(timeout=a.timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{arm} worker failed ({p.returncode}):\n{err[-3000:]}")
            r = json.loads(out.strip().splitlines()[-1])
            medians.append(statistics.median(r["times"]))
            cpu += r["cpu_s"] / a.iterations
            windows.append(r["window"])
            parts.append(r["breakdown"])
        if sampler is not None:
            sampler.stop()
            start, end = max(w[0] for w in windows), min(w[1] for w in windows)
            cpu += sampler.between(start, end) / max(end - start, 1e-9) * statistics.fmean(medians)
        if parts and parts[0]:
            mean = {k: statistics.fmean(p[k] for p in parts) for k in parts[0]}
            print(f"  {arm}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in mean.items()), flush=True)
        return statistics.fmean(medians), cpu
    finally:
        if sampler is not None:
            sampler.stop()
        if cluster is not None:
            cluster.stop()


def summary(rows: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median and range of every figure over the rounds."""
    out = {}
    for k in rows[0]:
        vals = [r[k] for r in rows]
        out[k] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--iterations", type=int, default=30, help="timed iterations per worker")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bucket-mb", type=float, default=4.0)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--exe", default=str(ROOT / "target" / "release" / "syncopate"))
    p.add_argument("--out", default="", help="write the rounds and the summary here (JSON)")
    p.add_argument("--timeout", type=float, default=600, help="seconds an arm may take")
    p.add_argument(
        "--link-mbit",
        type=int,
        default=0,
        help="run across a veth link limited to this many Mbit/s each way (root; 0: loopback)",
    )
    p.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return

    import syncopate._native as native

    if native.DEBUG_BUILD:
        sys.exit("the syncopate extension is a debug build: rebuild it with --release (see above)")
    params = sum(
        n_in * n_out + n_out
        for n_in, n_out in zip([784] + [a.width] * a.depth, [a.width] * a.depth + [10], strict=True)
    )
    where = f"a veth link of {a.link_mbit} Mbit/s each way" if a.link_mbit else "loopback"
    print(
        f"wide MLP {a.depth}x{a.width}: {params:,} parameters "
        f"({4 * params / 1e6:.1f} MB each way); "
        f"{a.workers} workers, batch {a.batch}, {a.servers} server(s), {a.shards} shards, BSP, "
        f"buckets {a.bucket_mb} MB; {a.iterations} timed iterations after {a.warmup}; {where}",
        flush=True,
    )
    rows: list[dict[str, float]] = []
    if a.link_mbit:
        link_up(a.link_mbit)
    with contextlib.ExitStack() as stack:
        if a.link_mbit:
            stack.callback(link_down)
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        for r in range(a.rounds):
            order = ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]
            ran = {arm: run_arm(a, arm, Path(tmp) / f"round-{r}") for arm in order}
            got = {arm: t for arm, (t, _) in ran.items()}
            exposed = got["serial"] - got["compute"]
            row = {f"{arm}_ms": 1000 * got[arm] for arm in ARMS}
            row["serial_exposed_ms"] = 1000 * exposed
            for arm in ("overlap", "forward"):
                row[f"{arm}_exposed_ms"] = 1000 * (got[arm] - got["compute"])
                hidden = (got["serial"] - got[arm]) / exposed if exposed > 0 else 0.0
                row[f"{arm}_hidden_share"] = hidden
            for arm in CLUSTER_ARMS:
                row[f"{arm}_over_ddp"] = got[arm] / got["ddp"]
            # CPU-seconds per iteration over the cores: no schedule can beat it.
            cores = os.cpu_count() or 1
            row |= {f"{arm}_cpu_floor_ms": 1000 * ran[arm][1] / cores for arm in ARMS}
            rows.append(row)
            print(
                f"round {r + 1} ({', '.join(order)}): "
                + ", ".join(
                    f"{k} {v:.3f}" if "ms" not in k else f"{k} {v:.1f}" for k, v in row.items()
                ),
                flush=True,
            )
    s = summary(rows)
    for k, v in s.items():
        fmt = "{:.1f}" if k.endswith("_ms") else "{:.3f}"
        print(
            f"{k:18} median {fmt.format(v['median'])}  range "
            f"{fmt.format(v['min'])}-{fmt.format(v['max'])}"
        )
    if a.out:
        Path(a.out).write_text(
            json.dumps({"args": vars(a), "rounds": rows, "summary": s}, indent=1)
        )


if __name__ == "__main__":
    main()
