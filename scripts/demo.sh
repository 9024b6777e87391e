#!/usr/bin/env bash
# The main job: installs what is missing (wasm32 target, Fashion-MNIST, Debian's fortunes),
# builds Syncopate (policy modules included, from source) and trains on a local cluster of
# separate processes (1 coordinator, 2 servers, 4 workers) over QUIC on loopback, under SSP with
# s=3. Worker 0's device is three times slower: the summary shows it computing longer and the
# others waiting for it as SSP bounds their lead. The run's report, plots, model and logs land
# in runs/<time>-<policy>/.
#
# --workload picks what is trained (default fashion-mlp):
#   fashion-mlp  the MLP on Fashion-MNIST until 85% test accuracy or 4 epochs; each iteration
#                takes 4 ms of emulated device time besides the real arithmetic (under 1 ms);
#   fashion-cnn  the LeNet-style CNN on Fashion-MNIST, learning rate 0.01, until 86% test
#                accuracy or 3 epochs;
#   fortunes-lm  the byte-level transformer on Debian's fortunes until a held-out loss of
#                3.4 nats per byte (perplexity 30) or 300 iterations; the live line shows the
#                validation loss falling.
# Other arguments go to `syncopate local` (e.g. `scripts/demo.sh --policy asp`).
set -euo pipefail
cd "$(dirname "$0")/.."
workload=fashion-mlp
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --workload) workload="${2:?--workload needs a name}"; shift 2 ;;
    --workload=*) workload="${1#--workload=}"; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
case "$workload" in
  fashion-mlp) defaults=(--epochs 4 --target-accuracy 0.85 --delay-ms 4) ;;
  fashion-cnn) defaults=(--lr 0.01 --epochs 3 --target-accuracy 0.86) ;;
  fortunes-lm) defaults=(--iterations 300 --batch 16 --target-loss 3.4) ;;
  *) defaults=() ;;
esac
defaults=(--policy ssp:s=3 --workers 4 --servers 2 --slow 0:3 --dashboard 127.0.0.1:0 "${defaults[@]}")
# A flag given on the command line replaces the default one (clap refuses a flag given twice),
# and the flags that exclude each other go together: a budget, or a target.
given=" "
for arg in "${args[@]}"; do
  case "$arg" in
    --epochs|--iterations) given+="--epochs --iterations " ;;
    --target-accuracy|--target-loss|--target-perplexity) given+="--target-accuracy --target-loss --target-perplexity " ;;
    --*) given+="${arg%%=*} " ;;
  esac
done
kept=()
i=0
while [ $i -lt ${#defaults[@]} ]; do
  flag="${defaults[$i]}"
  if [[ "$given" != *" $flag "* ]]; then kept+=("$flag" "${defaults[$((i + 1))]}"); fi
  i=$((i + 2))
done
scripts/setup.sh
cargo build --release --bins
exec target/release/syncopate local --workload "$workload" "${kept[@]}" "${args[@]}"
