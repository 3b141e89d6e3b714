#!/usr/bin/env bash
# Instruction counts of the engine's local phases under callgrind
# (examples/local_phases.rs), held against the baseline kept in
# benches/instructions.json by tests/instructions.rs: a rise past 3 % fails.
# --update rewrites the baseline (after a change that is meant to cost
# instructions, or under a new rustc).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
if [ "${1:-}" = --update ]; then
  export GRADSYNC_UPDATE_INSTRUCTIONS=1
fi
export GRADSYNC_REQUIRE_VALGRIND=1
cargo build --release --example local_phases
cargo test --release --test instructions -- --nocapture
