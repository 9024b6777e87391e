#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what it needs, builds the policy modules from
# source (via the build scripts), builds the `syncopate` binary the CLI tests run, then tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --workspace --bins
cargo test --workspace "$@"
