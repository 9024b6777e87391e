# Shared by the benchmark scripts: the link a benchmark runs across. Source it, then
# `link_up LINK`, where LINK is `lo` (loopback, nothing to build) or an MTU (1500, 9000): two
# network namespaces joined by a veth pair with that MTU, as docs/bandwidth.md builds by hand.
# The server side is $SRV_HOST, run there with `in_srv CMD...`; the client side $WRK_HOST,
# `in_wrk CMD...`. `link_down` removes the namespaces (scripts call it on exit);
# `tcp_stream` prints one TCP stream's throughput on the same path, in MB/s (iperf3, 5 s).
# Namespaces need root and iproute2; iperf3 is installed from Debian's packages if missing.

SRV_NS=sy-bench-srv
WRK_NS=sy-bench-wrk

link_down() {
  ip netns del "$SRV_NS" 2>/dev/null || true
  ip netns del "$WRK_NS" 2>/dev/null || true
}

link_up() {
  LINK=$1
  if [ "$LINK" = lo ]; then
    SRV_HOST=127.0.0.1 WRK_HOST=127.0.0.1
    return
  fi
  case "$LINK" in
    '' | *[!0-9]*) echo "error: a link is 'lo' or an MTU such as 1500, not '$LINK'" >&2; return 1 ;;
  esac
  if [ "$(id -u)" != 0 ]; then
    echo "error: a veth link needs network namespaces, which need root (run with sudo)" >&2
    return 1
  fi
  link_down
  ip netns add "$SRV_NS"
  ip netns add "$WRK_NS"
  ip link add sy-bs type veth peer name sy-bw
  ip link set sy-bs netns "$SRV_NS"
  ip link set sy-bw netns "$WRK_NS"
  ip -n "$SRV_NS" addr add 10.78.0.1/24 dev sy-bs
  ip -n "$WRK_NS" addr add 10.78.0.2/24 dev sy-bw
  local ns dev
  for ns_dev in "$SRV_NS sy-bs" "$WRK_NS sy-bw"; do
    read -r ns dev <<<"$ns_dev"
    ip -n "$ns" link set "$dev" mtu "$LINK"
    ip -n "$ns" link set "$dev" up
    ip -n "$ns" link set lo up
  done
  SRV_HOST=10.78.0.1 WRK_HOST=10.78.0.2
}

in_srv() {
  if [ "$LINK" = lo ]; then "$@"; else ip netns exec "$SRV_NS" "$@"; fi
}

in_wrk() {
  if [ "$LINK" = lo ]; then "$@"; else ip netns exec "$WRK_NS" "$@"; fi
}

tcp_stream() {
  if ! command -v iperf3 >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get -y -q install iperf3 >/dev/null
  fi
  local port=5299
  in_srv iperf3 -s -1 -D -B "$SRV_HOST" -p "$port"
  sleep 0.5
  # The receiver's figure, in MB/s (10^6 bytes).
  in_wrk iperf3 -c "$SRV_HOST" -p "$port" -t 5 -f m | awk '/receiver/ { print $7 * 1e6 / 8 / 1e6 }'
}
