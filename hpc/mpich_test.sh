#!/usr/bin/env bash
# gradsync against MPICH: builds the library, the CLI, the examples and the
# tests with Debian's MPICH (4.0.2, `mpich libmpich-dev`) and runs the MPI
# test suite's subset under MPICH's mpirun (Hydra): every collective against
# MPI_Allreduce/MPI_Allgatherv (tests/mpi.rs, sparse_allreduce.rs,
# hierarchical*.rs), the engine's bitwise checks (tests/mpi.rs,
# feedback_engine.rs), the failure tests (failure.rs, cli_inputs.rs), the
# CUDA-aware query (tests/gpu.rs with the cuda feature: MPICH answers
# MPIX_GPU_query_support), and the Python package over mpi4py built
# against MPICH (tests/python.rs' API and failure checks).
#
# Two MPIs on one machine mix their mpicc/mpirun alternatives, so MPICH
# lives in a Debian 12 root of its own, made with debootstrap (kept in
# $GRADSYNC_MPICH_ROOT, default /var/tmp/gradsync-mpich, and reused), with
# this tree bind-mounted at its own path, the host's Rust toolchain
# ($CARGO_HOME, $RUSTUP_HOME) mounted read-only, and /proc, /sys and /dev
# (shared memory) from the host. Builds go to target/mpich.
#
# Needs root (debootstrap, mount, chroot) and Debian's package mirror.
# Where the root cannot be made, it says why and exits 0 (skipped);
# GRADSYNC_REQUIRE_MPICH=1 makes that a failure.
#   hpc/mpich_test.sh                 # the whole subset
#   hpc/mpich_test.sh --test failure  # one test binary (cargo test arguments)
#   hpc/mpich_test.sh --prepare       # only make the root (debootstrap, MPICH)
#
# --prepare is mostly downloads and unpacking: hpc/test.sh runs it in the
# background while the Open MPI suite compiles, so the root is ready when
# its turn comes.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
ROOT="$(realpath -m "${GRADSYNC_MPICH_ROOT:-/var/tmp/gradsync-mpich}")"
[ "$ROOT" != / ] || { echo "mpich_test.sh: GRADSYNC_MPICH_ROOT is /" >&2; exit 1; }
MIRROR="${GRADSYNC_DEBIAN_MIRROR:-http://deb.debian.org/debian}"

skip() {
  if [ "${GRADSYNC_REQUIRE_MPICH:-0}" = 1 ]; then
    echo "mpich_test.sh: FAILED: $*" >&2
    exit 1
  fi
  echo "mpich_test.sh: skipped: $*"
  exit 0
}

[ "$(id -u)" -eq 0 ] || skip "not root (debootstrap, mount and chroot need root)"
# A mount namespace of its own where the machine allows one: the mounts
# below then end with this script, even when it is killed.
if [ -z "${GRADSYNC_MPICH_NS:-}" ] && unshare -m --propagation private true 2>/dev/null; then
  exec env GRADSYNC_MPICH_NS=1 unshare -m --propagation private "$REPO/hpc/mpich_test.sh" "$@"
fi
CARGO_HOME="${CARGO_HOME:-$HOME/.cargo}"
RUSTUP_HOME="${RUSTUP_HOME:-$HOME/.rustup}"
[ -x "$CARGO_HOME/bin/cargo" ] || skip "no cargo in $CARGO_HOME/bin"

# The root: Debian 12 (the same glibc as the host's toolchain), MPICH, a C
# toolchain for mpi-sys (bindgen's libclang, make for libffi), Python for
# mpi4py. A root whose packages are all there is reused as it is.
PKGS="mpich libmpich-dev libclang-dev pkg-config gcc g++ make libc6-dev ca-certificates
  python3 python3-dev python3-venv"
if [ ! -x "$ROOT/usr/bin/mpichversion" ] || [ ! -f "$ROOT/.gradsync-ready" ]; then
  command -v debootstrap >/dev/null || {
    apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null
  } || skip "debootstrap cannot be installed"
  if [ ! -f "$ROOT/.debootstrap-done" ]; then
    echo "mpich_test.sh: debootstrap bookworm into $ROOT"
    # Never remove a root that still has something mounted in it (a run
    # killed before its clean-up): the mounts are the host's own files.
    if awk -v r="$ROOT/" 'index($2 "/", r) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
      echo "mpich_test.sh: $ROOT is incomplete and has mounts inside (umount -R them first)" >&2
      exit 1
    fi
    rm -rf --one-file-system "$ROOT"
    debootstrap --variant=minbase bookworm "$ROOT" "$MIRROR" >/tmp/gradsync-debootstrap.log 2>&1 ||
      skip "debootstrap failed (see /tmp/gradsync-debootstrap.log)"
    touch "$ROOT/.debootstrap-done"
  fi
fi

# Mounts, undone on exit whatever happens. Each is made a slave, so
# unmounting inside the root never reaches the host's own mounts.
MOUNTED=()
cleanup() {
  local i
  for ((i = ${#MOUNTED[@]} - 1; i >= 0; i--)); do
    umount -R "${MOUNTED[$i]}" 2>/dev/null || umount -lR "${MOUNTED[$i]}" 2>/dev/null || true
  done
}
trap cleanup EXIT
bind() { # bind SOURCE [ro]: SOURCE at the same path inside the root
  local src="$1" dst="$ROOT$1"
  mkdir -p "$dst"
  mountpoint -q "$dst" && return 0
  mount --rbind "$src" "$dst" || skip "cannot bind-mount $src into $ROOT"
  mount --make-rslave "$dst"
  MOUNTED+=("$dst")
  if [ "${2:-}" = ro ]; then mount -o remount,bind,ro "$dst" || true; fi
}
mkdir -p "$ROOT/proc"
if ! mountpoint -q "$ROOT/proc"; then
  mount -t proc proc "$ROOT/proc" || skip "cannot mount /proc in $ROOT"
  MOUNTED+=("$ROOT/proc")
fi
bind /sys
bind /dev
bind "$CARGO_HOME"
bind "$RUSTUP_HOME" ro
bind "$REPO"
cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
cp -L /etc/hosts "$ROOT/etc/hosts" 2>/dev/null || true # Hydra resolves this machine's name

# What reaches package registries from here (a proxy, pip's index and
# certificate settings) reaches them from the root too.
PASS=()
while IFS= read -r kv; do PASS+=("$kv"); done < <(env | grep -E \
  '^(PIP_(INDEX_URL|EXTRA_INDEX_URL|TRUSTED_HOST|CERT|DEFAULT_TIMEOUT)|https?_proxy|HTTPS?_PROXY|no_proxy|NO_PROXY|SSL_CERT_FILE|REQUESTS_CA_BUNDLE|CARGO_HTTP_CAINFO|CARGO_NET_OFFLINE|RUSTUP_TOOLCHAIN)=' || true)
in_root() {
  chroot "$ROOT" /usr/bin/env -i HOME=/root LANG=C.UTF-8 TERM=dumb "${PASS[@]}" \
    PATH="$CARGO_HOME/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin" \
    CARGO_HOME="$CARGO_HOME" RUSTUP_HOME="$RUSTUP_HOME" RUSTUP_AUTO_INSTALL=0 \
    CARGO_TARGET_DIR="$REPO/target/mpich" DEBIAN_FRONTEND=noninteractive \
    bash -c "cd '$REPO' && $1"
}

if [ ! -f "$ROOT/.gradsync-ready" ]; then
  echo "mpich_test.sh: installing MPICH in $ROOT"
  # shellcheck disable=SC2086
  in_root "apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(echo $PKGS)" \
    >/tmp/gradsync-mpich-apt.log 2>&1 || skip "apt-get in $ROOT failed (see /tmp/gradsync-mpich-apt.log)"
  touch "$ROOT/.gradsync-ready"
fi
if [ "${1:-}" = --prepare ]; then
  echo "mpich_test.sh: the root $ROOT is ready"
  exit 0
fi
# The host's certificate bundle (it may hold a site's own authority) and
# pip's settings.
cp -L /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt" 2>/dev/null || true
[ ! -f /etc/pip.conf ] || cp -L /etc/pip.conf "$ROOT/etc/pip.conf"
# Certificate files those variables name, at the same paths in the root.
for kv in "${PASS[@]}"; do
  f="${kv#*=}"
  case "$f" in /*) [ ! -f "$f" ] || [ -e "$ROOT$f" ] || { mkdir -p "$ROOT$(dirname "$f")" && cp -L "$f" "$ROOT$f"; } ;; esac
done
in_root "command -v mpirun.openmpi" >/dev/null 2>&1 && {
  echo "mpich_test.sh: Open MPI is installed in $ROOT beside MPICH: remove it or the root" >&2
  exit 1
}
echo "mpich_test.sh: $(in_root 'mpichversion | head -1 | tr -s "\t " " "'), $(in_root 'mpirun --version | grep -m1 Version: | tr -s " "' | sed 's/^ *//;s/Version:/Hydra/')"

# Oversubscribed MPICH ranks spin without yielding: a shim that yields when
# UCX's progress finds nothing (hpc/mpich_yield.c) is preloaded into the
# test runs, as Open MPI yields by itself.
in_root "gcc -O2 -shared -fPIC -o /opt/gradsync-yield.so hpc/mpich_yield.c -ldl"
YIELD="LD_PRELOAD=/opt/gradsync-yield.so"

# Python: mpi4py from source against the root's MPICH, the package from
# this tree (maturin), in a virtual environment inside the root.
VENV=/opt/gradsync-venv
if [ -z "${1:-}" ]; then
  in_root "[ -x $VENV/bin/python ] || python3 -m venv $VENV
    $VENV/bin/pip install -q numpy 'maturin>=1.16,<2' &&
    MPICC=mpicc $VENV/bin/pip install -q --no-binary mpi4py 'mpi4py>=3.1' &&
    PATH=$VENV/bin:\$PATH $VENV/bin/pip install -q --no-build-isolation --force-reinstall --no-deps ./python" \
    >/tmp/gradsync-mpich-pip.log 2>&1 || {
    tail -20 /tmp/gradsync-mpich-pip.log >&2
    echo "mpich_test.sh: the Python package did not build against MPICH (above)" >&2
    exit 1
  }
fi

export_env="$YIELD GRADSYNC_PYTHON=$VENV/bin/python GRADSYNC_REQUIRE_PYTHON=1"
# One feature set for every build here, the command line with the cuda
# feature (hpc/test.sh's engine tests use the same): the CUDA-aware query
# needs it and the CPU paths are the same with it, so the engine is built
# once, not once per feature set. The examples the tests run under mpirun
# first (`cargo test --test ...` does not build them).
FEATURES="--features cli,cuda"
in_root "cargo build --release $FEATURES --examples"
if [ $# -gt 0 ]; then
  in_root "$export_env cargo test --release $FEATURES $*"
  exit 0
fi
in_root "$export_env cargo test --release $FEATURES \
  --test mpi --test failure --test sparse_allreduce --test hierarchical \
  --test hierarchical_sparse --test feedback_engine --test cli_inputs --test capi"
in_root "$export_env cargo test --release $FEATURES --test python -- \
  python_api_under_mpirun python_different_calls_fail_alike_under_mpirun"
in_root "$YIELD cargo test --release $FEATURES --test gpu -- --nocapture --test-threads=1"
echo "mpich_test.sh: the MPI tests passed against MPICH"
