#!/usr/bin/env bash
# What spinning (`--spin-us`, default 100) costs, against not spinning (`--spin-us 0`), in
# ROUNDS alternating rounds (default 3):
#
# - an idle node: the CPU time a registered server with no workers uses over 10 s;
# - training: `syncopate local` with BSP, 4 workers and 2 servers (no backups, as measured),
#   2,000 iterations of the MLP:
#   the wall time, and the CPU time of all its processes (user + system).
#
# Prints one line per measurement; docs/performance.md has the figures. Usage:
#
#     scripts/spin-cost.sh [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
bin=target/release/syncopate
scripts/setup.sh >/dev/null
cargo build --release --bins 2>/dev/null
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT
"$bin" certs "$out/tls" >/dev/null
export SYNCOPATE_TOKEN=spin-cost-$$
ticks=$(getconf CLK_TCK)

# CPU seconds (user + system) process $1 has used.
cpu() { awk -v t="$ticks" '{ print ($14 + $15) / t }' "/proc/$1/stat"; }

idle() {
  rm -f "$out/addr"
  "$bin" coordinator --listen 127.0.0.1:0 --servers 1 --workers 1 --startup-timeout-s 600 \
    --ready-file "$out/addr" --tls-dir "$out/tls" 2>/dev/null &
  local coord=$!
  until [ -s "$out/addr" ]; do sleep 0.05; done
  "$bin" server --coordinator "$(cat "$out/addr")" --listen 127.0.0.1:0 --spin-us "$1" \
    --tls-dir "$out/tls" 2>/dev/null &
  local server=$!
  sleep 3 # registered, and its spin budget has settled
  local c0 c1
  c0=$(cpu "$server")
  sleep 10
  c1=$(cpu "$server")
  kill "$server" "$coord"
  wait "$server" "$coord" 2>/dev/null || true
  echo "idle server, spin-us $1: $(awk -v a="$c0" -v b="$c1" 'BEGIN { printf "%.3f", b - a }') CPU s in 10 s"
}

train() {
  local TIMEFORMAT='%R %U %S' t
  t=$({ time "$bin" local --policy bsp --workers 4 --servers 2 --replicas 0 --iterations 2000 --spin-us "$1" \
    --run-dir "$out/run-$1-$2" >/dev/null 2>&1; } 2>&1)
  read -r wall user sys <<<"$t"
  echo "training, spin-us $1: $wall s wall, $(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.2f", u + s }') CPU s"
}

for round in $(seq 1 "$rounds"); do
  for spin in 100 0; do
    idle "$spin"
  done
  for spin in 0 100; do
    train "$spin" "$round"
  done
done
