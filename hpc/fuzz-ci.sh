#!/usr/bin/env bash
# CI smoke run of the fuzz targets (fuzz/README.md): install cargo-fuzz if
# missing, build every target (address sanitizer, optimized, debug
# assertions and overflow checks), then run each one for FUZZ_SECONDS
# (default 10) starting from its kept corpus under fuzz/corpus/<target>.
# Any crash, leak or timeout fails the script; libFuzzer writes the input
# to fuzz/artifacts/<target>/ (reproduce: see fuzz/README.md).
#
# cargo-fuzz needs nightly flags (-Zsanitizer, -Cpasses=sancov-module);
# RUSTC_BOOTSTRAP=1 lets the installed stable toolchain accept them.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
export RUSTC_BOOTSTRAP=1
SECS=${FUZZ_SECONDS:-10}
FLAGS=(-O -a)

if ! cargo fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi

cd fuzz
cargo fuzz build "${FLAGS[@]}"
status=0
for t in $(cargo fuzz list); do
    # New inputs go to a scratch folder (the first one libFuzzer is
    # given); the kept corpus is only read, so it stays as committed.
    work=$(mktemp -d)
    echo "== fuzz $t for ${SECS}s ($(ls corpus/"$t" | wc -l) kept inputs)"
    if ! cargo fuzz run "${FLAGS[@]}" "$t" "$work" corpus/"$t" -- \
        -max_total_time="$SECS" -timeout=10 -rss_limit_mb=4096 \
        -print_final_stats=1 2>"$work.log"; then
        echo "FAIL: fuzz target $t (log below; input in fuzz/artifacts/$t/)"
        tail -40 "$work.log"
        status=1
    else
        grep -E "^#[0-9]+[[:space:]]+DONE" "$work.log" || true
    fi
    rm -rf "$work" "$work.log"
done
exit $status
