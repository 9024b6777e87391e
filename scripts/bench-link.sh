#!/usr/bin/env bash
# Runs the transport benchmark (benches/transport.rs) across a link: loopback, or a veth pair
# between two network namespaces with the given MTU (scripts/lib/link.sh), the coordinator and
# server on one side and the benchmark's clients on the other. One TCP stream on the same path
# is measured first (iperf3). Usage:
#
#     cargo build --release --bins
#     scripts/bench-link.sh 1500 [criterion filter]    # e.g. 'transport/1MiB'
#     scripts/bench-link.sh 9000
#     scripts/bench-link.sh lo
#
# A veth link needs root. The namespaces are removed on exit, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/link.sh
link=${1:?usage: scripts/bench-link.sh lo|MTU [criterion filter]}
shift
trap link_down EXIT
link_up "$link"
echo "link: $link, server $SRV_HOST, clients $WRK_HOST"
echo "one TCP stream: $(tcp_stream) MB/s"

# Builds what changed (nothing, in a sitting) and names the benchmark's executable.
bench=$(cargo bench --bench transport --no-run 2>&1 | sed -n 's/.*Executable .* (\(.*\))$/\1/p')
ns=""
[ "$link" = lo ] || ns=$SRV_NS
in_wrk env SYNCOPATE_BENCH_NETNS="$ns" SYNCOPATE_BENCH_HOST="$SRV_HOST" "$bench" --bench "$@"
