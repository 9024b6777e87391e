#!/usr/bin/env bash
# Installs what building and running Syncopate needs, and nothing that is already there:
# the wasm32 target (policy modules are built from source to wasm32-unknown-unknown), the
# Fashion-MNIST dataset and the English text of Debian's fortunes (the language model's data).
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

sudo=""
if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
apt() { $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -q "$@"; }
# install_package PACKAGE WHAT: Debian's PACKAGE, updating the package lists once if it is not found.
install_package() {
  echo "setup: installing Debian's $1 ($2)"
  if ! { apt install "$1" || { apt update && apt install "$1"; }; }; then
    echo "error: could not install $1; put its files in a directory and pass it with --data DIR" >&2
    exit 1
  fi
}

# Fashion-MNIST, the real dataset the image workloads train on (60,000 + 10,000 images, MIT
# licence), from Debian's package, which installs it offline into /usr/share/datasets/fashion-mnist/.
data=/usr/share/datasets/fashion-mnist
if [ ! -e "$data/train-images-idx3-ubyte.gz" ] && [ ! -e "$data/train-images-idx3-ubyte" ]; then
  install_package dataset-fashion-mnist "the training images"
fi

# The fortune-cookie files (about 2.5 MB of English quotations, jokes and poems), the text the
# fortunes-lm language model trains on, into /usr/share/games/fortunes/.
if [ ! -e /usr/share/games/fortunes/cookie ]; then
  install_package fortunes "the language model's text"
fi
