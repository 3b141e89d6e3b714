#!/usr/bin/env bash
# mpirun with the flags this kind of machine needs: root permission flags when
# run as root, --oversubscribe when more ranks than cores are asked for.
#   hpc/mpirun.sh -np 4 target/release/gradsync bench --check
set -euo pipefail
np=1
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[$i]}" in
    -np|-n|--np|-c) np="${args[$((i + 1))]:-1}" ;;
  esac
done
extra=()
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
