#!/usr/bin/env bash
# The step model against the engine, measured: for each layer
# table, `gradsync bench --op step --calibrate --compare` calibrates in the
# same job (calibrate, shuffled rounds), plans the table, and measures
# the planned step, dense-only, all-sparse, RGC above the engine's
# compression threshold with the small layers dense (`sparse-threshold`,
# the engine's default for the codec) and all-PowerSGD (rank 2),
# interleaved with MPI_Allreduce of the fused table. One JSON line per
# (table, configuration) on stdout.
#
#   NP=2 hpc/step_bench.sh                                   # shared memory
#   hpc/netem.sh --rate 1gbit -- env NP=4 hpc/step_bench.sh  # emulated 1 Gbit/s
#
# Env: NP (ranks, 2), TABLES (resnet50 lstm2), DENSITY (0.001), ITERS (7),
# OUT (directory for the calibrated profiles, target/step-bench),
# THRESHOLD (the engine's compress_threshold in elements; unset: its
# default, 32768; 0 lets the plan compress every layer).
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
TABLES=${TABLES:-"resnet50 lstm2"}
DENSITY=${DENSITY:-0.001}
ITERS=${ITERS:-7}
OUT=${OUT:-target/step-bench}
THRESHOLD_ARGS=()
[ -n "${THRESHOLD:-}" ] && THRESHOLD_ARGS=(--compress-threshold "$THRESHOLD")
mkdir -p "$OUT"
[ -x target/release/gradsync ] || cargo build --release
for t in $TABLES; do
  hpc/mpirun.sh -np "$NP" target/release/gradsync bench --op step \
    --layers "examples/layers/$t.json" --density "$DENSITY" --iters "$ITERS" --warmup 1 \
    --calibrate --profile "$OUT/profile-$t-p$NP.json" --compare --json "${THRESHOLD_ARGS[@]}"
done
