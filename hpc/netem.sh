#!/usr/bin/env bash
# Run a command with every MPI rank inside a temporary network namespace whose
# loopback is shaped to an emulated slow network; MPI is forced onto TCP over
# that loopback (shared memory would hide the network). Always cleans up.
#
#   hpc/netem.sh [--rate 1gbit] [--delay 0ms] [--loss 0%] -- hpc/mpirun.sh -np 2 target/release/gradsync bench
#
# All ranks share one shaped loopback: this models a shared fabric of the given
# rate, not per-link bandwidth. Needs root (or sudo) for `ip netns` and `tc`.
set -euo pipefail
rate=1gbit
delay=""
loss=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rate) rate="$2"; shift 2 ;;
    --delay) delay="$2"; shift 2 ;;
    --loss) loss="$2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $0 [--rate R] [--delay D] [--loss L] -- command..." >&2; exit 2; }

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
ns="gradsync$$"
cleanup() { $SUDO ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT INT TERM HUP

$SUDO ip netns add "$ns"
$SUDO ip netns exec "$ns" ip link set lo up
if [ -n "$delay" ] || [ -n "$loss" ]; then
  netem=(netem)
  [ -n "$delay" ] && netem+=(delay "$delay")
  [ -n "$loss" ] && netem+=(loss "$loss")
  $SUDO ip netns exec "$ns" tc qdisc add dev lo root handle 1: "${netem[@]}"
  $SUDO ip netns exec "$ns" tc qdisc add dev lo parent 1: handle 2: tbf rate "$rate" burst 256kb latency 10ms
else
  $SUDO ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst 256kb latency 10ms
fi
echo "hpc/netem.sh: namespace $ns, loopback shaped: rate $rate${delay:+ delay $delay}${loss:+ loss $loss}" >&2

# Force the ob1 PML with the TCP BTL on the shaped loopback (no UCX, no shared memory).
envs=(OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,self OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo)
if [ "$(id -u)" -eq 0 ]; then
  envs+=(OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1)
  ip netns exec "$ns" env "${envs[@]}" "$@"
else
  # Enter the namespace as root, then drop back to the calling user.
  sudo ip netns exec "$ns" sudo -u "$(id -un)" env PATH="$PATH" HOME="$HOME" "${envs[@]}" "$@"
fi
