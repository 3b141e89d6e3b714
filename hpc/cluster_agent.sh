#!/usr/bin/env bash
# Open MPI's remote-shell agent for hpc/cluster.sh (`--mca plm_rsh_agent`).
# mpirun calls it as it would call ssh:
#
#   hpc/cluster_agent.sh <host> <command words...>
#
# <host> is an emulated host of hpc/cluster.sh: a network namespace of that
# name (gsh<pid>-<i>). The command runs there, in a new UTS namespace whose
# hostname is <host> (Open MPI tells nodes apart by their daemons' hostnames),
# through `sh -c` on the words joined by spaces, as ssh does. The environment
# is kept (unlike ssh). Needs root.
set -euo pipefail
[ $# -ge 2 ] || { echo "cluster_agent.sh: usage: $0 HOST COMMAND..." >&2; exit 2; }
host="$1"
shift
case "$host" in
  gsh[0-9]*-[0-9]*) ;;
  *) echo "cluster_agent.sh: '$host' is not a host of hpc/cluster.sh (gsh<pid>-<i>)" >&2; exit 2 ;;
esac
[ -e "/run/netns/$host" ] || { echo "cluster_agent.sh: no network namespace '$host'" >&2; exit 2; }
# shellcheck disable=SC2016 # $0 and $1 belong to the inner shell
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
