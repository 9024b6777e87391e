#!/usr/bin/env bash
# Syncopate against ps-lite, side by side in one sitting: ROUNDS rounds (default 3), each
# running both systems' transport benchmarks on every link (default: loopback, then veth
# pairs at MTU 1500 and 9000), the order of the two systems alternating from round to round.
# Logs go to target/bench-vs-pslite/DATE/; benches/pslite/summary.py turns them into the
# tables in docs/performance.md (medians, ranges and per-round ratios). Needs root for the
# veth links. Usage:
#
#     scripts/bench-vs-pslite.sh [ROUNDS] [LINK...]     # e.g. 3 lo 1500 9000
#
# Leave the machine alone while it runs (about 5 minutes per round and link): anything else
# running skews both columns.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
shift || true
links=("${@:-lo}")
[ $# -gt 0 ] || links=(lo 1500 9000)
out=target/bench-vs-pslite/$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$out"
cargo build --release --bins
cargo bench --bench transport --no-run
# ps-lite's build, once, before the sitting starts.
PSBENCH_FILTER=none scripts/bench-pslite.sh lo none >/dev/null
# The four request shapes of both benchmarks, not `push-borrowed`.
filter='transport/.*/(push|pull)/'
for round in $(seq 1 "$rounds"); do
  for link in "${links[@]}"; do
    systems=(pslite syncopate)
    [ $((round % 2)) = 1 ] || systems=(syncopate pslite)
    for system in "${systems[@]}"; do
      log=$out/r$round-$link-$system.log
      echo "round $round, link $link: $system -> $log"
      if [ "$system" = pslite ]; then
        scripts/bench-pslite.sh "$link" >"$log" 2>&1
      else
        scripts/bench-link.sh "$link" "$filter" --warm-up-time 1 --noplot >"$log" 2>&1
      fi
    done
  done
done
python3 benches/pslite/summary.py "$out" | tee "$out/summary.md"
