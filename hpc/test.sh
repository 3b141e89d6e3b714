#!/usr/bin/env bash
# Quick start, command 2: install what is missing and run every test (unit and
# property tests in process, integration tests on real mpirun ranks), the
# Slurm tests (hpc/slurm_test.sh: the job scripts on a one-node Slurm,
# skipped with the reason where Slurm cannot start; GRADSYNC_REQUIRE_SLURM=1
# makes that a failure), then, in what is left of GRADSYNC_TEST_BUDGET_S
# (3300 s from the start), the MPI tests against MPICH (hpc/mpich_test.sh;
# GRADSYNC_SKIP_MPICH=1 skips it), a short smoke run of every fuzz target
# over its kept corpus (fuzz/README.md; GRADSYNC_SKIP_FUZZ=1 skips it,
# FUZZ_SECONDS sets seconds per target) and last a report of the step
# model on this machine (hpc/step_report.sh; GRADSYNC_SKIP_STEP_REPORT=1
# skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
# One stream: a record that keeps only standard output (CI's) still shows
# why a step failed, and which command did.
exec 2>&1
trap 'echo "test.sh: FAILED (exit $?) at line $LINENO: $BASH_COMMAND"' ERR
# Each stage's seconds, said as it ends and again in the last line: where
# CI's hour goes on the machine that ran it.
STAGES=""
stage_start=$SECONDS
stage() { # stage NAME: the stage that just ended
  local took=$((SECONDS - stage_start))
  echo "test.sh: stage $1 took ${took} s (${SECONDS} s in all)"
  STAGES="$STAGES $1=${took}s"
  stage_start=$SECONDS
}
# PyTorch too: the torch tests (DDP hook, DistributedOptimizer, half
# precision) run here, none skipped (GRADSYNC_REQUIRE_TORCH=1 below).
GRADSYNC_WITH_TORCH=1 hpc/setup.sh
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
stage setup
# The Python package, built from this tree into the environment setup made
# (tests/python.rs runs it under mpirun; GRADSYNC_REQUIRE_PYTHON=1 makes a
# missing package a failure, not a skip).
VENV="$(realpath -m "${GRADSYNC_VENV:-$PWD/.venv}")"
# maturin's build backend runs the `maturin` command from PATH (pip puts
# nothing there without build isolation): the environment's own.
PATH="$VENV/bin:$PATH" "$VENV/bin/pip" install -q --no-build-isolation --force-reinstall --no-deps ./python
export GRADSYNC_PYTHON="$VENV/bin/python" GRADSYNC_REQUIRE_PYTHON=1 GRADSYNC_REQUIRE_TORCH=1
stage python-package
# MPICH's Debian root (below) is mostly downloads and unpacking: made in
# the background while the engine compiles and its tests run, so that it
# is ready when MPICH's turn comes (its log is shown then).
mpich_prep=""
if [ "${GRADSYNC_SKIP_MPICH:-0}" != 1 ] && [ "$(id -u)" -eq 0 ]; then
  mkdir -p target
  hpc/mpich_test.sh --prepare >target/mpich-prepare.log 2>&1 &
  mpich_prep=$!
fi
# tests/instructions.rs counts under callgrind (setup installed valgrind).
export GRADSYNC_REQUIRE_VALGRIND=1
# The engine's tests (unit, property, doc, mpirun, Python, C examples),
# built once with the cuda feature (GPU buffers): it builds with no CUDA
# toolkit or driver (cudarc loads libcuda at run time), the CPU tests pass
# with it, and tests/gpu.rs's GPU tests print "skipped: <reason>" where no
# GPU is usable (shown by the second, uncaptured run of it). The build
# without the feature is the one the C ABI and the Python package test
# (below and in tests/capi.rs, tests/python.rs), and MPICH's run
# (hpc/mpich_test.sh) builds the command line with it too: one engine
# build per feature set, not two.
cargo test --release --features cuda
cargo test --release --features cuda --test gpu -- --nocapture --test-threads=1
engine_took=$((SECONDS - stage_start))
stage engine-tests
# The C header's drift check (its own package: it builds cbindgen alone).
cargo test --release -p gradsync-capi-header
# The library alone builds without the command line's crates (with the
# cuda feature, as tests/capi.rs built the C ABI under the cuda test run
# above; the Python package built it without).
cargo build --release --no-default-features --features cuda --lib
for f in "" "--features cuda"; do
  # shellcheck disable=SC2086
  if cargo tree --no-default-features $f -e normal -p gradsync | grep -E '^[^a-z]*(clap|plotters|env_logger|indicatif|ndarray-npy) '; then
    echo "test.sh: the library without the cli feature ($f) still depends on the crates above" >&2
    exit 1
  fi
done
echo "test.sh: the library builds without the cli feature and its crates"
# The C ABI with the cuda feature (tests/capi.rs built it so):
# gs_sync_device(GS_MEMORY_CUDA) on one rank fails that step on every rank
# ("libcuda not found" here) and examples/c/failure.c's other checks hold
# as without it (tests/capi.rs ran them all).
cargo build --release -p gradsync-capi --features cuda
mpicc -I include examples/c/failure.c -L target/release -lgradsync \
  -Wl,-rpath,"$PWD/target/release" -o target/release/failure_cuda
hpc/mpirun.sh -np 3 target/release/failure_cuda | grep -E "^(sync_device step 8 |c failure)"
stage capi-and-features
hpc/cluster_test.sh # the emulated cluster (hpc/cluster.sh); skipped with the reason where namespaces cannot be made
# The Slurm job scripts on a real one-node Slurm (hpc/slurm-local.sh installs
# slurm-wlm and munge); skipped with the reason where Slurm cannot start here.
hpc/slurm_test.sh
stage cluster-and-slurm
# The MPI tests against MPICH as well: Debian's MPICH in a Debian root of its
# own made with debootstrap (two MPIs never share a machine), this tree
# mounted into it (docs/running.md#mpich). As root (CI, the README's
# machine) it must run where the budget below allows; elsewhere it says
# why it cannot and is skipped. GRADSYNC_SKIP_MPICH=1 skips it.
if [ -n "$mpich_prep" ]; then
  wait "$mpich_prep" || echo "test.sh: making MPICH's root in the background failed (exit $?); the MPICH run tries again"
  sed 's/^/test.sh: (background) /' target/mpich-prepare.log
fi
# It builds the engine and runs most of the tests above again: about 0.8
# of the engine tests' time (1020 s against 1317 on a 2-vCPU VM). Where
# less than that is left of GRADSYNC_TEST_BUDGET_S it is skipped with the
# reason, so that a slow machine's run stays inside CI's hour
# (GRADSYNC_REQUIRE_MPICH=1 runs it whatever is left).
budget=${GRADSYNC_TEST_BUDGET_S:-3300}
left=$((budget - SECONDS))
mpich_need=$((engine_took * 4 / 5))
if [ "${GRADSYNC_SKIP_MPICH:-0}" = 1 ]; then
  echo "test.sh: the MPICH run skipped (GRADSYNC_SKIP_MPICH=1)"
elif [ "$left" -lt "$mpich_need" ] && [ "${GRADSYNC_REQUIRE_MPICH:-0}" != 1 ]; then
  echo "test.sh: the MPICH run skipped: the tests took ${SECONDS} s, ${left} s of the ${budget} s budget (GRADSYNC_TEST_BUDGET_S) are left, and it needs about ${mpich_need} s here (0.8 of the engine tests' ${engine_took} s); GRADSYNC_REQUIRE_MPICH=1 runs it anyway"
elif [ "$(id -u)" -eq 0 ]; then
  GRADSYNC_REQUIRE_MPICH=1 hpc/mpich_test.sh
else
  hpc/mpich_test.sh
fi
stage mpich
# The fuzz smoke run (cargo fuzz with ASan: 10 s of new inputs a target)
# where 15 minutes of the budget below are left: its build alone took 10
# minutes on a 2-vCPU VM. Every kept input already ran through its target
# in tests/fuzz_corpus.rs above, whatever is left.
left=$((budget - SECONDS))
if [ "${GRADSYNC_SKIP_FUZZ:-0}" = 1 ]; then
  echo "test.sh: fuzz smoke run skipped (GRADSYNC_SKIP_FUZZ=1)"
elif [ "$left" -lt 900 ]; then
  echo "test.sh: fuzz smoke run skipped: the tests took ${SECONDS} s, and ${left} s of the ${budget} s budget (GRADSYNC_TEST_BUDGET_S) are left (it needs 900); tests/fuzz_corpus.rs ran every kept input"
else
  hpc/fuzz-ci.sh
fi
stage fuzz
# Last, a report (nothing asserted): the step model's prediction beside the
# measured step of ResNet-50 and the LSTM at p = 2, over shared memory and
# the emulated 1 Gbit/s network, on whatever machine runs this: the record
# of how the model holds on machines other than the one it was tuned on
# (hpc/step_report.sh). GRADSYNC_SKIP_STEP_REPORT=1 skips it. It fits in
# what is left of GRADSYNC_TEST_BUDGET_S (3300 s from this script's start,
# inside CI's hour): shared memory where 5 minutes are left, then the
# 1 Gbit/s network (about 1.4 times as long) where 1.5 times what shared
# memory took is left, each skip said with its reason.
left=$((budget - SECONDS))
if [ "${GRADSYNC_SKIP_STEP_REPORT:-0}" = 1 ]; then
  echo "test.sh: step model report skipped (GRADSYNC_SKIP_STEP_REPORT=1)"
elif [ "$left" -lt 300 ]; then
  echo "test.sh: step model report skipped: the tests took ${SECONDS} s, and ${left} s of the ${budget} s budget (GRADSYNC_TEST_BUDGET_S) are left"
else
  NETS=shm hpc/step_report.sh || echo "test.sh: the step model report failed (exit $?); it asserts nothing, the tests above passed"
  took=$((SECONDS - stage_start))
  left=$((budget - SECONDS))
  if [ "$left" -lt $((took * 3 / 2)) ]; then
    echo "test.sh: step model report over 1 Gbit/s skipped: shared memory's took ${took} s, and ${left} s of the ${budget} s budget (GRADSYNC_TEST_BUDGET_S) are left"
  else
    NETS=1gbit hpc/step_report.sh || echo "test.sh: the step model report failed (exit $?); it asserts nothing, the tests above passed"
  fi
fi
stage step-report
echo "test.sh: passed in ${SECONDS} s:${STAGES}"
