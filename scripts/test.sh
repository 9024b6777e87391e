#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then tests. cargo builds the
# policy modules from source (via the build scripts) and the `syncopate` binary that the CLI,
# cluster and A/B tests run; then the Python package's tests run against that binary.
#
# The loopback guard (python/tests/netguard.py) watches every process this script starts, the
# Rust tests' included: the suite fails if any listened on or connected to an address outside
# loopback (outside a network namespace a test made). pytest's own copy of the guard names the
# test that did.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup-python.sh
.venv/bin/python python/tests/netguard.py --root $$ &
guard=$!
trap 'kill "$guard" 2>/dev/null || true' EXIT
cargo test --workspace "$@"
# Issue 36's fault search: 1,000 seeds of replicated clusters with a server killed at a random
# event, in the simulator (docs/fault-tolerance.md). Alone, after the parallel tests.
target/debug/syncopate simtest --seeds 1000
# The Python package (built into .venv by setup-python.sh): lint, then its tests, which start real
# clusters of the binary cargo just built and train real numpy and torch models. `-rs` prints
# why a test was skipped (the CUDA tests, on a machine without a GPU).
.venv/bin/ruff check python examples benches
.venv/bin/ruff format --check python examples benches
SYNCOPATE_BIN="$PWD/target/debug/syncopate" .venv/bin/python -m pytest -q -rs python/tests
trap - EXIT
kill -TERM "$guard"
if ! wait "$guard"; then
  echo "error: a test process reached outside loopback (the loopback guard's findings above)" >&2
  exit 1
fi
echo "loopback guard: every test process stayed on loopback"
