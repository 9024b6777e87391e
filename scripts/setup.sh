#!/usr/bin/env bash
# Installs what building and running Syncopate needs, and nothing that is already there:
# the wasm32 target (policy modules are built from source to wasm32-unknown-unknown) and the
# Fashion-MNIST dataset.
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

# Fashion-MNIST, the real dataset the workloads train on (60,000 + 10,000 images, MIT licence),
# from Debian's package, which installs it offline into /usr/share/datasets/fashion-mnist/.
data=/usr/share/datasets/fashion-mnist
if [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
  echo "setup: installing Debian's dataset-fashion-mnist (the training data)"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  apt() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -q "$@"; }
  if ! { apt install dataset-fashion-mnist || { apt update && apt install dataset-fashion-mnist; }; }; then
    echo "error: could not install dataset-fashion-mnist; put the four Fashion-MNIST IDX files in a" >&2
    echo "       directory and pass it with --data DIR" >&2
    exit 1
  fi
fi
