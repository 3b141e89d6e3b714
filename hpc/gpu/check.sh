#!/usr/bin/env bash
# The one device check: on a GPU machine lent through the workplace's
# `device` tool, with .gpu/ from hpc/gpu/bundle.sh carried,
#
#   run(command="hpc/gpu/check.sh", carry=[".gpu"], timeout_s=480)
#
# Every step prints one line `check.sh: <step>: PASS|FAIL|SKIP <detail>`
# and a summary at the end; the exit status is the number of failed steps.
# Each step runs under its own time limit (the whole script ends in about
# seven minutes at most), and a failed step does not stop the next one.
# Logs and benchmark JSON go to $OUT (.gpu/out without the tool), at most
# one folder down, as the tool brings back.
#
# Steps:
#   env         what the machine is (GPU, driver, nvcc, NVRTC, glibc)
#   tests       hpc/gpu/run.sh: the `gpu` integration tests (staging and
#               the engine on device buffers, device allreduce against
#               MPI_Allreduce under the carried Open MPI) and PyTorch CUDA
#               tensors through GradSync.sync (tests/python/check_cuda.py)
#   kernels     the device sparse path's kernels against their CPU
#               reference on device memory (examples/device_sparse_check,
#               one rank), where the bundle has it
#   sparse      the device-resident sparse step against the host engine
#               at p = 2 ranks sharing the GPU, where the bundle has it
#   bench       benches/gpu/select_bench.py: top-0.1 % selection of 2^26
#               f32 against the device-to-device copy and torch.topk, and
#               the device sparse step against staging plus the host engine
# Without a GPU every step says SKIP or FAIL with its reason (no GPU found,
# no bundle): nothing here needs one to start.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/check.log") 2>&1
failed=0
result() { # step status detail
  echo "check.sh: $1: $2${3:+ $3}"
  [ "$2" = FAIL ] && failed=$((failed + 1))
  return 0
}
started=$(date +%s)
echo "check.sh: started $(date -u '+%F %T') UTC on $(hostname)"

# env ---------------------------------------------------------------------
{
  grep -E '^(PRETTY_NAME)=' /etc/os-release || true
  ldd --version 2>/dev/null | head -1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1 | head -2
  (command -v nvcc >/dev/null && nvcc --version | tail -2) || echo "no nvcc"
  ldconfig -p 2>/dev/null | grep -E 'libnvrtc|libcuda\.so' | head -4
  find /usr /opt -name 'libnvrtc.so*' 2>/dev/null | head -5
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())' 2>&1
  nproc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# NVRTC (the device sparse path compiles its kernels at run time) where
# the loader may not look: the toolkit's lib64 or the nvidia-cuda-nvrtc wheel.
if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so'; then
  nvrtc=$(find /usr/local /usr/lib /opt -name 'libnvrtc.so*' 2>/dev/null | head -1)
  if [ -n "$nvrtc" ]; then
    export LD_LIBRARY_PATH="$(dirname "$nvrtc")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "check.sh: NVRTC from $(dirname "$nvrtc")"
  fi
fi
if nvidia-smi -L >/dev/null 2>&1; then
  result env PASS "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
  gpu=1
else
  result env FAIL "no GPU found (nvidia-smi -L failed): the device steps below cannot pass"
  gpu=0
fi
if [ ! -d .gpu/bin ]; then
  result bundle FAIL "no .gpu/bin: run hpc/gpu/bundle.sh here and carry .gpu"
  echo "check.sh: $failed failed"
  exit "$failed"
fi

# The carried Open MPI (hpc/gpu/mpi_env.sh, as run.sh uses it).
if [ "$gpu" = 1 ]; then
  . hpc/gpu/mpi_env.sh
fi
# GRADSYNC_GPU_STEPS picks steps (default: all of them).
steps=" ${GRADSYNC_GPU_STEPS:-tests kernels sparse bench} "
want() { [[ "$steps" == *" $1 "* ]]; }

# tests -------------------------------------------------------------------
if ! want tests; then
  result tests SKIP "not asked for (GRADSYNC_GPU_STEPS)"
elif [ "$gpu" = 1 ]; then
  mkdir -p "$OUT/run"
  OUT="$OUT/run" timeout 240 hpc/gpu/run.sh > /dev/null 2>&1
  rc=$?
  grep -aE '^test |skipped|GPU-|OK |ERR |run\.sh:|SKIPPED|rank [0-9]+: OK' "$OUT/run/run.log" | head -60
  if [ "$rc" = 0 ] && ! grep -aq "skipped:" "$OUT/run/run.log"; then
    result tests PASS "gpu tests and check_cuda.py"
  elif [ "$rc" = 0 ]; then
    result tests FAIL "passed, but some GPU test skipped (see run/run.log)"
  else
    result tests FAIL "exit $rc (see run/run.log)"
  fi
else
  result tests SKIP "no GPU"
fi
export CUDA_MODULE_LOADING=LAZY

# kernels -----------------------------------------------------------------
if [ "$gpu" = 1 ] && [ -x .gpu/bin/device_sparse_check ] && want kernels; then
  timeout 120 mpirun -np 1 .gpu/bin/device_sparse_check --kernels > "$OUT/kernels.log" 2>&1
  rc=$?
  tail -20 "$OUT/kernels.log"
  if [ "$rc" = 0 ] && grep -q '^KERNELS-OK' "$OUT/kernels.log"; then
    result kernels PASS "$(grep '^KERNELS-OK' "$OUT/kernels.log" | head -1)"
  else
    result kernels FAIL "exit $rc (see kernels.log)"
  fi
else
  result kernels SKIP "no GPU, no .gpu/bin/device_sparse_check in the bundle, or not asked for"
fi
if [ "$gpu" = 1 ] && [ -x .gpu/bin/device_sparse_check ] && want sparse; then
  timeout 120 mpirun -np 2 --oversubscribe .gpu/bin/device_sparse_check > "$OUT/sparse.log" 2>&1
  rc=$?
  tail -20 "$OUT/sparse.log"
  if [ "$rc" = 0 ] && [ "$(grep -c '^SPARSE-OK cuda' "$OUT/sparse.log")" = 2 ]; then
    result sparse PASS "$(grep '^SPARSE-OK cuda' "$OUT/sparse.log" | head -1)"
  else
    result sparse FAIL "exit $rc (see sparse.log)"
  fi
else
  result sparse SKIP "no GPU, no .gpu/bin/device_sparse_check in the bundle, or not asked for"
fi

# bench -------------------------------------------------------------------
if ! want bench; then
  result bench SKIP "not asked for (GRADSYNC_GPU_STEPS)"
elif [ "$gpu" = 1 ]; then
  left=$((400 - ($(date +%s) - started)))
  if [ "$left" -lt 30 ]; then
    result bench SKIP "only ${left}s left of the check's budget"
  else
    PYTHONUNBUFFERED=1 timeout "$left" python3 benches/gpu/select_bench.py --out "$OUT/select_bench.json" > "$OUT/bench.log" 2>&1
    rc=$?
    cat "$OUT/bench.log" | tail -30
    if [ "$rc" = 0 ]; then
      result bench PASS "$OUT/select_bench.json"
    else
      result bench FAIL "exit $rc (see bench.log)"
    fi
  fi
else
  result bench SKIP "no GPU"
fi
echo "check.sh: $failed failed, $(( $(date +%s) - started )) s"
exit "$failed"
