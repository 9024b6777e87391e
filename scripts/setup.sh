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

# Python: the package's tests (and the PyTorch example) run in a virtual environment, .venv,
# with the packages of python/requirements-dev.txt from PyPI, and the `syncopate` package
# built from source into it by maturin (debug profile, sharing cargo's build of the host).
py=${SYNCOPATE_SETUP_PYTHON:-python3}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "error: the Python package needs Python 3.10 or later as $py (set SYNCOPATE_SETUP_PYTHON)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating the Python environment .venv"
  if ! "$py" -m venv .venv; then
    sudo=""
    if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -q install python3-venv
    "$py" -m venv .venv
  fi
fi
stamp=.venv/.requirements-installed
if [ ! -e "$stamp" ] || [ python/requirements-dev.txt -nt "$stamp" ]; then
  echo "setup: installing the Python test dependencies into .venv (torch is large: minutes)"
  .venv/bin/pip install -q -r python/requirements-dev.txt
  touch "$stamp"
fi
echo "setup: building the syncopate Python package into .venv"
VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH" .venv/bin/maturin develop -q -m python/Cargo.toml
