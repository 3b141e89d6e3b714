#!/usr/bin/env bash
# Install what gradsync needs on Debian 12 (root, or a user with sudo), only
# what is missing: Open MPI, libclang (bindgen for mpi-sys), iproute2 (tc, ip
# netns for the emulated network), a Rust toolchain, and for the Python
# package a virtual environment ($GRADSYNC_VENV, default .venv in the
# repository) with numpy, scikit-learn, maturin and mpi4py built from source
# against this machine's MPI; valgrind for the instruction counts.
# Idempotent and quick when everything is there.
set -euo pipefail

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "setup: not root and no sudo" >&2; exit 1; }
  SUDO="sudo"
fi

need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc  >/dev/null 2>&1 || need+=(libopenmpi-dev)
dpkg -s libclang-dev >/dev/null 2>&1 || need+=(libclang-dev clang)
command -v tc >/dev/null 2>&1 || need+=(iproute2)
# callgrind: the instruction counts of tests/instructions.rs.
command -v valgrind >/dev/null 2>&1 || need+=(valgrind)
command -v curl >/dev/null 2>&1 || need+=(curl ca-certificates)
command -v python3 >/dev/null 2>&1 || need+=(python3)
if command -v python3 >/dev/null 2>&1; then
  python3 -c "import venv, ensurepip" >/dev/null 2>&1 || need+=(python3-venv)
  python3 -c "import os, sysconfig; assert os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h'))" \
    >/dev/null 2>&1 || need+=(python3-dev)
else
  need+=(python3-venv python3-dev)
fi

if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

if command -v mpirun >/dev/null 2>&1 && ! mpirun --version 2>/dev/null | grep -q "Open MPI"; then
  echo "setup: warning: mpirun is not Open MPI ($(mpirun --version 2>&1 | head -1)); gradsync is tested with Open MPI 4.1" >&2
fi

if ! command -v cargo >/dev/null 2>&1; then
  if [ -f "$HOME/.cargo/env" ]; then
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
  else
    echo "setup: installing Rust (rustup, stable)"
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal >/dev/null
    # shellcheck disable=SC1091
    . "$HOME/.cargo/env"
  fi
fi

# The Python package's environment (mpi4py must use the MPI gradsync links:
# build it from source with this machine's mpicc, never a wheel's own MPI).
VENV="${GRADSYNC_VENV:-$(cd "$(dirname "$0")/.." && pwd)/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the Python environment $VENV"
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import numpy, sklearn, maturin, mpi4py" >/dev/null 2>&1; then
  echo "setup: installing numpy, scikit-learn, maturin and mpi4py (from source, against $(command -v mpicc)) into $VENV"
  "$VENV/bin/pip" install -q --upgrade pip >/dev/null
  "$VENV/bin/pip" install -q numpy scikit-learn "maturin>=1.16,<2"
  MPICC="$(command -v mpicc)" "$VENV/bin/pip" install -q --no-binary mpi4py "mpi4py>=3.1"
fi
# PyTorch (the registry's wheel, used on the CPU here): GRADSYNC_WITH_TORCH=1
# installs it into the environment (several GB with its CUDA libraries).
# hpc/test.sh sets it, so every torch test runs there; hpc/demo.sh does not
# need it, and gradsync.torch imports without it.
if [ "${GRADSYNC_WITH_TORCH:-0}" = 1 ] && ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  echo "setup: installing torch into $VENV (GRADSYNC_WITH_TORCH=1)"
  "$VENV/bin/pip" install -q torch
fi
