#!/usr/bin/env bash
# The main job: installs what is missing (wasm32 target, Fashion-MNIST), builds Syncopate
# (policy modules included, from source) and trains the MLP on Fashion-MNIST on a local cluster
# of separate processes (1 coordinator, 2 servers, 4 workers) over QUIC on loopback, under SSP
# with s=3, until 85% test accuracy or 4 epochs. Each iteration takes 4 ms of emulated device
# time besides the real arithmetic (under a millisecond), and worker 0's device is three times
# slower: the summary shows it computing longer and the others waiting for it as SSP bounds
# their lead. Extra arguments go to `syncopate local` (e.g. `scripts/demo.sh --policy asp`).
# The run's report, plots, model and logs land in runs/<time>-<policy>/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --bins
exec target/release/syncopate local --policy ssp:s=3 --workers 4 --servers 2 --workload fashion-mlp \
    --epochs 4 --target-accuracy 0.85 --delay-ms 4 --slow 0:3 "$@"
