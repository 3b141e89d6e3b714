# shellcheck shell=bash
# Sourced by hpc/slurm/calibrate.sbatch and train.sbatch (not a job script):
# the settings both share and `gradsync_launch CMD ARGS...`, which runs CMD
# as one MPI rank per Slurm task of the allocation.
#
#   GRADSYNC_LAUNCHER  srun (default: `srun --mpi=pmix`, Slurm starts the
#                      ranks) or mpirun (Open MPI's mpirun inside the
#                      allocation; it reads the allocation from Slurm)
#   GRADSYNC_SRUN_MPI  srun's --mpi plugin (default pmix; `srun --mpi=list`)
#   GRADSYNC_SRUN_ARGS, GRADSYNC_MPIRUN_ARGS   extra launcher flags (split on spaces)
#   GRADSYNC_BIND      mpirun's --bind-to (default none, as hpc/mpirun.sh)
#   GRADSYNC_BIN       the gradsync binary (default target/release/gradsync)
#   GRADSYNC_PROFILE   the cluster profile (default profiles/$SLURM_CLUSTER_NAME.json)
#
# Every rank prints one line first (rank, local rank, host), from Slurm's
# SLURM_PROCID/SLURM_LOCALID under srun and Open MPI's
# OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_LOCAL_RANK under mpirun.

GRADSYNC_LAUNCHER="${GRADSYNC_LAUNCHER:-srun}"
GRADSYNC_BIN="${GRADSYNC_BIN:-target/release/gradsync}"
GRADSYNC_PROFILE="${GRADSYNC_PROFILE:-profiles/${SLURM_CLUSTER_NAME:-cluster}.json}"

gradsync_fail() {
  echo "gradsync job: $*" >&2
  exit 1
}

case "$GRADSYNC_LAUNCHER" in
  srun|mpirun) ;;
  *) gradsync_fail "GRADSYNC_LAUNCHER=$GRADSYNC_LAUNCHER: use srun or mpirun" ;;
esac
command -v "$GRADSYNC_LAUNCHER" >/dev/null 2>&1 || gradsync_fail "$GRADSYNC_LAUNCHER not found on $(hostname -s)"

# More ranks than cores on a node (a laptop, hpc/slurm-local.sh): ranks
# that spin while waiting starve the peers they wait for, and shared memory
# crawls when ranks are descheduled. Ranks yield when idle and use TCP over
# loopback (as hpc/mpirun.sh; mpirun --oversubscribe alone yields, srun's
# ranks do not know: a small calibration took 42 s instead of 10 s on 2
# cores). Correctness runs only, not timings.
# SLURM_TASKS_PER_NODE is e.g. "2(x3),1": the most tasks any node runs
# (the first entry alone missed "1,4"); a value it cannot read counts as 1.
_gradsync_tasks_here=1
IFS=, read -ra _gradsync_entries <<<"${SLURM_TASKS_PER_NODE:-1}"
for _gradsync_e in "${_gradsync_entries[@]}"; do
  _gradsync_e="${_gradsync_e%%(*}"
  if [[ "$_gradsync_e" =~ ^[1-9][0-9]{0,5}$ ]] && [ "$_gradsync_e" -gt "$_gradsync_tasks_here" ]; then
    _gradsync_tasks_here="$_gradsync_e"
  fi
done
GRADSYNC_OVERSUBSCRIBED=0
if [ "$_gradsync_tasks_here" -gt "$(nproc)" ]; then
  GRADSYNC_OVERSUBSCRIBED=1
  export OMPI_MCA_btl="${OMPI_MCA_btl:-self,tcp}" OMPI_MCA_mpi_yield_when_idle="${OMPI_MCA_mpi_yield_when_idle:-1}"
fi

# Open MPI over TCP (Ethernet clusters): a large message goes as one put of
# up to 2 GiB, and the opposite direction's control messages wait behind
# it, so two-way exchanges sometimes run one way at a time (hpc/cluster.sh
# says what was measured). 128 KiB fragments keep both ways moving; other
# transports ignore the setting.
export OMPI_MCA_btl_tcp_rdma_pipeline_frag_size="${OMPI_MCA_btl_tcp_rdma_pipeline_frag_size:-131072}"

_gradsync_note=""
[ "$GRADSYNC_OVERSUBSCRIBED" = 0 ] \
  || _gradsync_note="; $_gradsync_tasks_here tasks on $(nproc) cores: oversubscribed, OMPI_MCA_btl=$OMPI_MCA_btl"
echo "gradsync job ${SLURM_JOB_ID:-?} (${SLURM_JOB_NAME:-?}) on cluster ${SLURM_CLUSTER_NAME:-?}:" \
  "${SLURM_NTASKS:-?} tasks on ${SLURM_JOB_NUM_NODES:-?} node(s) (${SLURM_JOB_NODELIST:-?})," \
  "launcher $GRADSYNC_LAUNCHER, working directory $PWD$_gradsync_note"

# One line per rank, then the command itself (exec: same process, same rank).
# shellcheck disable=SC2016 # expanded by each rank's shell
_GRADSYNC_PROLOGUE='echo "gradsync: rank ${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${SLURM_PROCID:-?}}} of ${OMPI_COMM_WORLD_SIZE:-${PMI_SIZE:-${SLURM_NTASKS:-?}}}, local rank ${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-${SLURM_LOCALID:-?}}}, on $(hostname -s): ${1##*/}"; exec "$@"'

gradsync_launch() {
  local cmd=() extra=()
  if [ "$GRADSYNC_LAUNCHER" = srun ]; then
    # shellcheck disable=SC2206 # deliberately split on spaces
    extra=(${GRADSYNC_SRUN_ARGS:-})
    cmd=(srun --mpi="${GRADSYNC_SRUN_MPI:-pmix}" --kill-on-bad-exit=1 "${extra[@]}")
  else
    # shellcheck disable=SC2206
    extra=(${GRADSYNC_MPIRUN_ARGS:-})
    cmd=(mpirun -np "${SLURM_NTASKS:?not inside a Slurm allocation}")
    # Open MPI's flags; MPICH's Hydra runs as root, oversubscribes and
    # binds nothing by default (docs/running.md#mpich).
    local version
    version="$(mpirun --version 2>&1 || true)"
    if [[ "$version" == *"Open MPI"* || "$version" == *OpenRTE* ]]; then
      cmd+=(--bind-to "${GRADSYNC_BIND:-none}")
      [ "$(id -u)" -ne 0 ] || cmd+=(--allow-run-as-root)
      [ "$GRADSYNC_OVERSUBSCRIBED" = 0 ] || cmd+=(--oversubscribe)
    fi
    cmd+=("${extra[@]}")
  fi
  echo "gradsync job: ${cmd[*]} $*"
  "${cmd[@]}" bash -c "$_GRADSYNC_PROLOGUE" gradsync-rank "$@"
}
