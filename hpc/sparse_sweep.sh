#!/usr/bin/env bash
# Sparse vs dense synchronization over layer sizes, one JSON line per
# (codec, size): `gradsync bench --op sparse` for each codec. Used for the
# crossover table in docs/benchmarks/sparse.md.
#
#   NP=2 hpc/sparse_sweep.sh                       # shared memory
#   hpc/netem.sh --rate 1gbit -- env NP=4 hpc/sparse_sweep.sh
#
# Env: NP (ranks, 2), CODECS, SIZES, DENSITY (0.001), ITERS (10), EXTRA.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
CODECS=${CODECS:-"rgc rgc:method=sampled rgc-quant sbc 3lc fastsgd"}
SIZES=${SIZES:-16K,64K,256K,1M,4M,16M,64M}
DENSITY=${DENSITY:-0.001}
ITERS=${ITERS:-10}
[ -x target/release/gradsync ] || cargo build --release
for c in $CODECS; do
  hpc/mpirun.sh -np "$NP" target/release/gradsync bench --op sparse --codec "$c" \
    --bytes "$SIZES" --density "$DENSITY" --iters "$ITERS" --warmup 2 --check --json ${EXTRA:-}
done
