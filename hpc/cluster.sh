#!/usr/bin/env bash
# Run one MPI job on an emulated cluster on this machine: H hosts, each a
# network namespace with its own hostname and one shaped link to a switch,
# R ranks per host. Ranks on one host talk over shared memory (vader), ranks on
# different hosts over TCP through their links. Always cleans up; exits with
# the command's status.
#
#   hpc/cluster.sh --hosts 2 --ranks-per-host 2 --link 1gbit [--delay 1ms] -- target/release/gradsync bench
#
# --hosts H           emulated hosts (namespaces gsh<pid>-0..H-1, hostnames the same,
#                     addresses 10.77.0.1..H on eth0, all on one bridge in gsh<pid>-sw)
# --ranks-per-host R  ranks on each host (mpirun -np H*R --map-by ppr:R:node)
# --link RATE         each host's link rate, both directions (tc tbf: 100mbit, 1gbit, 10gbit...)
# --delay D           one-way delay added to each host's outgoing traffic (tc netem: 1ms, 500us)
# --mtu N             the links' MTU (default 1500; 9000 = jumbo frames, fewer packets per byte)
# --                  then the program and its arguments (not mpirun)
#
# The command sees GRADSYNC_CLUSTER_HOSTS, GRADSYNC_CLUSTER_RANKS_PER_HOST,
# GRADSYNC_CLUSTER_LINK (as given) and GRADSYNC_CLUSTER_LINK_BPS (bits/s).
# Needs root (re-runs itself with `sudo -n` when that works; the ranks then run
# as root). More ranks than cores are oversubscribed: not performance figures.
set -euo pipefail
me="hpc/cluster.sh"
die() { echo "$me: $*" >&2; exit 2; }

hosts=""
rph=""
link=""
delay=""
mtu=1500
seen_dashdash=0
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts|--ranks-per-host|--link|--delay|--mtu)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in
        --hosts) hosts="$2" ;;
        --ranks-per-host) rph="$2" ;;
        --link) link="$2" ;;
        --delay) delay="$2" ;;
        --mtu) mtu="$2" ;;
      esac
      shift 2 ;;
    -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    --) seen_dashdash=1; shift; break ;;
    -*) die "unknown argument '$1' (flags: --hosts H --ranks-per-host R --link RATE [--delay D] [--mtu N] -- CMD...)" ;;
    *) die "missing '--' before the command ('$1'): $me --hosts H --ranks-per-host R --link RATE [--delay D] [--mtu N] -- CMD..." ;;
  esac
done
[ -n "$hosts" ] || die "--hosts H is required"
# No leading zeros: bash arithmetic reads 010 as octal (8 hosts for "010").
if ! [[ "$hosts" =~ ^[1-9][0-9]{0,2}$ ]] || [ "$hosts" -gt 250 ]; then
  die "--hosts must be an integer from 1 to 250 (got '$hosts')"
fi
[ -n "$rph" ] || die "--ranks-per-host R is required"
if ! [[ "$rph" =~ ^[1-9][0-9]{0,3}$ ]]; then
  die "--ranks-per-host must be an integer from 1 to 9999 (got '$rph')"
fi
[ -n "$link" ] || die "--link RATE is required (e.g. --link 1gbit)"
# The rate in bits/s (tc's units: bit, kbit, mbit, gbit, tbit; bps... are bytes/s).
link_bps="$(echo "$link" | awk '
  match(tolower($0), /^[0-9]+(\.[0-9]+)?/) {
    v = substr($0, 1, RLENGTH); u = tolower(substr($0, RLENGTH + 1))
    m["bit"] = 1; m["kbit"] = 1e3; m["mbit"] = 1e6; m["gbit"] = 1e9; m["tbit"] = 1e12
    m["bps"] = 8; m["kbps"] = 8e3; m["mbps"] = 8e6; m["gbps"] = 8e9; m["tbps"] = 8e12
    if (u in m && v * m[u] >= 8000) { printf "%.0f\n", v * m[u] }
  }')"
[ -n "$link_bps" ] || die "--link must be a rate such as 100mbit, 1gbit or 10gbit, at least 8kbit (got '$link')"
if [ -n "$delay" ]; then
  [[ "$delay" =~ ^[0-9]+(\.[0-9]+)?(s|ms|us)$ ]] || die "--delay must be a time such as 500us, 1ms or 0.1s (got '$delay')"
fi
if ! [[ "$mtu" =~ ^[0-9]+$ ]] || [ "$mtu" -lt 1280 ] || [ "$mtu" -gt 65535 ]; then
  die "--mtu must be an integer from 1280 to 65535 (got '$mtu')"
fi
[ "$seen_dashdash" = 1 ] || die "missing '--' before the command (usage: $me --hosts H --ranks-per-host R --link RATE [--delay D] [--mtu N] -- CMD...)"
[ $# -gt 0 ] || die "no command after '--'"

if [ "$(id -u)" -ne 0 ]; then
  sudo -n true 2>/dev/null || die "needs root or passwordless sudo (ip netns, tc)"
  exec sudo -n --preserve-env "$0" --hosts "$hosts" --ranks-per-host "$rph" --link "$link" ${delay:+--delay "$delay"} --mtu "$mtu" -- "$@"
fi
for tool in ip tc unshare mpirun; do
  command -v "$tool" >/dev/null || die "'$tool' not found"
done

here="$(cd "$(dirname "$0")" && pwd)"
agent="$here/cluster_agent.sh"
prefix="gsh$$"
sw="$prefix-sw"
namespaces=()
tmp=""
mpirun_pid=""

# shellcheck disable=SC2317 # called by the EXIT trap
cleanup() {
  local rc=$?
  trap - EXIT INT TERM HUP
  if [ -n "$mpirun_pid" ] && kill -0 "$mpirun_pid" 2>/dev/null; then
    kill -TERM "$mpirun_pid" 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$mpirun_pid" 2>/dev/null || break; sleep 0.3; done
  fi
  # Whatever still runs in the hosts (orted, ranks) is ours: stop it, then
  # delete the namespaces (that deletes the veths and the bridge with them).
  local ns pids
  for ns in "${namespaces[@]}"; do
    pids="$(ip netns pids "$ns" 2>/dev/null || true)"
    # shellcheck disable=SC2086 # one pid per word
    [ -z "$pids" ] || kill -TERM $pids 2>/dev/null || true
  done
  local left
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    left=""
    for ns in "${namespaces[@]}"; do left+="$(ip netns pids "$ns" 2>/dev/null || true)"; done
    [ -n "$left" ] || break
    sleep 0.2
  done
  for ns in "${namespaces[@]}"; do
    pids="$(ip netns pids "$ns" 2>/dev/null || true)"
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  [ -z "$tmp" ] || rm -rf "$tmp"
  # Open MPI's session folders and shared-memory segments of the emulated
  # hosts (named after them), left behind when the job was killed.
  rm -rf "${TMPDIR:-/tmp}/ompi.$prefix-"* /dev/shm/vader_segment."$prefix-"*
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
trap 'exit 129' HUP

tmp="$(mktemp -d "/tmp/$prefix.XXXXXX")"

# tbf: a bucket of 2 ms at the rate (at least 32 KiB, beyond a 1500-byte
# frame), queue of 10 ms; netem delay (host side only) as the parent.
burst=$((link_bps / 8 / 500))
[ "$burst" -ge 32768 ] || burst=32768
shape() { # namespace device with-delay
  if [ "$3" = 1 ] && [ -n "$delay" ]; then
    tc -n "$1" qdisc add dev "$2" root handle 1: netem delay "$delay" limit 100000
    tc -n "$1" qdisc add dev "$2" parent 1: handle 2: tbf rate "$link" burst "$burst" latency 10ms
  else
    tc -n "$1" qdisc add dev "$2" root tbf rate "$link" burst "$burst" latency 10ms
  fi
}

namespaces+=("$sw")
ip netns add "$sw"
ip -n "$sw" link set lo up
if [ -n "$delay" ] && ! tc -n "$sw" qdisc add dev lo root netem delay "$delay" 2>/dev/null; then
  die "--delay needs tc's netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); run without --delay"
fi
[ -z "$delay" ] || tc -n "$sw" qdisc del dev lo root
ip -n "$sw" link add br0 type bridge
ip -n "$sw" link set br0 up
for ((i = 0; i < hosts; i++)); do
  ns="$prefix-$i"
  namespaces+=("$ns")
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  ip -n "$sw" link add "p$i" type veth peer name eth0 netns "$ns"
  ip -n "$sw" link set "p$i" master br0 up
  ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
  ip -n "$ns" link set eth0 mtu "$mtu" up
  ip -n "$sw" link set "p$i" mtu "$mtu"
  shape "$ns" eth0 1     # host -> switch
  shape "$sw" "p$i" 0    # switch -> host
  echo "$ns slots=$rph" >>"$tmp/hostfile"
done

np=$((hosts * rph))
extra=()
if [ "$rph" -gt "$(nproc)" ] || [ "$np" -gt "$(nproc)" ]; then
  # Every emulated host shares this machine's cores: let idle ranks yield.
  extra+=(--mca mpi_yield_when_idle 1)
  over=" ($np ranks on $(nproc) cores: oversubscribed, timings are not performance figures)"
fi
echo "$me: $hosts hosts x $rph ranks per host ($prefix-0..$((hosts - 1)), 10.77.0.1-$hosts), each host's link $link both ways${delay:+, one-way delay $delay}, MTU $mtu; shared memory within a host, TCP between hosts${over:-}" >&2

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# Open MPI's TCP BTL sends a large message as one put of up to 2 GiB
# (btl_tcp_rdma_pipeline_frag_size); the control messages of the opposite
# direction on the same connection queue behind it, so a two-way exchange
# (MPI_Sendrecv, Rabenseifner's steps) sometimes runs one direction after
# the other: 2 x 2 ranks, 32 MiB each way, took 560, 835 or 1100 ms by
# chance, per job. Fragments of 128 KiB keep both directions moving (560 ms
# in every job); raw TCP on these links runs both ways at once.
export OMPI_MCA_btl_tcp_rdma_pipeline_frag_size="${OMPI_MCA_btl_tcp_rdma_pipeline_frag_size:-131072}"
export GRADSYNC_CLUSTER_HOSTS="$hosts" GRADSYNC_CLUSTER_RANKS_PER_HOST="$rph"
export GRADSYNC_CLUSTER_LINK="$link" GRADSYNC_CLUSTER_LINK_BPS="$link_bps"
# mpirun runs on host 0 (its ranks are mpirun's children); the other hosts'
# daemons are started through the agent, one per host, directly by mpirun.
# In the background so that a signal runs the cleanup at once; <&0 keeps
# stdin (mpirun forwards it to rank 0), which a background job would lose.
# shellcheck disable=SC2016 # $0 belongs to the inner shell
ip netns exec "$prefix-0" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$prefix-0" \
  mpirun --hostfile "$tmp/hostfile" -np "$np" --map-by "ppr:$rph:node" --bind-to none --oversubscribe \
  --mca plm_rsh_agent "$agent" --mca plm_rsh_no_tree_spawn 1 \
  --mca pml ob1 --mca btl self,vader,tcp \
  --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
  "${extra[@]}" "$@" <&0 &
mpirun_pid=$!
rc=0
wait "$mpirun_pid" || rc=$?
mpirun_pid=""
exit "$rc"
