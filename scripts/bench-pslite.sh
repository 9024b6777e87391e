#!/usr/bin/env bash
# Runs ps-lite's side of the transport comparison (benches/pslite/bench.cc) across a link:
# loopback, or a veth pair with the given MTU (scripts/lib/link.sh). ps-lite's scheduler and
# server run on the server side, its worker on the client side; every node is bound to the
# link's address (DMLC_NODE_HOST), so nothing leaves it. Usage:
#
#     scripts/bench-pslite.sh lo [cell filter]     # e.g. '1MiB push'
#     scripts/bench-pslite.sh 1500
#
# The first run builds ps-lite from its public repository (PSLITE_REPO, default GitHub's
# dmlc/ps-lite at PSLITE_COMMIT) under target/pslite, with ZeroMQ and protobuf from Debian's
# packages (installed if missing). Nothing of ps-lite is in this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/link.sh
link=${1:?usage: scripts/bench-pslite.sh lo|MTU [cell filter]}
filter=${2:-}
repo=${PSLITE_REPO:-https://github.com/dmlc/ps-lite}
commit=${PSLITE_COMMIT:-15b8adf}
dir=target/pslite
bin=$dir/bench

if [ ! -x "$bin" ] || [ benches/pslite/bench.cc -nt "$bin" ]; then
  if ! [ -e /usr/include/zmq.h ] || ! command -v protoc >/dev/null; then
    DEBIAN_FRONTEND=noninteractive apt-get -y -q install libzmq3-dev libprotobuf-dev protobuf-compiler >/dev/null
  fi
  if [ ! -d "$dir/src/.git" ]; then
    rm -rf "$dir/src"
    git clone -q "$repo" "$dir/src"
  fi
  git -C "$dir/src" checkout -q "$commit"
  make -s -C "$dir/src" -j2 ps DEPS_PATH=/usr PROTOC=/usr/bin/protoc ZMQ= PROTOBUF= >"$dir/build.log" 2>&1 \
    || { cat "$dir/build.log" >&2; exit 1; }
  g++ -std=c++17 -O3 -I"$dir/src/include" -I"$dir/src/src" benches/pslite/bench.cc \
    "$dir/src/build/libps.a" -lzmq -lprotobuf -pthread -o "$bin"
fi

trap 'link_down; kill $(jobs -p) 2>/dev/null || true' EXIT
link_up "$link"
export DMLC_NUM_SERVER=1 DMLC_NUM_WORKER=1 DMLC_PS_ROOT_URI=$SRV_HOST DMLC_PS_ROOT_PORT=${PSLITE_PORT:-8123}
DMLC_ROLE=scheduler DMLC_NODE_HOST=$SRV_HOST in_srv "$bin" &
DMLC_ROLE=server DMLC_NODE_HOST=$SRV_HOST in_srv "$bin" &
server=$!
DMLC_ROLE=worker DMLC_NODE_HOST=$WRK_HOST PSBENCH_SERVER_PID=$server PSBENCH_FILTER=$filter in_wrk "$bin"
wait
