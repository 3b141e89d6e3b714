#!/usr/bin/env bash
# On a GPU machine lent through the `device` tool, with .gpu/ from
# hpc/gpu/bundle.sh carried:  run(command="hpc/gpu/run.sh", carry=[".gpu"])
# Unpacks the carried Open MPI under /opt/gs-mpi, puts the examples where the
# test expects them, and runs the `gpu` integration test one test at a time.
# Logs go to $OUT (or .gpu/out without the tool).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-.gpu/out}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
exe_dir=$(cat .gpu/exe_dir)
# That path is the build folder of the machine that made the bundle: there,
# the copies below would overwrite its own builds (hard links into deps/).
if [ -s "$exe_dir/gradsync" ] && [ "${GRADSYNC_GPU_RUN_HERE:-0}" != 1 ]; then
  echo "run.sh: $exe_dir holds a build (the machine that made the bundle?): run this on the GPU machine, or set GRADSYNC_GPU_RUN_HERE=1 to overwrite its examples" >&2
  exit 2
fi
. hpc/gpu/mpi_env.sh
mkdir -p "$exe_dir/examples"
cp .gpu/bin/staging_check .gpu/bin/device_engine_check .gpu/bin/device_sparse_check "$exe_dir/examples/"
# The test finds the examples beside this path (never truncate a real one).
[ -e "$exe_dir/gradsync" ] || : > "$exe_dir/gradsync"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "run.sh: no nvidia-smi"
mpirun --version | head -1
ompi_info --parsable --all 2>/dev/null | grep "mpi_built_with_cuda_support:value" || true
ldd "$exe_dir/examples/staging_check" | grep -E "libmpi|not found"
rc=0
RUST_LOG=${RUST_LOG:-gradsync=info} .gpu/bin/gpu --test-threads=1 --nocapture || rc=$?
echo "run.sh: gpu tests exit $rc"
# Python: PyTorch CUDA tensors through DLPack (the engine's staged device
# path; GRADSYNC_CUDA_AWARE changes only what its stats report), the
# image's python3 (the one with torch) and its mpi4py, with the carried MPI.
if ls .gpu/wheel/*.whl >/dev/null 2>&1; then
  py=/tmp/gs-py
  rm -rf "$py"
  python3 -m pip install --quiet --no-deps --no-index --target "$py" .gpu/wheel/*.whl
  python3 -c "import mpi4py, mpi4py.MPI as M; print('run.sh: mpi4py', mpi4py.__version__, M.Get_library_version().splitlines()[0])"
  prc=0
  PYTHONPATH="$py" timeout 300 \
    mpirun -np 2 --oversubscribe python3 -m mpi4py tests/python/check_cuda.py || prc=$?
  echo "run.sh: check_cuda.py exit $prc"
  [ "$prc" = 0 ] || rc=$prc
  # PyTorch's own entry points on CUDA models: the DDP comm hook and
  # DistributedOptimizer, each against the same on a CPU copy.
  prc=0
  PYTHONPATH="$py" timeout 300 \
    mpirun -np 2 --oversubscribe python3 -m mpi4py tests/python/check_cuda_torch.py || prc=$?
  echo "run.sh: check_cuda_torch.py exit $prc"
  [ "$prc" = 0 ] || rc=$prc
else
  echo "run.sh: no .gpu/wheel: the Python CUDA check was not run"
fi
exit "$rc"
