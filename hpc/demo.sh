#!/usr/bin/env bash
# Quick start, command 1: install what is missing, build release, and run the
# main job on local ranks: the verified dense allreduce benchmark (every
# algorithm checked against MPI_Allreduce, then timed against it).
set -euo pipefail
cd "$(dirname "$0")/.."
hpc/setup.sh
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
cargo build --release --quiet
np="${NP:-2}"
hpc/mpirun.sh -np "$np" target/release/gradsync bench --op allreduce --algo all \
  --sizes "${SIZES:-4K,64K,1M,16M}" --iters "${ITERS:-20}" --warmup 3 --check
