#!/usr/bin/env bash
# The main job, as far as it exists today: builds Syncopate (policy modules included, from
# source), shows the built-in policies, and validates one module as an operator would before
# loading it. The local training cluster (`syncopate local ...`) replaces this once the
# cluster and workload issues land; see README.md, "Status".
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cargo build --release --bins
bin=target/release/syncopate
echo "== built-in policies"
"$bin" policy list
module=target/policy-wasm/wasm32-unknown-unknown/wasm-policy/syncopate_policy_ssp.wasm
echo "== checking $module with s=2"
"$bin" policy check "$module" --config s=2
