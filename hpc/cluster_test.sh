#!/usr/bin/env bash
# The emulated cluster's tests, run by hpc/test.sh, under a minute:
#
#   1. hpc/cluster.sh names the flag on bad arguments (no root needed);
#   2. 2 hosts x 2 ranks, 100mbit: hpc/cluster_check.py (hostnames, ppr
#      mapping, MPI_COMM_TYPE_SHARED = the ranks of a host, the rate between
#      hosts within 10 % of the link one way in each direction, at least
#      60 % of it each way with both ways at once (Open MPI's TCP fragments,
#      hpc/cluster.sh), shared memory within a host);
#   3. 3 hosts x 1 rank, 100mbit: the same, plus two hosts sending to one at
#      once (the incoming side of a link is shaped too);
#   4. 2 hosts x 1 rank, 1gbit, MTU 9000: the rate within 25 % (CPU-bound here);
#   5. with --delay where the kernel has netem (skipped with the reason if not);
#   6. `gradsync bench --check` on 2 x 2, and the node-aware allgatherv on
#      3 x 2 and 2 x 2 (when target/release/gradsync exists);
#      the node-aware allreduce (3 x 2, 4 x 1, 2 x 2) and the sparse
#      allreduces, hierarchical and flat (2 x 2, 3 x 2, 4 x 1), against
#      MPI_Allreduce (when the examples are built);
#   7. a failing command's status comes back, and after every run no namespace
#      or Open MPI daemon of that run is left.
#
# Where namespaces cannot be made (not root and no passwordless sudo, no
# `ip netns`), or the Python has no mpi4py, it prints
# "cluster_test.sh: SKIPPED: <reason>" and exits 0; GRADSYNC_REQUIRE_CLUSTER=1
# makes that a failure. Uses GRADSYNC_PYTHON (default .venv/bin/python) and
# GRADSYNC_BIN (default target/release/gradsync).
set -euo pipefail
cd "$(dirname "$0")/.."
t_start=$SECONDS
PY="${GRADSYNC_PYTHON:-$PWD/.venv/bin/python}"
BIN="${GRADSYNC_BIN:-$PWD/target/release/gradsync}"
WORK="$(mktemp -d /tmp/gradsync-cluster-test.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

say() { echo "cluster_test.sh: $*"; }
fail() {
  echo "cluster_test.sh: FAILED: $1" >&2
  [ -z "${2:-}" ] || { echo "---- output ----" >&2; tail -n 40 "$2" >&2; }
  exit 1
}
skip() {
  if [ "${GRADSYNC_REQUIRE_CLUSTER:-0}" = 1 ]; then fail "cannot run (GRADSYNC_REQUIRE_CLUSTER=1): $1"; fi
  say "SKIPPED: $1"
  exit 0
}

# 1. Bad flags: exit 2 and a message naming the flag.
bad() { # expected-words... -- args...
  local want=() out rc=0
  while [ "$1" != "--" ]; do want+=("$1"); shift; done
  shift
  out="$(hpc/cluster.sh "$@" 2>&1)" || rc=$?
  [ "$rc" = 2 ] || fail "hpc/cluster.sh $* exited $rc, not 2: $out"
  for w in "${want[@]}"; do
    grep -qF -- "$w" <<<"$out" || fail "hpc/cluster.sh $*: '$out' does not name '$w'"
  done
}
bad --hosts -- --hosts 0 --ranks-per-host 1 --link 1gbit -- true
bad --ranks-per-host -- --hosts 2 --ranks-per-host 0 --link 1gbit -- true
# Leading zeros were read as octal (010 hosts built 8), huge counts wrapped.
bad --hosts -- --hosts 010 --ranks-per-host 1 --link 1gbit -- true
bad --ranks-per-host -- --hosts 2 --ranks-per-host 08 --link 1gbit -- true
bad --ranks-per-host -- --hosts 2 --ranks-per-host 99999999999999999999999 --link 1gbit -- true
bad --link -- --hosts 2 --ranks-per-host 1 -- true
bad --link -- --hosts 2 --ranks-per-host 1 --link fast -- true
bad "'--'" -- --hosts 2 --ranks-per-host 1 --link 1gbit true
bad "'--'" -- --hosts 2 --ranks-per-host 1 --link 1gbit
bad --delay -- --hosts 2 --ranks-per-host 1 --link 1gbit --delay soon -- true
bad --mtu -- --hosts 2 --ranks-per-host 1 --link 1gbit --mtu 9 -- true
say "bad flags: exit 2 naming the flag (8 cases)"

# Can this machine make namespaces?
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  sudo -n true 2>/dev/null || skip "not root and no passwordless sudo (hpc/cluster.sh needs ip netns and tc)"
  SUDO="sudo -n"
fi
probe="gshprobe$$"
$SUDO ip netns add "$probe" 2>/dev/null || skip "cannot create a network namespace (ip netns add)"
$SUDO ip netns del "$probe"
"$PY" -c "import mpi4py, numpy" 2>/dev/null || skip "$PY has no mpi4py and numpy (hpc/setup.sh installs them)"

# One run of hpc/cluster.sh: output in $WORK/<name>.log, its status in $run_rc;
# afterwards nothing of it may be left (its namespaces, its daemons).
run() { # name cluster-args... -- command...
  local name="$1" prefix
  shift
  run_rc=0
  timeout 60 hpc/cluster.sh "$@" >"$WORK/$name.log" 2>&1 || run_rc=$?
  prefix="$(grep -o 'gsh[0-9]*-0\.\.' "$WORK/$name.log" | head -n 1 | sed 's/-0\.\.$//')" || true
  [ -n "$prefix" ] || fail "$name: hpc/cluster.sh printed no cluster line" "$WORK/$name.log"
  if $SUDO ip netns list | grep -q "^$prefix-"; then
    fail "$name: namespaces left: $($SUDO ip netns list | grep "^$prefix-" | tr '\n' ' ')"
  fi
  # Its mpirun (--hostfile /tmp/gsh<pid>.*) and daemons (node regex gsh[w:<pid>]-...).
  local pat="hostfile /tmp/$prefix\.|orte_node_regex gsh\[[0-9]+:${prefix#gsh}\]"
  if pgrep -f "$pat" >/dev/null; then
    sleep 2 # daemons already killed may still be exiting
    ! pgrep -f "$pat" >/dev/null || fail "$name: mpirun or Open MPI daemons of $prefix left: $(pgrep -af "$pat")"
  fi
}
check() { # name cluster-args... -- check-args...
  local name="$1" args=()
  shift
  while [ "$1" != "--" ]; do args+=("$1"); shift; done
  shift
  run "$name" "${args[@]}" -- "$PY" hpc/cluster_check.py "$@"
  [ "$run_rc" = 0 ] || fail "$name: cluster_check.py failed (exit $run_rc)" "$WORK/$name.log"
  grep -q "all checks passed" "$WORK/$name.log" || fail "$name: no verdict" "$WORK/$name.log"
  say "$name: $(sed -n 's/^cluster_check: PASS \(.* MB\/s\)\( vs\| >=\).*/\1/p' "$WORK/$name.log" | paste -sd ';' | sed 's/;/; /g')"
}

# 2.-4.
check "2x2 100mbit" --hosts 2 --ranks-per-host 2 --link 100mbit -- --seconds 1
check "3x1 100mbit" --hosts 3 --ranks-per-host 1 --link 100mbit -- --seconds 1
# At 1 Gbit/s, TCP through veths and tbf costs real CPU: on a 2-core machine
# shared with other jobs it measured 107-119 MB/s of 125 (MTU 1500) and
# 114-117 (MTU 9000), so this case allows 25 %; the 10 % check is at 100mbit.
check "2x1 1gbit mtu 9000" --hosts 2 --ranks-per-host 1 --link 1gbit --mtu 9000 -- --seconds 0.5 --tolerance 0.25

# 5. Delay, where tc has netem.
probe_ns="gshprobe$$"
$SUDO ip netns add "$probe_ns"
if $SUDO ip netns exec "$probe_ns" tc qdisc add dev lo root netem delay 1ms 2>/dev/null; then
  $SUDO ip netns del "$probe_ns"
  check "2x1 100mbit delay 5ms" --hosts 2 --ranks-per-host 1 --link 100mbit --delay 5ms -- --seconds 1 --delay-ms 5
else
  $SUDO ip netns del "$probe_ns"
  say "--delay: skipped, this kernel's tc has no netem (CONFIG_NET_SCH_NETEM)"
  bad netem -- --hosts 2 --ranks-per-host 1 --link 100mbit --delay 5ms -- true
fi

# 6. The real program on the cluster.
if [ -x "$BIN" ]; then
  run "bench 2x2" --hosts 2 --ranks-per-host 2 --link 1gbit -- "$BIN" bench --op allreduce --sizes 64K,1M --iters 3 --warmup 1 --check
  [ "$run_rc" = 0 ] || fail "gradsync bench --check on 2 x 2 exited $run_rc" "$WORK/bench 2x2.log"
  say "gradsync bench --op allreduce --check on 2 hosts x 2 ranks: passed"
  # The node-aware allgatherv (MPI's node map of the hosts) against
  # MPI_Allgatherv, and the flat one, on 3 x 2 and 2 x 2.
  for hr in "3 2" "2 2"; do
    read -r h r <<<"$hr"
    run "allgatherv ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$BIN" bench --op allgatherv --algo recdbl,node --sizes 1,64K,1M --iters 2 --warmup 1 --check --json
    log="$WORK/allgatherv ${h}x$r.log"
    [ "$run_rc" = 0 ] || fail "gradsync bench --op allgatherv --check on $h x $r exited $run_rc" "$log"
    oks=$(grep -c '"check":"ok"' "$log" || true)
    [ "$oks" = 6 ] || fail "allgatherv on $h x $r: $oks checks ok, not 6" "$log"
  done
  say "node-aware and flat allgatherv = MPI_Allgatherv on 3 x 2 and 2 x 2"
else
  say "gradsync bench on the cluster: skipped, no $BIN (cargo build --release)"
fi

# 6b. The node-aware allreduce against MPI_Allreduce with MPI's node map
# of the emulated hosts: 3 x 2, 4 x 1 and 2 x 2.
HIER="$(dirname "$BIN")/examples/hierarchical_check"
if [ -x "$HIER" ]; then
  for hr in "3 2 [0, 0, 2, 2, 4, 4]" "4 1 [0, 1, 2, 3]" "2 2 [0, 0, 2, 2]"; do
    read -r h r map <<<"$hr"
    run "hierarchical ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$HIER"
    log="$WORK/hierarchical ${h}x$r.log"
    [ "$run_rc" = 0 ] || fail "hierarchical_check on $h x $r exited $run_rc" "$log"
    grep -qxF "NODES $map" "$log" || fail "MPI's node map on $h x $r is not $map" "$log"
    oks=$(grep -c "^OK .* ranks=$((h * r))$" "$log" || true)
    [ "$oks" = $((53 * h * r)) ] || fail "hierarchical_check on $h x $r: $oks OK lines, not $((53 * h * r))" "$log"
  done
  say "hierarchical allreduce = MPI_Allreduce on 3 x 2, 4 x 1, 2 x 2 (MPI's node map of the hosts)"
else
  say "hierarchical allreduce on the cluster: skipped, no $HIER (cargo build --release --examples)"
fi

# 6c. The sparse allreduces against MPI_Allreduce on the cluster: the
# hierarchical one with MPI's node map of the hosts and emulated maps
# (75 cases a rank), the flat Ok-Topk one (60 cases a rank).
HSPARSE="$(dirname "$BIN")/examples/hierarchical_sparse_check"
FSPARSE="$(dirname "$BIN")/examples/sparse_allreduce_check"
if [ -x "$HSPARSE" ] && [ -x "$FSPARSE" ]; then
  for hr in "2 2 [0, 0, 2, 2]" "3 2 [0, 0, 2, 2, 4, 4]" "4 1 [0, 1, 2, 3]"; do
    read -r h r map <<<"$hr"
    np=$((h * r))
    for ex in "hierarchical_sparse_check 75" "sparse_allreduce_check 60"; do
      read -r name per <<<"$ex"
      run "$name ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$(dirname "$BIN")/examples/$name" sum
      log="$WORK/$name ${h}x$r.log"
      [ "$run_rc" = 0 ] || fail "$name sum on $h x $r exited $run_rc" "$log"
      ! grep -q "^FAIL" "$log" || fail "$name sum on $h x $r: a case failed" "$log"
      if [ "$name" = hierarchical_sparse_check ]; then
        grep -qxF "NODES $map" "$log" || fail "MPI's node map on $h x $r is not $map" "$log"
      fi
      oks=$(grep -c "^OK .* ranks=$np$" "$log" || true)
      [ "$oks" = $((per * np)) ] || fail "$name sum on $h x $r: $oks OK lines, not $((per * np))" "$log"
    done
  done
  say "hierarchical and flat sparse allreduce = MPI_Allreduce on 2 x 2, 3 x 2, 4 x 1"
else
  say "sparse allreduces on the cluster: skipped, no $HSPARSE or $FSPARSE (cargo build --release --examples)"
fi

# 6b. The engine with sparse_exchange = hierarchical across hosts, and
# = auto (the cost model's choice each step, the node-aware exchange
# among its candidates there): every step against MPI_Allreduce of the
# decoded units (5 OK lines, rank 0).
ENGINE="$(dirname "$BIN")/examples/engine_check"
if [ -x "$ENGINE" ]; then
  for ex in hierarchical auto; do
    for hr in "2 2" "3 2" "4 1"; do
      read -r h r <<<"$hr"
      np=$((h * r))
      run "engine exchange $ex ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$ENGINE" exchange "$ex"
      log="$WORK/engine exchange $ex ${h}x$r.log"
      [ "$run_rc" = 0 ] || fail "engine_check exchange $ex on $h x $r exited $run_rc" "$log"
      oks=$(grep -c "^OK exchange .* ranks=$np$" "$log" || true)
      [ "$oks" = 5 ] || fail "engine_check exchange $ex on $h x $r: $oks OK lines, not 5" "$log"
    done
  done
  say "engine with the node-aware and the auto sparse exchange = MPI_Allreduce on 2 x 2, 3 x 2, 4 x 1"
  # 6c. The existing engine checks with the node-aware paths (allreduce =
  # hierarchical, sparse_exchange = hierarchical): every codec's mixed table
  # against MPI_Allreduce (9 OK lines), and the stateful run (momentum,
  # Nesterov, warm-up) giving every rank the same bits each step and the
  # same bits again after a snapshot restore in a second job.
  for hr in "2 2" "3 2"; do
    read -r h r <<<"$hr"
    np=$((h * r))
    run "engine codecs node-aware ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$ENGINE" codecs --node-aware
    log="$WORK/engine codecs node-aware ${h}x$r.log"
    [ "$run_rc" = 0 ] || fail "engine_check codecs --node-aware on $h x $r exited $run_rc" "$log"
    oks=$(grep -c "^OK .* ranks=$np$" "$log" || true)
    [ "$oks" = 9 ] || fail "engine_check codecs --node-aware on $h x $r: $oks OK lines, not 9" "$log"
    run "engine codecs auto ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$ENGINE" codecs --auto
    log="$WORK/engine codecs auto ${h}x$r.log"
    [ "$run_rc" = 0 ] || fail "engine_check codecs --auto on $h x $r exited $run_rc" "$log"
    oks=$(grep -c "^OK .* ranks=$np$" "$log" || true)
    [ "$oks" = 9 ] || fail "engine_check codecs --auto on $h x $r: $oks OK lines, not 9" "$log"
    snap="$WORK/snap-${h}x$r"
    mkdir -p "$snap"
    run "engine run node-aware ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$ENGINE" run --from 0 --to 4 --node-aware
    full="$WORK/engine run node-aware ${h}x$r.log"
    run "engine run save ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$ENGINE" run --from 0 --to 2 --save "$snap" --node-aware
    run "engine run load ${h}x$r" --hosts "$h" --ranks-per-host "$r" --link 1gbit -- "$ENGINE" run --from 2 --to 4 --load "$snap" --node-aware
    [ "$run_rc" = 0 ] || fail "engine_check run --load --node-aware on $h x $r exited $run_rc" "$WORK/engine run load ${h}x$r.log"
    steps=$(grep -c "^STEP " "$full" || true)
    [ "$steps" = 4 ] || fail "engine_check run --node-aware on $h x $r: $steps STEP lines, not 4" "$full"
    # Every rank's hash alike on each line.
    if grep "^STEP " "$full" | awk '{n = split($3, h, ","); for (i = 2; i <= n; i++) if (h[i] != h[1]) bad = 1} END {exit !bad}'; then
      fail "engine_check run --node-aware on $h x $r: ranks differ" "$full"
    fi
    [ "$(grep -E '^STEP [23] ' "$full")" = "$(grep -E '^STEP [23] ' "$WORK/engine run load ${h}x$r.log")" ] ||
      fail "engine_check run --node-aware on $h x $r: restored steps 2-3 differ from the uninterrupted run" "$full"
  done
  say "engine checks (codecs, stateful run, snapshot restore) with the node-aware dense, sparse and allgatherv paths, and codecs with both auto, on 2 x 2, 3 x 2"
else
  say "engine exchange on the cluster: skipped, no $ENGINE (cargo build --release --examples)"
fi

# 6c. calibrate on a job spanning hosts measures both levels: shared
# memory inside a host, the 1 Gbit/s link (two-way and one-way, and its
# burst credit after idling) between.
# The burst credit is a measurement of the machine as well as of the
# shaper: the post-idle exchanges must beat the back-to-back curve by more
# than the noise (burst.rs MIN_GAIN) for the fit to keep one. A first run
# that keeps none is measured again (noise); a machine on which neither
# does is reported with the fit's numbers, not failed: the fit itself is
# tested on known buckets (calibrate::burst's tests).
levels_check() { # profile -> prints the levels, exit 3: no burst credit
  python3 - "$1" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
e = p.get("inter_node")
assert e, "no inter_node level"
assert e["oneway_curve"], "no one-way curve"
ow = e["oneway_curve"][-1]["per_byte"]
# 1 Gbit/s one way is 8 ns/B; shared memory is well under 1 ns/B.
assert 5e-9 < ow < 12e-9, f"one-way {ow} s/B is not 1 Gbit/s"
assert p["beta"] < 1e-9 < e["beta"], (p["beta"], e["beta"])
line = f"inside {p['beta'] * 1e9:.2f} ns/B, between {e['beta'] * 1e9:.2f} ns/B two-way, {ow * 1e9:.2f} ns/B one-way"
# The link's tbf bucket (2 ms: 250 KB at 1 Gbit/s) is a burst credit:
# after idling, about that much crosses faster than the rate.
b = e.get("burst")
if not b:
    print(line)
    sys.exit(3)
# How much of it the fit sees depends on how fast the CPUs move the first
# messages after the idle spell: 55 KB on one 2-vCPU CI machine, up to
# 250 KB on others. A tenth of the bucket is the floor (below that the
# credit is noise the fit should not have kept).
# A credit outside these bounds is measured again (exit 4) and fails the
# test only when the second run keeps one too: one run's noise can look
# like a credit (another machine's CI once failed here, once).
if not 25e3 < b["bytes"] < 1.1e6:
    print(f"{line}, burst credit {b['bytes']} B (the bucket holds 250 KB)")
    sys.exit(4)
# How much faster depends on the CPUs that move the burst (the shaper
# itself passes it at memory speed): 0.13-0.28 of the sustained rate on
# 2-vCPU VMs, 0.50 and 0.82 on CI machines. Faster it must be: a credit
# at the sustained rate saves nothing and the fit would not keep it.
top = e["beta_curve"][-1]["per_byte"]
if not b["beta"] < top:
    print(f"{line}, burst credit at {b['beta']} s/B, slower than the sustained {top} s/B")
    sys.exit(4)
# A credit the fit kept on the error it removes but whose rate is within
# a fifth of the sustained one is this machine's noise as much as the
# shaper's bucket: measured again, then reported, like no credit.
if b["beta"] >= 0.8 * top:
    print(f"{line}, a weak burst credit {b['bytes'] / 1e3:.0f} KB at {b['beta'] / top:.2f} of the sustained rate")
    sys.exit(3)
print(f"{line}, burst credit {b['bytes'] / 1e3:.0f} KB at {b['beta'] * 1e9:.2f} ns/B ({b['beta'] / top:.2f} of the sustained rate)")
PY
}
for try in 1 2; do
  RUST_LOG=gradsync::calibrate=debug run "calibrate 2x2" --hosts 2 --ranks-per-host 2 --link 1gbit -- "$BIN" calibrate \
    --out "$WORK/prof2x2.json" --quiet --reps 3 --min-seconds 1 --max-bytes 1M --densities 0.01
  [ "$run_rc" = 0 ] || fail "calibrate on 2 x 2 exited $run_rc" "$WORK/calibrate 2x2.log"
  levels_rc=0
  levels=$(levels_check "$WORK/prof2x2.json" 2>&1) || levels_rc=$?
  case "$levels_rc" in
    0 | 3) ;;
    *)
      # Wrong levels (an assertion, exit 1) or an implausible burst
      # credit (exit 4): one run's noise on a shared machine is measured
      # again; the second run must hold.
      levels=$(printf '%s' "$levels" | tail -n 1)
      [ "$try" = 1 ] || fail "calibrate on 2 x 2: the profile's levels are wrong on the second run too: $levels" "$WORK/prof2x2.json"
      say "calibrate on 2 x 2: the profile's levels are off ($levels); measuring again"
      continue ;;
  esac
  [ "$levels_rc" = 3 ] || break
  # What the fit saw, from rank 0's debug log: the post-idle exchanges
  # and the error with and without a credit.
  # (Either line may be missing: grep's exit 1 must not end the script
  # under set -e and pipefail without a word, as it once did in CI.)
  seen="$( (grep -m 1 'after idling' "$WORK/calibrate 2x2.log" || true
    grep -m 1 'burst credit .* rms' "$WORK/calibrate 2x2.log" || true) |
    sed 's/.*calibrate: //' | paste -sd ';' | sed 's/;/; /')"
  # The probe itself must have run: no post-idle exchanges at all is a
  # fault of calibrate, not of the machine.
  case "$seen" in
    *"after idling [("*) ;;
    *) fail "calibrate on 2 x 2: no post-idle exchanges measured (\"between nodes after idling\" missing or empty)" "$WORK/calibrate 2x2.log" ;;
  esac
  if [ "$try" = 1 ]; then
    say "calibrate on 2 x 2: no clear burst credit kept ($levels; ${seen:-no debug lines}); measuring again"
  else
    levels="$levels; no clear burst credit kept on this machine twice (${seen:-no debug lines}): its post-idle exchanges were not faster than the sustained curve by the fit's margin"
  fi
done
say "calibrate on 2 x 2 measures both levels: $levels"

# 7. A failing command's status.
run "exit 7" --hosts 2 --ranks-per-host 1 --link 1gbit -- sh -c 'exit 7'
[ "$run_rc" = 7 ] || fail "a command exiting 7 made hpc/cluster.sh exit $run_rc" "$WORK/exit 7.log"
say "a command's exit status (7) comes back; no namespace or daemon left after any run"
say "passed in $((SECONDS - t_start)) s"
