#!/usr/bin/env bash
# A real one-node Slurm (Debian 12's slurm-wlm 22.05 and munge) on this
# machine, to try hpc/slurm/*.sbatch without a cluster (and for
# hpc/slurm_test.sh). Root, or a user with passwordless sudo.
#
#   GRADSYNC_SLURM_CPUS=4 hpc/slurm-local.sh up   # install what is missing, start munged, slurmctld, slurmd
#   export SLURM_CONF=/tmp/gradsync-slurm/etc/slurm.conf   # as `up` prints
#   sbatch -N 1 --wait hpc/slurm/calibrate.sbatch          # 1 node, 4 tasks
#   hpc/slurm-local.sh down     # cancel the jobs, stop the three daemons (idempotent)
#   hpc/slurm-local.sh status   # what runs; `env` prints the export line only
#
# Nothing outside the state folder is written except the packages and, if it
# is missing, the munge key /etc/munge/munge.key (owner munge, mode 400): the
# daemons use a slurm.conf, a munge socket and state, spool, log and pid
# files under $GRADSYNC_SLURM_DIR (default /tmp/gradsync-slurm); Slurm's
# commands find the configuration through SLURM_CONF, never /etc/slurm.
# Partition `local` (default) holds one node, `hostname -s`, with
# CPUs=$(nproc) or GRADSYNC_SLURM_CPUS: more than the machine has
# oversubscribes it, e.g. 4 for the job scripts' --ntasks-per-node=4 on 2
# cores (Slurm 22.05 refuses a --ntasks-per-node above the node's CPUs even
# with --overcommit; without --ntasks-per-node, `-n 8 --overcommit` works).
# `up` again is a no-op while the node is idle with the same configuration.
# `down` stops only the daemons whose pid files `up` wrote (a Slurm or
# munged of the system is left alone) and keeps the logs.
#
# Exit status 77: Slurm cannot run here (not root and no passwordless sudo,
# the packages cannot be installed, another Slurm runs here); the
# reason is printed. Other failures (a daemon that does not come up) exit 1
# with the end of its log. Environment: GRADSYNC_SLURM_DIR,
# GRADSYNC_SLURM_CPUS, GRADSYNC_SLURM_TIMEOUT (seconds to wait for the node,
# default 60).
set -euo pipefail

SKIP=77
# The daemons are in /usr/sbin, often not on a user's PATH.
PATH="$PATH:/usr/sbin:/sbin"
DIR="${GRADSYNC_SLURM_DIR:-/tmp/gradsync-slurm}"
CONF="$DIR/etc/slurm.conf"
MUNGE_DIR="$DIR/munge"
SOCKET="$MUNGE_DIR/munge.socket"
RUN="$DIR/run"
LOG="$DIR/log"
KEY=/etc/munge/munge.key
TIMEOUT="${GRADSYNC_SLURM_TIMEOUT:-60}"
NODE="$(hostname -s)"
CPUS="${GRADSYNC_SLURM_CPUS:-$(nproc)}"
export SLURM_CONF="$CONF"

say() { echo "slurm-local.sh: $*" >&2; }
skip() { say "cannot run Slurm here: $*"; exit "$SKIP"; }
die() { say "$*"; exit 1; }

# Root, or passwordless sudo (daemons, packages and the munge key need root).
privileges() {
  SUDO=()
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || return 1
    sudo -n true 2>/dev/null || return 1
    SUDO=(sudo -n)
  fi
}
as_root() { "${SUDO[@]}" "$@"; }

# Whether process PID runs (a zombie does not: one whose parent has exited
# waits for init to reap it, which can take a while in a container).
alive() {
  local st
  st="$(ps -o stat= -p "$1" 2>/dev/null)" || return 1
  [ -n "$st" ] && [ "${st:0:1}" != Z ]
}

# Pids of the running (not zombie) processes named NAME.
running() { ps -eo pid=,stat=,comm= | awk -v n="$1" '$3 == n && $2 !~ /^Z/ { print $1 }'; }

# The pid in FILE if that process runs and is NAME (a reused pid is not ours).
live_pid() {
  local file="$1" name="$2" pid
  [ -r "$file" ] || return 1
  pid="$(tr -dc '0-9' <"$file")"
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] && alive "$pid" || return 1
  echo "$pid"
}

# Stop the daemon NAME whose pid is in FILE: TERM, up to 15 s, then KILL.
stop_daemon() {
  local file="$1" name="$2" pid i
  if pid="$(live_pid "$file" "$name")"; then
    as_root kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 150; i++)); do
      alive "$pid" || break
      sleep 0.1
    done
    if alive "$pid"; then
      say "$name (pid $pid) ignored SIGTERM for 15 s: SIGKILL"
      as_root kill -KILL "$pid" 2>/dev/null || true
      sleep 0.2
    fi
    say "stopped $name (pid $pid)"
  fi
  as_root rm -f "$file"
}

log_tail() {
  local f
  for f in "$@"; do
    [ -r "$f" ] || continue
    echo "---- last lines of $f ----" >&2
    tail -n 25 "$f" >&2
  done
}

install_packages() {
  local need=() t0 apt_log
  command -v slurmctld >/dev/null 2>&1 || need+=(slurmctld)
  command -v slurmd >/dev/null 2>&1 || need+=(slurmd)
  command -v sbatch >/dev/null 2>&1 || need+=(slurm-client)
  command -v munged >/dev/null 2>&1 || need+=(munge)
  [ ${#need[@]} -gt 0 ] || return 0
  command -v apt-get >/dev/null 2>&1 || skip "${need[*]} missing and no apt-get to install slurm-wlm munge"
  say "installing slurm-wlm munge (missing: ${need[*]})"
  t0=$SECONDS
  apt_log="$(mktemp)"
  # Without recommends: 7 packages, about 4 MB (with them, 38 packages).
  as_root apt-get update -qq >"$apt_log" 2>&1 || { log_tail "$apt_log"; skip "apt-get update failed"; }
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    slurm-wlm munge >"$apt_log" 2>&1 || { log_tail "$apt_log"; skip "apt-get install slurm-wlm munge failed"; }
  rm -f "$apt_log"
  say "installed slurm-wlm munge in $((SECONDS - t0)) s"
  if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    skip "slurm-wlm installed but slurmctld or munged not on PATH"
  fi
}

# The munge key (created if missing) and our own munged, as user munge, on a
# socket in the state folder (a munged of the system keeps its own).
start_munge() {
  local i
  id munge >/dev/null 2>&1 || die "no user munge (is the munge package installed?)"
  if ! as_root test -s "$KEY"; then
    say "creating the munge key $KEY"
    as_root install -d -o munge -g munge -m 0700 /etc/munge
    if command -v mungekey >/dev/null 2>&1; then
      as_root mungekey --create --keyfile="$KEY"
    else
      as_root dd if=/dev/urandom of="$KEY" bs=1024 count=1 status=none
    fi
  fi
  as_root chown munge:munge "$KEY"
  as_root chmod 400 "$KEY"
  if live_pid "$MUNGE_DIR/munged.pid" munged >/dev/null; then
    return 0
  fi
  as_root install -d -o munge -g munge -m 0755 "$MUNGE_DIR"
  as_root rm -f "$SOCKET" "$SOCKET.lock"
  as_root runuser -u munge -- munged --key-file="$KEY" --socket="$SOCKET" \
    --pid-file="$MUNGE_DIR/munged.pid" --log-file="$MUNGE_DIR/munged.log" \
    --seed-file="$MUNGE_DIR/munged.seed" </dev/null >/dev/null 2>&1 \
    || { log_tail "$MUNGE_DIR/munged.log"; die "munged did not start"; }
  for ((i = 0; i < 50; i++)); do
    if munge -n --socket="$SOCKET" 2>/dev/null | unmunge --socket="$SOCKET" >/dev/null 2>&1; then
      say "munged up (pid $(live_pid "$MUNGE_DIR/munged.pid" munged || echo '?'), socket $SOCKET)"
      return 0
    fi
    sleep 0.1
  done
  log_tail "$MUNGE_DIR/munged.log"
  die "munged does not answer on $SOCKET"
}

# The configuration into FILE.
write_conf() {
  local file="$1" overrides=""
  # More CPUs than the machine has: slurmd must take the configured count.
  [ "$CPUS" -le "$(nproc)" ] || overrides="SlurmdParameters=config_overrides"
  mkdir -p "$DIR/etc"
  cat >"$file" <<EOF
# Written by hpc/slurm-local.sh: a one-node Slurm for trying gradsync's job
# scripts. Every path is under $DIR; clients need SLURM_CONF=$CONF.
ClusterName=gradsync-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCKET
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
ReturnToService=2
MailProg=/bin/true
InactiveLimit=0
KillWait=5
# sbatch --wait polls after 2 s, then every 8 s, then every 32 s, unless
# MinJobAge/2 <= 2 s: then every 2 s (with 60, a 1 s job took 10 s and a
# 12 s job 42 s). Ended jobs leave scontrol show job after MinJobAge.
MinJobAge=5
SlurmctldTimeout=30
SlurmdTimeout=60
Waittime=0
$overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

node_state() { sinfo -h -N -n "$NODE" -o '%t' 2>/dev/null | head -n 1; }

cmd_up() {
  local pid state i
  privileges || skip "needs root or passwordless sudo (it installs packages and starts root daemons)"
  install_packages
  say "$(slurmctld -V 2>/dev/null || echo "slurm (unknown version)"), state folder $DIR"
  [[ "$CPUS" =~ ^[1-9][0-9]*$ ]] || die "GRADSYNC_SLURM_CPUS=$CPUS is not a CPU count"
  mkdir -p "$DIR/etc"
  write_conf "$CONF.new"
  if live_pid "$RUN/slurmctld.pid" slurmctld >/dev/null && live_pid "$RUN/slurmd.pid" slurmd >/dev/null \
    && cmp -s "$CONF.new" "$CONF" && [ "$(node_state)" = idle ]; then
    rm -f "$CONF.new"
    say "already up (node $NODE idle)"
    echo "export SLURM_CONF=$CONF"
    return 0
  fi
  # Half up (a daemon died) or another configuration: start clean.
  stop_daemon "$RUN/slurmd.pid" slurmd
  stop_daemon "$RUN/slurmctld.pid" slurmctld
  # Another Slurm (of the system, or of another state folder) holds the ports.
  for pid in $(running slurmctld) $(running slurmd); do
    skip "another $(cat "/proc/$pid/comm" 2>/dev/null) runs (pid $pid, not from $DIR); stop it first (hpc/slurm-local.sh down, with its GRADSYNC_SLURM_DIR, if it is one of these)"
  done
  start_munge
  mkdir -p "$DIR/state" "$DIR/spool" "$RUN" "$LOG"
  mv "$CONF.new" "$CONF"
  : >"$LOG/slurmctld.log"
  : >"$LOG/slurmd.log"
  # -c: no state from an earlier `up` (jobs, node states).
  as_root env SLURM_CONF="$CONF" slurmctld -c -f "$CONF" </dev/null >>"$LOG/slurmctld.log" 2>&1 \
    || { log_tail "$LOG/slurmctld.log"; die "slurmctld did not start"; }
  as_root env SLURM_CONF="$CONF" slurmd -f "$CONF" </dev/null >>"$LOG/slurmd.log" 2>&1 \
    || { log_tail "$LOG/slurmd.log"; die "slurmd did not start"; }
  for ((i = 0; i < TIMEOUT * 2; i++)); do
    state="$(node_state || true)"
    if [ "$state" = idle ]; then
      say "up: slurmctld pid $(live_pid "$RUN/slurmctld.pid" slurmctld), slurmd pid $(live_pid "$RUN/slurmd.pid" slurmd), node $NODE idle ($CPUS CPUs$([ "$CPUS" -le "$(nproc)" ] || echo ", $(nproc) real")), partition local, after $((i / 2)) s"
      say "logs in $LOG; stop with: hpc/slurm-local.sh down"
      echo "export SLURM_CONF=$CONF"
      return 0
    fi
    for pid in slurmctld slurmd; do
      live_pid "$RUN/$pid.pid" "$pid" >/dev/null || {
        sleep 1
        live_pid "$RUN/$pid.pid" "$pid" >/dev/null || {
          log_tail "$LOG/$pid.log"
          die "$pid exited (node state: ${state:-unknown})"
        }
      }
    done
    sleep 0.5
  done
  log_tail "$LOG/slurmctld.log" "$LOG/slurmd.log"
  sinfo -N -l >&2 || true
  die "node $NODE not idle after ${TIMEOUT} s (state: ${state:-no answer from slurmctld})"
}

cmd_down() {
  local i pid left
  if ! privileges; then
    # Nothing of ours can run without root; say so if something does.
    left="$(live_pid "$RUN/slurmctld.pid" slurmctld || true)$(live_pid "$RUN/slurmd.pid" slurmd || true)$(live_pid "$MUNGE_DIR/munged.pid" munged || true)"
    [ -z "$left" ] || die "daemons run but this user cannot stop them (not root, no passwordless sudo)"
    return 0
  fi
  # Cancel the jobs first, so no slurmstepd outlives slurmd.
  if live_pid "$RUN/slurmctld.pid" slurmctld >/dev/null && command -v scancel >/dev/null 2>&1; then
    as_root env SLURM_CONF="$CONF" scancel --full --partition=local 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
      [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.2
    done
  fi
  stop_daemon "$RUN/slurmd.pid" slurmd
  stop_daemon "$RUN/slurmctld.pid" slurmctld
  # A step daemon whose slurmd is gone (no other slurmd runs): ours.
  if [ -z "$(running slurmd)" ]; then
    for pid in $(running slurmstepd); do
      say "killing an orphaned slurmstepd (pid $pid)"
      as_root kill -KILL "$pid" 2>/dev/null || true
    done
  fi
  stop_daemon "$MUNGE_DIR/munged.pid" munged
  as_root rm -f "$SOCKET" "$SOCKET.lock"
  say "down (state and logs kept in $DIR)"
}

cmd_status() {
  local name file pid rc=0
  for name in munged slurmctld slurmd; do
    file="$RUN/$name.pid"
    [ "$name" = munged ] && file="$MUNGE_DIR/munged.pid"
    if pid="$(live_pid "$file" "$name")"; then
      echo "$name: running (pid $pid)"
    else
      echo "$name: not running"
      rc=3
    fi
  done
  if [ "$rc" -eq 0 ]; then
    sinfo -N -n "$NODE" || rc=3
    echo "export SLURM_CONF=$CONF"
  fi
  return "$rc"
}

case "${1:-}" in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  -h|--help|help) sed -n '2,/^set -euo/p' "$0" | sed '$d' ;;
  *) echo "usage: $0 up|down|status|env" >&2; exit 2 ;;
esac
