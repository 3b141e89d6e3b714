#!/usr/bin/env bash
# The PyTorch head-to-head: examples/python/train_torch.py (a convolutional
# network of 2.34M parameters on scikit-learn's digits) data-parallel on $NP
# ranks in each configuration, the same model, data, seed and
# hyper-parameters:
#
#   ddp            DistributedDataParallel over gloo, its default allreduce
#   ddp-fp16       DDP with fp16_compress_hook
#   ddp-powersgd   DDP with powerSGD_hook (rank 1, start_powerSGD_iter 10, as torch's docs)
#   gradsync-hook  DDP with gradsync_hook (auto, a profile calibrated in this job)
#   gradsync-opt   gradsync.torch.DistributedOptimizer (overlapping, auto)
#   noop           DDP with noop_hook: no communication, the compute-only limit
#
# over an emulated network (hpc/netem.sh, $RATE) when this machine allows it,
# else over shared memory. Prints a table; writes $OUT/report.json, one JSON
# per configuration and plots of test accuracy against time and step.
#
#   hpc/compare_torch.sh                           # 4 ranks, 1 Gbit/s if possible
#   NETWORK=shm OUT=compare-out-shm hpc/compare_torch.sh
#   NP=2 RATE=300mbit STRATEGY=dense CONFIGS="ddp gradsync-hook gradsync-opt gradsync-opt-whole noop" hpc/compare_torch.sh
#
# Settings (environment): NP (4), NETWORK (auto | emulated | shm), RATE
# (1gbit), OUT (compare-out), STEPS (300), EVAL_EVERY (10), STRATEGY (auto),
# AUTO_POWERSGD (0: the PowerSGD rank `auto` may choose, the engine's
# auto_powersgd),
# BUCKET_CAP_MB (25), BATCH (images a rank per step, 32), CONFIGS (the six
# above; also gradsync-hook-whole and gradsync-opt-whole, without overlap).
set -euo pipefail
cd "$(dirname "$0")/.."
GRADSYNC_WITH_TORCH=1 hpc/setup.sh
# shellcheck disable=SC1091
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
VENV="$(realpath -m "${GRADSYNC_VENV:-$PWD/.venv}")"
PY="$VENV/bin/python"
NP="${NP:-4}"
OUT="${OUT:-compare-out}"
STEPS="${STEPS:-300}"
EVAL_EVERY="${EVAL_EVERY:-10}"
RATE="${RATE:-1gbit}"
STRATEGY="${STRATEGY:-auto}"
AUTO_POWERSGD="${AUTO_POWERSGD:-0}"
BUCKET_CAP_MB="${BUCKET_CAP_MB:-25}"
BATCH="${BATCH:-32}"
CONFIGS="${CONFIGS:-ddp ddp-fp16 ddp-powersgd gradsync-hook gradsync-opt noop}"
NETWORK="${NETWORK:-auto}"

# shellcheck source=hpc/lib.sh
. hpc/lib.sh
echo "compare: building gradsync (release) and its Python package"
gs_build

case "$NETWORK" in
  auto)
    if gs_can_netem; then NETWORK=emulated; else
      echo "compare: no network namespaces here (not root, no passwordless sudo): shared memory instead" >&2
      NETWORK=shm
    fi ;;
  emulated|shm) ;;
  *) echo "compare: NETWORK must be auto, emulated or shm (got \"$NETWORK\")" >&2; exit 2 ;;
esac
label="$NETWORK"
[ "$NETWORK" = emulated ] && label="$RATE"
launch() { gs_launch "$label" "$NP" "$@"; }

rm -rf "$OUT"
mkdir -p "$OUT"
echo "compare: $NP ranks, network $label, $STEPS steps, strategy $STRATEGY; output in $OUT/"
profile=()
if [ "$STRATEGY" = auto ]; then
  echo "compare: calibrating the cost model (gradsync calibrate)"
  launch target/release/gradsync calibrate --out "$OUT/profile.json" \
    --max-bytes "${CALIBRATE_MAX_BYTES:-16M}" --min-seconds "${CALIBRATE_SECONDS:-5}" \
    --reps "${CALIBRATE_REPS:-5}" --note "hpc/compare_torch.sh, $label, $NP ranks" >/dev/null
  profile=(--profile "$OUT/profile.json")
fi
for cfg in $CONFIGS; do
  echo "compare: $cfg"
  launch "$PY" examples/python/train_torch.py --config "$cfg" --steps "$STEPS" \
    --eval-every "$EVAL_EVERY" --strategy "$STRATEGY" --bucket-cap-mb "$BUCKET_CAP_MB" --batch "$BATCH" \
    --auto-powersgd "$AUTO_POWERSGD" "${profile[@]}" --json 2> "$OUT/$cfg.err" | grep '^{' > "$OUT/$cfg.json" || {
      echo "compare: $cfg failed:" >&2; tail -20 "$OUT/$cfg.err" >&2; exit 1; }
done
"$PY" hpc/compare_report.py --out "$OUT" --network "$label" --ranks "$NP" --configs "$CONFIGS" \
  --command "NP=$NP NETWORK=$NETWORK RATE=$RATE STEPS=$STEPS STRATEGY=$STRATEGY AUTO_POWERSGD=$AUTO_POWERSGD BUCKET_CAP_MB=$BUCKET_CAP_MB BATCH=$BATCH CONFIGS=\"$CONFIGS\" hpc/compare_torch.sh"
