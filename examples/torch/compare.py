"""Syncopate against torch DistributedDataParallel: the same CNN, the same 4 worker processes,
side by side, time to a test accuracy; and again with one worker 3x slower.

Each arm trains ``train.py``'s small ResNet on Fashion-MNIST with 4 worker processes (each on a
quarter of the training set, batch 32, SGD with learning rate 0.05 and momentum 0.9 on the mean
of the workers' gradients):

- ``ddp``: ``train.py --backend ddp``, 4 processes in a gloo process group;
- ``bsp``, ``ssp:s=3``, ... : ``syncopate local --script train.py`` under that policy (one
  server, push weighting ``mean``, so BSP takes the same steps as DDP).

Worker 0 scores the model every ``--eval-every`` iterations on the first ``--eval-images`` test
images (the same cost in every arm), saves it with the time since training started, and stops
the run once that score reaches ``--stop-at`` (DDP: rank 0 decides and every rank stops;
Syncopate: the launcher's ``--target-accuracy``). Afterwards the saved models are scored on all
10,000 test images, and the first that reaches ``--target`` gives the arm's time to target.

In the ``slow`` scenario worker 3 takes 3x as long per step: DDP's rank 3 sleeps twice its
measured step after each step (``train.py --slow``); Syncopate's worker 3 gets the launcher's
``--slow 3:3``, which stretches its compute the same way. Arms run one after the other, in an
order that rotates each round. Results go to ``--out`` (``results.json``, a figure per
scenario) and a table is printed: every round, then each arm's median and range.

    .venv/bin/python examples/torch/compare.py --rounds 3

``--rounds 0`` prints the table and redraws the figures from ``results.json``. The measured
figures and what they mean are in docs/python.md.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))
import train  # noqa: E402

import fashion_mnist  # noqa: E402

WORKERS = 4
SLOW = (3, 3.0)


def free_port() -> int:
    """A TCP port nothing listens on now (for gloo's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def script_args(a: argparse.Namespace, snapshots: Path) -> list[str]:
    """``train.py``'s arguments every arm shares."""
    return [
        "--threads",
        "1",
        "--epochs",
        str(a.epochs),
        "--eval-every",
        str(a.eval_every),
        "--test-limit",
        str(a.eval_images),
        "--snapshots",
        str(snapshots),
    ]


def run_ddp(a: argparse.Namespace, slow: bool, out: Path) -> None:
    """4 processes of ``train.py --backend ddp``; rank 0 stops them all at ``--stop-at``."""
    port = free_port()
    args = [sys.executable, str(HERE / "train.py"), "--backend", "ddp"]
    args += script_args(a, out / "snapshots")
    args += ["--lr", str(a.lr), "--momentum", "0.9", "--batch", "32", "--target", str(a.stop_at)]
    if slow:
        args += ["--slow", f"{SLOW[0]}:{SLOW[1]}"]
    env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["WORLD_SIZE"] = str(WORKERS)
    procs = []
    for r in range(WORKERS):
        log = open(out / f"rank-{r}.log", "w")  # noqa: SIM115 (the process owns it)
        e = env | {"RANK": str(r), "LOCAL_RANK": str(r)}
        procs.append(subprocess.Popen(args, env=e, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"DDP ranks exited with {codes}; logs in {out}")


def run_syncopate(a: argparse.Namespace, policy: str, slow: bool, out: Path) -> None:
    """``syncopate local --script train.py`` under ``policy``; stopped at ``--stop-at``."""
    args = [a.exe, "local", "--workers", str(WORKERS), "--servers", "1", "--policy", policy]
    args += ["--lr", str(a.lr), "--momentum", "0.9", "--batch", "32", "--spin-us", "0"]
    args += ["--target-accuracy", str(a.stop_at), "--eval-every-ms", "250"]
    args += ["--run-dir", str(out / "run")]
    if slow:
        args += ["--slow", f"{SLOW[0]}:{SLOW[1]:g}"]
    args += ["--script", str(HERE / "train.py")] + script_args(a, out / "snapshots")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SYNCOPATE_")}
    env["SYNCOPATE_PYTHON"] = sys.executable
    with open(out / "local.log", "w") as log:
        code = subprocess.run(args, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code:
        raise RuntimeError(f"syncopate local exited with {code}; see {out / 'local.log'}")


def time_to_target(snapshots: Path, target: float, screen: float) -> tuple[float | None, list]:
    """The first saved model (in time order) scoring ``target`` on the whole test set: its
    time. Only models whose score on the subset reached ``screen`` are scored in full (a model
    3 standard deviations below on 2,000 images is not a candidate). Also the subset curve."""
    rows = [json.loads(line) for line in (snapshots / "index.jsonl").read_text().splitlines()]
    curve = [(r["t_s"], r["accuracy"]) for r in rows]
    tx, ty = fashion_mnist.load("test")
    model = train.resnet()
    for r in rows:
        if r["accuracy"] < screen:
            continue
        model.load_state_dict(torch.load(snapshots / r["file"]))
        acc, _ = train.evaluate(model, tx, ty)
        r["full_accuracy"] = acc
        if acc >= target:
            return r["t_s"], curve
    return None, curve


def svg(path: Path, title: str, curves: dict[str, list], target: float) -> None:
    """A line chart of each arm's subset accuracy against time (no plotting library needed)."""
    w, h, m = 640, 400, 50
    tmax = max((t for c in curves.values() for t, _ in c), default=1.0) or 1.0
    lo = 0.6

    def xy(t: float, acc: float) -> str:
        y = h - m - (max(acc, lo) - lo) / (1 - lo) * (h - 2 * m)
        return f"{m + t / tmax * (w - 2 * m):.1f},{y:.1f}"

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif"'
        ' font-size="12"><rect width="100%" height="100%" fill="white"/>',
        f'<text x="{w / 2}" y="20" text-anchor="middle" font-size="14">{title}</text>',
        f'<line x1="{m}" y1="{h - m}" x2="{w - m}" y2="{h - m}" stroke="black"/>',
        f'<line x1="{m}" y1="{m}" x2="{m}" y2="{h - m}" stroke="black"/>',
        f'<text x="{w / 2}" y="{h - 12}" text-anchor="middle">seconds of training</text>',
    ]
    step = next(d for d in (10, 20, 50, 100, 200, 500, 1000) if tmax / d <= 8)
    for k in range(int(tmax // step) + 1):
        x = xy(k * step, lo).split(",")[0]
        parts.append(f'<line x1="{x}" y1="{h - m}" x2="{x}" y2="{h - m + 4}" stroke="black"/>')
        parts.append(f'<text x="{x}" y="{h - m + 16}" text-anchor="middle">{k * step}</text>')
    for acc in (0.6, 0.7, 0.8, 0.9, 1.0):
        y = xy(0, acc).split(",")[1]
        parts.append(f'<text x="{m - 6}" y="{y}" text-anchor="end">{acc:.0%}</text>')
    ty = xy(0, target).split(",")[1]
    parts.append(
        f'<line x1="{m}" y1="{ty}" x2="{w - m}" y2="{ty}" stroke="gray" stroke-dasharray="4"/>'
    )
    for i, (name, c) in enumerate(curves.items()):
        color = colors[i % len(colors)]
        pts = " ".join(xy(t, acc) for t, acc in c)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{pts}"/>')
        parts.append(f'<text x="{w - m - 120}" y="{m + 16 * i}" fill="{color}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenarios", default="normal,slow", help="normal, slow, or both")
    p.add_argument("--arms", default="ddp,bsp", help="ddp and Syncopate policies, comma-separated")
    p.add_argument(
        "--slow-arms",
        default="ddp,bsp,ssp:s=3,asp",
        help="the arms of the slow scenario",
    )
    p.add_argument("--target", type=float, default=0.90, help="test accuracy to reach")
    p.add_argument("--stop-at", type=float, default=0.91, help="subset score that ends a run")
    p.add_argument("--screen", type=float, default=0.88, help="subset score worth a full score")
    p.add_argument("--epochs", type=float, default=5.0, help="budget per worker, if not stopped")
    p.add_argument("--eval-every", type=int, default=50, help="worker 0's iterations per score")
    p.add_argument("--eval-images", type=int, default=2000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--exe", default=str(ROOT / "target" / "release" / "syncopate"))
    p.add_argument("--out", default=str(ROOT / "runs" / "compare"))
    a = p.parse_args()
    out = Path(a.out)
    results_file = out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else []
    for r in range(a.rounds):
        for scenario in a.scenarios.split(","):
            arms = (a.arms if scenario == "normal" else a.slow_arms).split(",")
            k = r % len(arms)
            for arm in arms[k:] + arms[:k]:
                d = out / f"{scenario}-{arm.replace(':', '_').replace('=', '')}-{int(time.time())}"
                d.mkdir(parents=True)
                began = time.monotonic()
                if arm == "ddp":
                    run_ddp(a, scenario == "slow", d)
                else:
                    run_syncopate(a, arm, scenario == "slow", d)
                wall = time.monotonic() - began
                t, curve = time_to_target(d / "snapshots", a.target, a.screen)
                row = {"round": len(results), "scenario": scenario, "arm": arm, "time_s": t}
                row |= {"wall_s": wall, "dir": str(d), "curve": curve}
                results.append(row)
                results_file.write_text(json.dumps(results, indent=1))
                shown = "not reached" if t is None else f"{t:.0f} s"
                print(f"{scenario:6} {arm:10} {a.target:.0%} after {shown} (run {wall:.0f} s)")
    for scenario in a.scenarios.split(","):
        rows = [x for x in results if x["scenario"] == scenario]
        print(f"\n{scenario}: time to {a.target:.0%} test accuracy, seconds")
        curves = {}
        for arm in dict.fromkeys(x["arm"] for x in rows):
            ts = [x["time_s"] for x in rows if x["arm"] == arm]
            got = [t for t in ts if t is not None]
            med = f"{statistics.median(got):.0f}" if got else "-"
            rng = f"{min(got):.0f}-{max(got):.0f}" if got else "-"
            shown = ", ".join("-" if t is None else f"{t:.0f}" for t in ts)
            print(f"  {arm:10} median {med:>5}  range {rng:>9}  runs: {shown}")
            curves[arm] = [x for x in rows if x["arm"] == arm][-1]["curve"]
        what = "all workers equal" if scenario == "normal" else "worker 3 three times slower"
        title = f"{what}: worker 0's score on {a.eval_images} test images (last round)"
        svg(out / f"{scenario}.svg", title, curves, a.target)


if __name__ == "__main__":
    main()
