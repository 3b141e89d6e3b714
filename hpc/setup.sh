#!/usr/bin/env bash
# Install what gradsync needs on Debian 12 (root, or a user with sudo), only
# what is missing: Open MPI, libclang (bindgen for mpi-sys), iproute2 (tc, ip
# netns for the emulated network), and a Rust toolchain. Idempotent and quick
# when everything is there.
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
command -v curl >/dev/null 2>&1 || need+=(curl ca-certificates)

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
