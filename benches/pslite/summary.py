"""Summarises a side-by-side sitting of `scripts/bench-vs-pslite.sh` as Markdown tables.

For every link: each request shape's throughput for ps-lite and Syncopate (median of the
rounds, with the range), the ratio of the medians and the lowest ratio in any one round, and
both systems' CPU seconds per GB moved; then one TCP stream on the same path (iperf3).
"""

from __future__ import annotations

import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

UNITS = {"B/s": 1.0, "KiB/s": 1024.0, "MiB/s": 1024.0**2, "GiB/s": 1024.0**3}
SIZES = {"1KiB": 1 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
MODES = ("sync", "8-in-flight")
SHAPES = [(size, op, mode) for size in SIZES for mode in MODES for op in ("push", "pull")]
CELL = r"(\w+)/(push|pull)/(sync|8-in-flight)"

Cell = tuple[str, str, str]


def parse_syncopate(text: str) -> tuple[dict[Cell, float], dict[Cell, float], float | None]:
    """Throughput (bytes/s) and CPU s/GB per cell, and the TCP stream (MB/s), from a log."""
    rates: dict[Cell, float] = {}
    cpu: dict[Cell, float] = {}
    current: Cell | None = None
    for line in text.splitlines():
        m = re.match(rf"^transport/{CELL}(?:\s|$)", line)
        if m:
            current = (m[1], m[2], m[3])
        m = re.search(r"thrpt:\s+\[\S+ \S+ (\S+) (\S+) ", line)
        if m and current and m[2] in UNITS:
            rates[current] = float(m[1]) * UNITS[m[2]]
            current = None
        m = re.match(rf"^transport/{CELL}: ([\d.]+) CPU s per GB", line)
        if m:
            cpu[(m[1], m[2], m[3])] = float(m[4])
    tcp = re.search(r"one TCP stream: ([\d.]+) MB/s", text)
    return rates, cpu, float(tcp[1]) if tcp else None


def parse_pslite(text: str) -> tuple[dict[Cell, float], dict[Cell, float]]:
    """Throughput (bytes/s) and CPU s/GB per cell from a ps-lite log."""
    rates: dict[Cell, float] = {}
    cpu: dict[Cell, float] = {}
    pattern = (
        r"^pslite (\w+) (push|pull) (sync|8-in-flight) ([\d.]+) MB/s \S+ req/s cpu ([\d.]+) s/GB"
    )
    for m in re.finditer(pattern, text, re.M):
        cell = (m[1], m[2], m[3])
        rates[cell] = float(m[4]) * 1e6
        cpu[cell] = float(m[5])
    return rates, cpu


def spread(values: list[float], fmt: str) -> str:
    """'median (low-high)' in the given format, or a dash."""
    if not values:
        return "-"
    if len(values) == 1:
        return fmt.format(values[0])
    low, mid, high = (fmt.format(v) for v in (min(values), statistics.median(values), max(values)))
    return f"{mid} ({low}-{high})"


def main(out: Path) -> None:
    """Prints the tables for the sitting whose logs are in `out`."""
    logs = defaultdict(dict)  # (link) -> {(round, system): text}
    for path in sorted(out.glob("r*-*-*.log")):
        round_, link, system = path.stem.split("-", 2)
        logs[link][(int(round_[1:]), system)] = path.read_text(errors="replace")
    for link, runs in logs.items():
        rounds = sorted({r for r, _ in runs})
        ours = {r: parse_syncopate(runs.get((r, "syncopate"), "")) for r in rounds}
        theirs = {r: parse_pslite(runs.get((r, "pslite"), "")) for r in rounds}
        title = "loopback" if link == "lo" else f"veth, MTU {link}"
        print(f"\n### {title}: {len(rounds)} rounds\n")
        print(
            "| request | ps-lite | Syncopate | ratio of medians (lowest round) "
            "| CPU s/GB ps-lite / Syncopate |"
        )
        print("|---|---|---|---|---|")
        for cell in SHAPES:
            size, op, mode = cell
            small = SIZES[size] < 64 << 10
            scale, fmt = (SIZES[size] * 1e3, "{:.1f}k") if small else (1e6, "{:,.0f}")
            ps = [theirs[r][0][cell] / scale for r in rounds if cell in theirs[r][0]]
            sy = [ours[r][0][cell] / scale for r in rounds if cell in ours[r][0]]
            ratios = [
                ours[r][0][cell] / theirs[r][0][cell]
                for r in rounds
                if cell in ours[r][0] and cell in theirs[r][0]
            ]
            ratio = "-"
            if ps and sy:
                ratio = f"{statistics.median(sy) / statistics.median(ps):.2f}x ({min(ratios):.2f}x)"
            cpu_ps = [theirs[r][1][cell] for r in rounds if cell in theirs[r][1]]
            cpu_sy = [ours[r][1][cell] for r in rounds if cell in ours[r][1]]
            cpu = f"{spread(cpu_ps, '{:.2f}')} / {spread(cpu_sy, '{:.2f}')}"
            unit = " req/s" if small else " MB/s"
            row = [
                f"{size} {op}, {mode}",
                spread(ps, fmt) + unit,
                spread(sy, fmt) + unit,
                ratio,
                cpu,
            ]
            print("| " + " | ".join(row) + " |")
        tcp = [ours[r][2] for r in rounds if ours[r][2]]
        print(f"\nOne TCP stream (iperf3) on the same path: {spread(tcp, '{:,.0f}')} MB/s.")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
