#!/usr/bin/env bash
# Runs the transport benchmark across a real link instead of loopback: the coordinator and the
# server in one network namespace, the clients (the benchmark process) in another, joined by a
# veth pair with the given MTU (as docs/bandwidth.md builds by hand). Needs root and iproute2;
# iperf3 (Debian's package, installed if missing) measures one TCP stream on the same path, for
# comparison. Usage:
#
#     cargo build --release --bins
#     scripts/bench-link.sh 1500 [criterion filter]    # e.g. 'transport/1MiB'
#     scripts/bench-link.sh 9000
#
# The namespaces are removed on exit, whatever happens.
set -euo pipefail
cd "$(dirname "$0")/.."
mtu=${1:?usage: scripts/bench-link.sh MTU [criterion filter]}
filter=${2:-}
srv=sy-bench-srv wrk=sy-bench-wrk
if [ "$(id -u)" != 0 ]; then
  echo "error: network namespaces need root (run with sudo)" >&2
  exit 1
fi
cleanup() { ip netns del "$srv" 2>/dev/null || true; ip netns del "$wrk" 2>/dev/null || true; }
trap cleanup EXIT
cleanup
ip netns add "$srv"
ip netns add "$wrk"
ip link add sy-bs type veth peer name sy-bw
ip link set sy-bs netns "$srv"
ip link set sy-bw netns "$wrk"
ip -n "$srv" addr add 10.78.0.1/24 dev sy-bs
ip -n "$wrk" addr add 10.78.0.2/24 dev sy-bw
for ns_dev in "$srv sy-bs" "$wrk sy-bw"; do
  set -- $ns_dev
  ip -n "$1" link set "$2" mtu "$mtu"
  ip -n "$1" link set "$2" up
  ip -n "$1" link set lo up
done
echo "link: veth, MTU $mtu, 10.78.0.1 (server) <-> 10.78.0.2 (clients)"

if ! command -v iperf3 >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get -y -q install iperf3 >/dev/null
fi
ip netns exec "$srv" iperf3 -s -1 -D -B 10.78.0.1
sleep 0.5
echo "one TCP stream (iperf3, 5 s):"
ip netns exec "$wrk" iperf3 -c 10.78.0.1 -t 5 -f m | grep -E "sender|receiver"

bench=$(ls -t target/release/deps/transport-* 2>/dev/null | grep -v '\.d$' | head -1 || true)
if [ -z "$bench" ]; then
  cargo bench --bench transport --no-run
  bench=$(ls -t target/release/deps/transport-* | grep -v '\.d$' | head -1)
fi
ip netns exec "$wrk" env SYNCOPATE_BENCH_NETNS="$srv" SYNCOPATE_BENCH_HOST=10.78.0.1 \
  "$bench" --bench ${filter:+"$filter"}
