#!/usr/bin/env bash
# Installs what building and running Syncopate needs, and nothing that is already there:
# the wasm32 target (policy modules are built from source to wasm32-unknown-unknown).
set -euo pipefail

if ! command -v cargo >/dev/null 2>&1; then
  echo "error: cargo not found; install Rust with rustup (https://rustup.rs) first" >&2
  exit 1
fi

sysroot=$(rustc --print sysroot)
if [ ! -d "$sysroot/lib/rustlib/wasm32-unknown-unknown" ]; then
  echo "setup: installing the wasm32-unknown-unknown target (policy modules are built to it)"
  rustup target add wasm32-unknown-unknown
fi
