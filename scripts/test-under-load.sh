#!/usr/bin/env bash
# The whole test suite (scripts/test.sh, its arguments passed on) while a CPU hog keeps every
# core busy: the suite's timeouts are limits on liveness, not on speed, and Ctrl-C must end a
# blocked worker or a Ray driver whatever the load, so it must pass like this too.
#
# The hog is stress-ng's CPU stressor, one per core at normal priority (Debian's stress-ng,
# installed if missing; a shell busy loop per core where it cannot be). Everything is built
# before the hog starts, so the load is on the tests, not the compiler. Usage:
#
#     scripts/test-under-load.sh            # every test
#     HOG_PER_CORE=2 scripts/test-under-load.sh   # two hogs per core: a heavier load
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/setup.sh
scripts/setup-python.sh
cargo test --workspace --no-run "$@"

cores=$(nproc)
hogs=$((cores * ${HOG_PER_CORE:-1}))
if ! command -v stress-ng >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get -y -q install stress-ng >/dev/null 2>&1 || true
fi
pids=()
if command -v stress-ng >/dev/null 2>&1; then
  stress-ng --cpu "$hogs" --quiet &
  pids+=($!)
  echo "test-under-load: stress-ng --cpu $hogs on $cores cores"
else
  for _ in $(seq "$hogs"); do
    (while :; do :; done) &
    pids+=($!)
  done
  echo "test-under-load: $hogs shell busy loops on $cores cores"
fi
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT

start=$(date +%s)
scripts/test.sh "$@"
echo "test-under-load: the suite passed under load in $(($(date +%s) - start)) s"
