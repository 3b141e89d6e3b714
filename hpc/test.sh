#!/usr/bin/env bash
# Quick start, command 2: install what is missing and run every test (unit and
# property tests in process, integration tests on real mpirun ranks), then a
# short smoke run of every fuzz target over its kept corpus (fuzz/README.md;
# GRADSYNC_SKIP_FUZZ=1 skips it, FUZZ_SECONDS sets seconds per target).
set -euo pipefail
cd "$(dirname "$0")/.."
hpc/setup.sh
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
cargo test --release
if [ "${GRADSYNC_SKIP_FUZZ:-0}" = 1 ]; then
  echo "test.sh: fuzz smoke run skipped (GRADSYNC_SKIP_FUZZ=1)"
else
  hpc/fuzz-ci.sh
fi
