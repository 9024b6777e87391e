#!/usr/bin/env bash
# Installs what the Python package's tests and the PyTorch example need, and nothing that is
# already there: a virtual environment .venv with python/requirements-dev.txt from PyPI (numpy,
# torch, Ray, pytest, ruff, maturin, kubernetes-validate, tensorboard, playwright), Debian's
# Chromium (the dashboard's test drives the page in it, headless), and the `syncopate` package
# built from source into it by maturin (debug profile). scripts/test.sh runs it; the Rust-only demo does not need it.
set -euo pipefail
cd "$(dirname "$0")/.."

# The extension's dependencies build with other features than `cargo test --workspace` unifies,
# so part of the host (wasmtime among it) is compiled twice on a fresh machine: minutes, once.
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
# A real browser for the dashboard's test (python/tests/test_dashboard.py): Debian's Chromium,
# driven by Playwright's Python package, which uses it as it is (no browser download).
if ! command -v chromium >/dev/null 2>&1; then
  echo "setup: installing Debian's chromium (the dashboard's browser test)"
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  if ! { $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -q install chromium >/dev/null \
      || { $sudo apt-get -q update >/dev/null && $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -q install chromium >/dev/null; }; }; then
    echo "error: could not install chromium; the dashboard's test needs a Chromium (set SYNCOPATE_CHROMIUM to one)" >&2
    exit 1
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
