#!/usr/bin/env bash
# Every built-in policy (or the ones named as arguments) on the same Fashion-MNIST MLP run, one
# run of each, one after the other on this machine. Default scenario: 4 workers, 2 servers,
# worker 0 three times slower, 300 iterations per worker. Prints each run's summary, then a table
# from the reports (runs/policies-*/report.json). Change the scenario with environment variables:
#   WORKERS=4  ITERATIONS=300  SCENARIO="--slow 0:3"  EVAL_MS=5000
#   EXTRA="--delay-ms 20 --time-limit-s 15" (more `syncopate local` flags)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --bins
policies=("$@")
if [ ${#policies[@]} -eq 0 ]; then
  policies=(bsp ssp:s=3 dssp:s_lo=3,s_hi=15 fluentps:s=3 r2sp epsp asp)
fi
for policy in "${policies[@]}"; do
  dir="runs/policies-${policy//[:,=]/-}"
  rm -rf "$dir"
  echo "== $policy"
  # shellcheck disable=SC2086
  target/release/syncopate local --policy "$policy" --workers "${WORKERS:-4}" --servers 2 \
      --workload fashion-mlp --iterations "${ITERATIONS:-300}" ${SCENARIO---slow 0:3} \
      --eval-every-ms "${EVAL_MS:-5000}" --run-dir "$dir" ${EXTRA:-} 2>/dev/null \
    | grep -E '^(elapsed|accuracy)'
done
echo
if command -v python3 >/dev/null; then
  python3 - "${policies[@]}" <<'PY'
import json, sys
print(f"{'policy':28} {'time s':>7} {'ms/iter':>8} {'wait s':>7} {'deferred':>8} {'final acc':>9} {'best acc':>8} {'moved':>6}")
for p in sys.argv[1:]:
    name = p.replace(':', '-').replace(',', '-').replace('=', '-')
    r = json.load(open(f"runs/policies-{name}/report.json"))
    ws = r["workers"]
    it = sum(w["iterations"] for w in ws) / len(ws)
    wait = sum(w["wait_ns"] for w in ws) / len(ws) / 1e9
    deferred = sum(w["deferred_pulls"] for w in ws)
    moved = sum(w.get("tasks_given", 0) for w in ws)
    acc, best = r.get("final_accuracy") or 0, r.get("best_accuracy") or 0
    print(f"{p:28} {r['elapsed_s']:7.2f} {1e3 * r['elapsed_s'] / it:8.2f} {wait:7.2f} {deferred:8d} {acc:9.3f} {best:8.3f} {moved:6d}")
PY
fi
