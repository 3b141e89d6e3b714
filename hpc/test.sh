#!/usr/bin/env bash
# Quick start, command 2: install what is missing and run every test (unit and
# property tests in process, integration tests on real mpirun ranks).
set -euo pipefail
cd "$(dirname "$0")/.."
hpc/setup.sh
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
cargo test --release
