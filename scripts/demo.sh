#!/usr/bin/env bash
# The main job: builds Syncopate (policy modules included, from source) and trains on a local
# cluster of separate processes (1 coordinator, 2 servers, 4 workers, one of them slow) over
# QUIC on loopback, under SSP with s=3. Extra arguments go to `syncopate local`
# (e.g. `scripts/demo.sh --policy bsp`). The run's files land in runs/<time>-<policy>/.
#
# Until the Fashion-MNIST workloads land (issue 4) the workload is `counter`, whose pushes are
# known values: the printed model equals minus the sum of every update, so you can see that
# nothing was lost.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --bins
exec target/release/syncopate local --policy ssp:s=3 --workers 4 --servers 2 \
    --workload counter --params 100000 --iterations 200 --delay-ms 5 --slow-ms 3:15 \
    --lr 1 --momentum 0 --push-weight sum "$@"
