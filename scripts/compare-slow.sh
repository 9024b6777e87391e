#!/usr/bin/env bash
# BSP against SSP (s = 3) with one worker three times slower: the same Fashion-MNIST MLP run,
# a fixed number of iterations per worker, one run of each, side by side. Prints each run's
# summary; the reports and plots are in runs/compare-*/. Extra arguments go to both runs.
# Without backups (`--replicas 0`), as the figures in docs/performance.md were taken.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --bins
for policy in bsp ssp:s=3; do
  dir="runs/compare-${policy%%:*}"
  rm -rf "$dir"
  echo "== $policy"
  target/release/syncopate local --policy "$policy" --workers 4 --servers 2 --replicas 0 --workload fashion-mlp \
      --iterations 300 --slow 0:3 --eval-every-ms 5000 --run-dir "$dir" "$@" 2>/dev/null \
    | grep -E '^(elapsed|worker|accuracy)'
done
