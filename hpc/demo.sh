#!/usr/bin/env bash
# Quick start, command 1: the main job. Installs what is missing, builds, then
# trains examples/python/train_digits.py (an MLP on scikit-learn's digits,
# data-parallel with mpi4py) on $NP ranks in four configurations:
#
#   mpi-dense       MPI_Allreduce of the fused gradients (what a user has today)
#   gradsync-dense  gradsync's fused Rabenseifner allreduce
#   auto            gradsync's cost model, with a profile calibrated at the start
#   rgc             RGC at density 0.001 on every weight (RedSync), biases dense
#
# over an emulated 1 Gbit/s network when this machine allows it (root or
# sudo: hpc/netem.sh), else over shared memory. Prints a progress bar per
# configuration and a table; writes $OUT/report.json and plots (PNG and SVG).
#
#   hpc/demo.sh                          # 4 ranks, 1 Gbit/s if possible
#   NETWORK=shm STEPS=200 hpc/demo.sh    # shared memory, shorter
#
# Settings (environment): NP (4), NETWORK (auto | 1gbit | shm), OUT (demo-out),
# STEPS (300), HIDDEN (1024), WARMUP (dense warm-up steps, 0), EVAL_EVERY (10),
# DENSITY (0.001, the rgc configuration's), CONFIGS (all four).
set -euo pipefail
cd "$(dirname "$0")/.."
hpc/setup.sh
# shellcheck disable=SC1091
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
VENV="$(realpath -m "${GRADSYNC_VENV:-$PWD/.venv}")"
PY="$VENV/bin/python"
NP="${NP:-4}"
OUT="${OUT:-demo-out}"
STEPS="${STEPS:-300}"
HIDDEN="${HIDDEN:-1024}"
WARMUP="${WARMUP:-0}"
EVAL_EVERY="${EVAL_EVERY:-10}"
DENSITY="${DENSITY:-0.001}"
CONFIGS="${CONFIGS:-mpi-dense gradsync-dense auto rgc}"
NETWORK="${NETWORK:-auto}"

# shellcheck source=hpc/lib.sh
. hpc/lib.sh
echo "demo: building gradsync (release) and its Python package"
gs_build

# The network: the emulated 1 Gbit/s link needs network namespaces (root or
# passwordless sudo); without them, shared memory.
case "$NETWORK" in
  auto)
    if gs_can_netem; then NETWORK=1gbit; else
      echo "demo: no network namespaces here (not root, no passwordless sudo): shared memory instead of the emulated 1 Gbit/s network" >&2
      NETWORK=shm
    fi ;;
  1gbit|shm) ;;
  *) echo "demo: NETWORK must be auto, 1gbit or shm (got \"$NETWORK\")" >&2; exit 2 ;;
esac
launch() { gs_launch "$NETWORK" "$NP" "$@"; }

rm -rf "$OUT"
mkdir -p "$OUT"
echo "demo: $NP ranks, network $NETWORK, MLP 64-$HIDDEN-$HIDDEN-10, $STEPS steps; output in $OUT/"

# 1. The cluster profile, calibrated at the start of the job on the same
# ranks and network (what hpc/slurm/calibrate.sbatch does once per cluster).
echo "demo: calibrating the cost model (gradsync calibrate)"
launch target/release/gradsync calibrate --out "$OUT/profile.json" \
  --max-bytes "${CALIBRATE_MAX_BYTES:-16M}" --min-seconds "${CALIBRATE_SECONDS:-5}" \
  --reps "${CALIBRATE_REPS:-5}" --note "hpc/demo.sh, $NETWORK, $NP ranks"

# 2. The four trainings, the same model, data, seed and hyper-parameters.
for cfg in $CONFIGS; do
  extra=()
  case "$cfg" in
    auto) extra=(--profile "$OUT/profile.json") ;;
    rgc) extra=(--density "$DENSITY") ;;
    mpi-dense|gradsync-dense) ;;
    *) echo "demo: unknown configuration \"$cfg\"" >&2; exit 2 ;;
  esac
  launch "$PY" examples/python/train_digits.py --mode "$cfg" --label "$cfg" \
    --steps "$STEPS" --hidden "$HIDDEN" --warmup "$WARMUP" --eval-every "$EVAL_EVERY" \
    --progress --json --curve "$OUT/$cfg.json" "${extra[@]}" > "$OUT/$cfg.out"
done

# 3. The table, report.json and the plots.
"$PY" hpc/demo_report.py --out "$OUT" --network "$NETWORK" --ranks "$NP" \
  --configs "$CONFIGS" --command "NP=$NP NETWORK=$NETWORK STEPS=$STEPS HIDDEN=$HIDDEN hpc/demo.sh"
