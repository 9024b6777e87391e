#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, then tests. cargo builds the
# policy modules from source (via the build scripts) and the `syncopate` binary that the CLI,
# cluster and A/B tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo test --workspace "$@"
