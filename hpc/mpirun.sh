#!/usr/bin/env bash
# mpirun with the flags this kind of machine needs: with Open MPI, root
# permission flags when run as root, no binding, --oversubscribe when more
# ranks than cores are asked for; MPICH's mpirun (Hydra) needs none of them
# and gets the command line as given.
#   hpc/mpirun.sh -np 4 target/release/gradsync bench --check
set -euo pipefail
# (The version text in a variable: `| grep -q` under pipefail would take a
# SIGPIPE of mpirun's for "not Open MPI".)
version="$(mpirun --version 2>&1 || true)"
case "$version" in
  *"Open MPI"* | *OpenRTE*) ;;
  *) exec mpirun "$@" ;;
esac
np=1
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    # The first count is mpirun's: a later -c or -n is the program's own
    # (sh -c '...').
    -np|-n|--np|-c) np="${args[$((i + 1))]:-1}" && break ;;
  esac
done
extra=()
# Open MPI binds each rank to a core by default. On these 2-vCPU VMs about
# half of the 2-rank jobs then ran 3.5x slower (1 MiB allreduce: 440 us instead
# of 125 us; measured 3 of 6 jobs), never with --bind-to none (6 of 6 fast).
# GRADSYNC_BIND=core (or anything mpirun accepts) restores binding.
case " $* " in
  *" --bind-to "*) ;;
  *) extra+=(--bind-to "${GRADSYNC_BIND:-none}") ;;
esac
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
if [ "$np" -gt "$(nproc)" ]; then
  extra+=(--oversubscribe)
  # Spinning shared-memory transfers crawl when peers are descheduled; TCP over
  # loopback is ~4x faster oversubscribed (correctness runs only).
  [ -n "${OMPI_MCA_btl:-}" ] || extra+=(--mca btl self,tcp)
  echo "hpc/mpirun.sh: $np ranks on $(nproc) cores: oversubscribed (timings are not performance figures)" >&2
fi
exec mpirun "${extra[@]}" "$@"
