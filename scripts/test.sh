#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then tests. cargo builds the
# policy modules from source (via the build scripts) and the `syncopate` binary that the CLI,
# cluster and A/B tests run; then the Python package's tests run against that binary.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/setup-python.sh
cargo test --workspace "$@"
# The Python package (built into .venv by setup-python.sh): lint, then its tests, which start real
# clusters of the binary cargo just built and train real numpy and torch models.
.venv/bin/ruff check python examples benches
.venv/bin/ruff format --check python examples benches
SYNCOPATE_BIN="$PWD/target/debug/syncopate" .venv/bin/python -m pytest -q python/tests
