#!/usr/bin/env bash
# The Slurm tests, run by hpc/test.sh: a real one-node Slurm
# (hpc/slurm-local.sh, its own state folder) runs the job scripts as a
# cluster user would, at small sizes, 4 tasks on this node (oversubscribed
# where it has fewer cores):
#
#   1. hpc/slurm/calibrate.sbatch (srun --mpi=pmix): every rank reports, and
#      the profile loads and predicts (`gradsync predict --profile`);
#   2. hpc/slurm/train.sbatch (srun): auto and dense runs, auto's test
#      accuracy within 1 point of dense's;
#   3. train.sbatch again with GRADSYNC_LAUNCHER=mpirun (Open MPI's mpirun
#      inside the allocation), the same checks;
#   4. `srun -n 4 --mpi=pmix gradsync verify` (every collective against MPI);
#   5. a job that fails (no profile) makes `sbatch --wait` fail;
#   6. `down` (twice) leaves no Slurm or munge daemon running.
#
# Where Slurm cannot start here (not root and no passwordless sudo, the
# packages not installable, another Slurm running), it prints
# "slurm_test.sh: SKIPPED: <reason>" and exits 0; GRADSYNC_REQUIRE_SLURM=1
# makes that a failure. Uses GRADSYNC_PYTHON (default .venv/bin/python) and
# GRADSYNC_BIN (default target/release/gradsync, built by cargo test).
set -euo pipefail
cd "$(dirname "$0")/.."
t_start=$SECONDS

NP=4
BIN="${GRADSYNC_BIN:-$PWD/target/release/gradsync}"
PY="${GRADSYNC_PYTHON:-$PWD/.venv/bin/python}"
JOB_TIMEOUT="${GRADSYNC_SLURM_JOB_TIMEOUT:-300}"
WORK="$(mktemp -d /tmp/gradsync-slurm-test.XXXXXX)"
chmod 755 "$WORK" # munged (user munge) keeps its socket in here
export GRADSYNC_SLURM_DIR="$WORK/slurm"
# --ntasks-per-node=4 needs a node of at least 4 CPUs (slurm-local.sh).
cpus="$(nproc)"
export GRADSYNC_SLURM_CPUS="$((cpus > NP ? cpus : NP))"
export SLURM_CONF="$GRADSYNC_SLURM_DIR/etc/slurm.conf"

say() { echo "slurm_test.sh: $*"; }

# The tails of the files given (a job's output, the daemons' logs).
tails() {
  local f
  for f in "$@"; do
    [ -s "$f" ] || continue
    echo "---- last lines of $f ----" >&2
    tail -n 40 "$f" >&2
  done
}

fail() {
  local msg="$1"
  shift
  echo "slurm_test.sh: FAILED: $msg" >&2
  tails "$@" "$GRADSYNC_SLURM_DIR/log/slurmctld.log" "$GRADSYNC_SLURM_DIR/log/slurmd.log"
  echo "slurm_test.sh: files kept in $WORK" >&2
  KEEP=1
  exit 1
}

KEEP=0
# A munged of the system may run before and after (this test's has its own socket).
munged_before=" $(pgrep -x munged | tr "\n" " " || true)"
cleanup() {
  local rc=$?
  hpc/slurm-local.sh down >>"$WORK/down.log" 2>&1 || {
    echo "slurm_test.sh: hpc/slurm-local.sh down failed:" >&2
    cat "$WORK/down.log" >&2
    rc=1
  }
  if [ "$KEEP" = 0 ] && [ "$rc" = 0 ]; then
    rm -rf "$WORK"
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP

# 0. Slurm up (a no-op the second time).
rc=0
hpc/slurm-local.sh up >"$WORK/up.log" 2>&1 || rc=$?
if [ "$rc" -ne 0 ]; then
  reason="$(grep -m1 'cannot run Slurm here' "$WORK/up.log" | sed 's/^slurm-local.sh: cannot run Slurm here: //' || true)"
  [ -n "$reason" ] || reason="hpc/slurm-local.sh up exited $rc: $(tail -n 1 "$WORK/up.log")"
  if [ "${GRADSYNC_REQUIRE_SLURM:-0}" = 1 ]; then
    fail "Slurm does not start and GRADSYNC_REQUIRE_SLURM=1: $reason" "$WORK/up.log"
  fi
  say "SKIPPED: $reason"
  exit 0
fi
sed 's/^/  /' "$WORK/up.log"
hpc/slurm-local.sh up >"$WORK/up2.log" 2>&1 || fail "a second up failed" "$WORK/up2.log"
grep -q "already up" "$WORK/up2.log" || fail "a second up was not a no-op" "$WORK/up2.log"
srun --mpi=list >"$WORK/mpi-list.txt" 2>&1 || fail "srun --mpi=list failed" "$WORK/mpi-list.txt"
grep -qw pmix "$WORK/mpi-list.txt" || fail "srun --mpi=list has no pmix" "$WORK/mpi-list.txt"
[ -x "$BIN" ] || fail "no gradsync binary at $BIN (cargo build --release)"
"$PY" -c "import gradsync, mpi4py, sklearn" 2>"$WORK/python.txt" \
  || fail "$PY cannot import gradsync, mpi4py and sklearn (set GRADSYNC_PYTHON)" "$WORK/python.txt"

# sbatch --wait, bounded; the job's own exit status is sbatch's.
submit() {
  local name="$1" out="$2" t0=$SECONDS rc=0
  shift 2
  timeout "$JOB_TIMEOUT" sbatch --wait --quiet -N 1 -n "$NP" --ntasks-per-node="$NP" \
    --time=10 --job-name="gradsync-test-$name" -o "$out" "$@" >"$out.sbatch" 2>&1 || rc=$?
  [ "$rc" -ne 124 ] || fail "job $name still running after ${JOB_TIMEOUT} s" "$out.sbatch" "$out"
  say "job $name: exit $rc, $((SECONDS - t0)) s"
  return "$rc"
}

# Every rank printed its rank line (0..NP-1 once each) through LAUNCHER.
check_ranks() {
  local out="$1" what="$2" r
  for ((r = 0; r < NP; r++)); do
    grep -q "^gradsync: rank $r of $NP, local rank $r, on " "$out" \
      || fail "$what: no line from rank $r (rank $r of $NP, local rank $r)" "$out"
  done
}

# Both JSON lines of train.sbatch, and auto within 1 point of dense.
check_train() {
  local out="$1" what="$2"
  "$PY" - "$out" "$NP" >"$out.check" 2>&1 <<'EOF' || fail "$what: $(tail -n 1 "$out.check")" "$out"
import json, sys
out, np_ = sys.argv[1], int(sys.argv[2])
runs = {}
for line in open(out):
    if line.startswith("{"):
        d = json.loads(line)
        runs[d["mode"]] = d
for mode in ("auto", "dense"):
    if mode not in runs:
        sys.exit(f"no JSON line of --mode {mode}")
    if runs[mode]["ranks"] != np_:
        sys.exit(f"--mode {mode} ran on {runs[mode]['ranks']} ranks, not {np_}")
a, d = runs["auto"]["test_acc"], runs["dense"]["test_acc"]
print(f"test accuracy auto {100 * a:.2f} %, dense {100 * d:.2f} %, "
      f"bytes/step auto {runs['auto']['bytes_sent_per_step']:.0f}, dense {runs['dense']['bytes_sent_per_step']:.0f}")
if abs(a - d) > 0.01 + 1e-9:
    sys.exit(f"auto's test accuracy {100 * a:.2f} % is not within 1 point of dense's {100 * d:.2f} %")
EOF
  say "$what: $(cat "$out.check")"
}

# The job scripts' settings are this test's, whatever the caller's environment has.
unset GRADSYNC_DIR GRADSYNC_LAUNCHER GRADSYNC_SRUN_MPI GRADSYNC_SRUN_ARGS GRADSYNC_MPIRUN_ARGS \
  GRADSYNC_BIND GRADSYNC_CALIBRATE_ARGS GRADSYNC_TRAIN_ARGS GRADSYNC_TRAIN_MODES
export GRADSYNC_BIN="$BIN" GRADSYNC_PYTHON="$PY" GRADSYNC_PROFILE="$WORK/profile.json"
# train_digits.py's own defaults (a smaller model than the demo's: seconds).
export GRADSYNC_TRAIN_ARGS="--hidden 256 --steps 1500 --warmup 50"

# 1. Calibration, srun --mpi=pmix.
GRADSYNC_CALIBRATE_ARGS="--min-seconds 1 --reps 3 --max-bytes 256K --densities 0.001" \
  submit calibrate "$WORK/calibrate.out" hpc/slurm/calibrate.sbatch \
  || fail "calibrate.sbatch failed" "$WORK/calibrate.out.sbatch" "$WORK/calibrate.out"
check_ranks "$WORK/calibrate.out" "calibrate.sbatch (srun)"
"$BIN" predict --profile "$GRADSYNC_PROFILE" --elements 1000000 --ranks "$NP" --json >"$WORK/predict.json" 2>&1 \
  || fail "the profile does not load: gradsync predict --profile failed" "$WORK/predict.json" "$WORK/calibrate.out"
"$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["strategies"] and d["choice"], d; print(d["choice"])' \
  "$WORK/predict.json" >"$WORK/predict.txt" 2>&1 || fail "gradsync predict --profile printed no choice" "$WORK/predict.json"
say "profile valid: predict --elements 1000000 --ranks $NP chooses $(cat "$WORK/predict.txt")"

# 2. Training, auto and dense, srun.
submit train-srun "$WORK/train-srun.out" hpc/slurm/train.sbatch \
  || fail "train.sbatch (srun) failed" "$WORK/train-srun.out.sbatch" "$WORK/train-srun.out"
check_ranks "$WORK/train-srun.out" "train.sbatch (srun)"
check_train "$WORK/train-srun.out" "train.sbatch (srun)"

# 3. The same with mpirun inside the allocation.
GRADSYNC_LAUNCHER=mpirun submit train-mpirun "$WORK/train-mpirun.out" hpc/slurm/train.sbatch \
  || fail "train.sbatch (GRADSYNC_LAUNCHER=mpirun) failed" "$WORK/train-mpirun.out.sbatch" "$WORK/train-mpirun.out"
grep -q "^gradsync job: mpirun " "$WORK/train-mpirun.out" || fail "train.sbatch did not use mpirun" "$WORK/train-mpirun.out"
check_ranks "$WORK/train-mpirun.out" "train.sbatch (mpirun)"
check_train "$WORK/train-mpirun.out" "train.sbatch (mpirun)"

# 4. srun directly (its own allocation): every collective against MPI.
t0=$SECONDS
rc=0
OMPI_MCA_btl=self,tcp OMPI_MCA_mpi_yield_when_idle=1 timeout "$JOB_TIMEOUT" \
  srun -n "$NP" --ntasks-per-node="$NP" --time=10 --mpi=pmix --kill-on-bad-exit=1 \
  "$BIN" verify --counts 0,1,p-1,p+1,1000 >"$WORK/verify.out" 2>&1 || rc=$?
[ "$rc" = 0 ] || fail "srun -n $NP --mpi=pmix gradsync verify exited $rc" "$WORK/verify.out"
n_ok="$(grep -c '^ok ' "$WORK/verify.out" || true)"
[ "$n_ok" -gt 0 ] || fail "gradsync verify under srun checked nothing" "$WORK/verify.out"
say "srun -n $NP --mpi=pmix gradsync verify: $n_ok cases ok, $((SECONDS - t0)) s"

# 5. A failing job is a failing sbatch --wait (and says why).
if GRADSYNC_PROFILE="$WORK/no-such-profile.json" submit no-profile "$WORK/no-profile.out" hpc/slurm/train.sbatch; then
  fail "train.sbatch without a profile succeeded" "$WORK/no-profile.out"
fi
grep -q "no profile at" "$WORK/no-profile.out" || fail "train.sbatch without a profile did not say why" "$WORK/no-profile.out"

# 6. Down, twice, and nothing left running.
hpc/slurm-local.sh down >>"$WORK/down.log" 2>&1 || fail "down failed" "$WORK/down.log"
hpc/slurm-local.sh down >>"$WORK/down.log" 2>&1 || fail "a second down failed" "$WORK/down.log"
# (Zombies, waiting for init to reap them, are not running.)
left="$(ps -eo pid=,stat=,comm=,args= | awk -v before="$munged_before" '$2 ~ /^Z/ { next }
  $3 ~ /^(slurmctld|slurmd|slurmstepd)$/ || ($3 == "munged" && index(before, " " $1 " ") == 0)')"
[ -z "$left" ] || fail "still running after down: $left" "$WORK/down.log"
say "down: no slurmctld, slurmd, slurmstepd or munged of this test left"
say "passed in $((SECONDS - t_start)) s"
