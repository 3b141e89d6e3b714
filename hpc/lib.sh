# Shell functions shared by hpc/demo.sh and hpc/compare_torch.sh (sourced,
# from the repository root, after hpc/setup.sh; they read $VENV and $PY).

# Build gradsync (release) and install its Python package into $VENV, with
# matplotlib for the plots.
gs_build() {
  cargo build --release --quiet
  # maturin's build backend runs the `maturin` command from PATH (pip puts
  # nothing there without build isolation): the environment's own.
  PATH="$VENV/bin:$PATH" "$VENV/bin/pip" install -q --no-build-isolation --force-reinstall --no-deps ./python
  "$PY" -c "import matplotlib" >/dev/null 2>&1 || "$VENV/bin/pip" install -q matplotlib
}

# Whether an emulated network can be made here: network namespaces need root
# or passwordless sudo.
gs_can_netem() {
  local s=""
  if [ "$(id -u)" -ne 0 ]; then
    sudo -n true 2>/dev/null || return 1
    s=sudo
  fi
  local ns="gradsync-probe$$"
  $s ip netns add "$ns" 2>/dev/null || return 1
  $s ip netns del "$ns"
}

# gs_launch RATE NP command...: NP ranks over shared memory (RATE "shm") or
# over an emulated network of RATE (hpc/netem.sh).
gs_launch() {
  local rate="$1" np="$2"
  shift 2
  if [ "$rate" = shm ]; then
    hpc/mpirun.sh -np "$np" "$@"
  else
    hpc/netem.sh --rate "$rate" -- hpc/mpirun.sh -np "$np" "$@"
  fi
}
