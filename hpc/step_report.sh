#!/usr/bin/env bash
# The step model against the engine on this machine, as a report: runs
# hpc/step_bench.sh at p = 2 over shared memory and over the emulated
# 1 Gbit/s network (hpc/netem.sh), each calibrating its profile in the same
# job, and prints one line per (network, table, configuration): the measured
# median, the model's prediction and the relative error, then the largest
# error. Nothing is asserted (timings belong in benchmarks, not tests): its
# purpose is a record of how well the model holds on machines other than
# the one it was tuned on (docs/benchmarks/step-model.md). About 5-10
# minutes.
#
#   hpc/step_report.sh            # both networks
#   NETS=shm hpc/step_report.sh   # shared memory only
#
# Env: NP (2), ITERS (5), NETS ("shm 1gbit"), OUT (target/step-report),
# THRESHOLD (passed to hpc/step_bench.sh: the compress_threshold).
# The 1 Gbit/s run needs root or sudo for namespaces; without them it is
# skipped with the reason.
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
ITERS=${ITERS:-5}
NETS=${NETS:-"shm 1gbit"}
OUT=${OUT:-target/step-report}
mkdir -p "$OUT"
say() { echo "step_report.sh: $*"; }
[ -x target/release/gradsync ] || cargo build --release
# The machine, so that records from several machines (or boots of one)
# can be told apart: CPUs, the kernel's boot id and boot time.
say "$(nproc) CPUs ($(grep -m 1 'model name' /proc/cpuinfo | sed 's/.*: //')), host $(hostname), boot $(cut -c1-8 /proc/sys/kernel/random/boot_id) at $(uptime -s 2>/dev/null || echo '?'), $NP ranks, $ITERS iterations, $(date -u '+%F %H:%M') UTC"
# The CPU time of the whole machine (/proc/stat: busy, and stolen by the
# host) and of this script's finished children (bash's `times`), so that
# each network's job can say how much of the machine other work took while
# it ran: a calibration that shares two cores with a build or another
# benchmark reads its local costs 10-40 % slow, and its report is not a
# quiet machine's.
# (`times` runs in this shell, not in a command substitution's subshell,
# whose children are not the job's; `%.0f`, as mawk prints numbers past
# 2^31 in six digits; the CPUs counted are /proc/stat's, every online one,
# which in a container may be more than this job may use.)
cpu_mark() {
  LC_ALL=C times >"$1.times"
  echo "$(awk '/^cpu /{printf "%.0f %.0f", $2+$3+$4+$7+$8, $9}' /proc/stat) $(getconf CLK_TCK)" \
    "$(tail -n 1 "$1.times") $(date +%s.%N)" >"$1"
}
cpu_share() {
  python3 - "$1" "$2" "$3" "$(grep -c '^cpu[0-9]' /proc/stat)" <<'PY'
import re, sys
net, a, b, ncpu = sys.argv[1], sys.argv[2].split(), sys.argv[3].split(), int(sys.argv[4])
def secs(t):  # bash `times`: 1m2.345s (1m2,345s in some locales)
    m = re.fullmatch(r"(\d+)m([\d.,]+)s", t)
    return int(m[1]) * 60 + float(m[2].replace(",", "."))
hz = float(a[2])
busy = (float(b[0]) - float(a[0])) / hz
steal = (float(b[1]) - float(a[1])) / hz
ours = secs(b[3]) + secs(b[4]) - secs(a[3]) - secs(a[4])
wall = float(b[5]) - float(a[5])
other = max(busy - ours, 0.0)
cap = ncpu * wall
print(f"step_report.sh: {net}: the machine while it ran: {wall:.0f} s on {ncpu} CPUs; this job "
      f"{ours:.0f} CPU-s, other processes {other:.1f} ({other / cap * 100:.1f} %), stolen by the "
      f"host {steal:.1f} ({steal / cap * 100:.1f} %)")
if other > 0.05 * cap or steal > 0.05 * cap:
    print(f"step_report.sh: {net}: WARNING: not a quiet machine; its calibration and steps "
          f"shared the CPUs, so this network's errors are not the model's alone")
PY
}
for net in $NETS; do
  log="$OUT/$net.jsonl"
  cpu_mark "$OUT/$net.cpu0"
  case "$net" in
    shm) NP=$NP ITERS=$ITERS OUT="$OUT/$net" hpc/step_bench.sh >"$log" 2>"$OUT/$net.err" || {
      say "$net: step_bench.sh failed:"; tail -n 20 "$OUT/$net.err"; exit 1; } ;;
    1gbit)
      if [ "$(id -u)" -ne 0 ] && ! sudo -n true 2>/dev/null; then
        say "$net: skipped, namespaces need root or passwordless sudo"; continue
      fi
      hpc/netem.sh --rate 1gbit -- env NP="$NP" ITERS="$ITERS" OUT="$OUT/$net" hpc/step_bench.sh \
        >"$log" 2>"$OUT/$net.err" || { say "$net: step_bench.sh failed:"; tail -n 20 "$OUT/$net.err"; exit 1; } ;;
    *) say "unknown network '$net' in NETS (shm, 1gbit)"; exit 2 ;;
  esac
  cpu_mark "$OUT/$net.cpu1"
  cpu_share "$net" "$(cat "$OUT/$net.cpu0")" "$(cat "$OUT/$net.cpu1")"
  python3 - "$net" "$log" <<'PY'
import json, sys
net, path = sys.argv[1], sys.argv[2]
worst = 0.0
for line in open(path):
    if not line.startswith("{"):
        continue
    r = json.loads(line)
    table = r["layers_file"].rsplit("/", 1)[-1].removesuffix(".json")
    meas = r["median_s"] * 1e3
    if r.get("predicted_s") is None:
        print(f"step_report.sh: {net} {table} {r['config']}: measured {meas:.1f} ms, no prediction")
        continue
    err = r["rel_error"]
    worst = max(worst, abs(err))
    picks = " ".join(f"{k}={v}" for k, v in sorted(r["choice_counts"].items()))
    print(f"step_report.sh: {net} {table} {r['config']}: measured {meas:.1f} ms, predicted "
          f"{r['predicted_s'] * 1e3:.1f} ms ({err * 100:+.1f} %); MPI_Allreduce of the table "
          f"{r['dense_mpi_median_s'] * 1e3:.1f} ms; {picks}")
print(f"step_report.sh: {net}: largest model error {worst * 100:.1f} %")
# The plan against the best single configuration of its table, measured in
# the same interleaved rounds (each a median of ITERS steps), and what the
# model predicted for the two: whether `auto` loses to one strategy alone.
by_table = {}
for line in open(path):
    if line.startswith("{"):
        r = json.loads(line)
        by_table.setdefault(r["layers_file"].rsplit("/", 1)[-1].removesuffix(".json"), {})[r["config"]] = r
for table, rs in by_table.items():
    plan, others = rs.get("planned"), {c: r for c, r in rs.items() if c != "planned"}
    # The machine's state beside the steps against its calibration's (the
    # exchanges and the local tables of `state_probes`): a ratio far from
    # 1 moves the predictions that use that part of the profile with it.
    size = lambda x: f"{x['size'] >> 20} MiB" if x['size'] >= 1 << 20 else f"{x['size'] >> 10} KiB"
    sec = lambda t: f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms"
    probes = next(iter(rs.values())).get("state_probes", [])
    st = [f"{x['probe']} {size(x)} {sec(x['measured_s'])} against the profile's "
          f"{sec(x['profile_s'])} ({x['measured_s'] / x['profile_s']:.2f}x)"
          for x in probes if x.get("profile_s")]
    if st:
        print(f"step_report.sh: {net} {table}: state beside the steps: " + "; ".join(st))
    far = [x for x in probes
           if x.get("profile_s") and not 0.8 <= x["measured_s"] / x["profile_s"] <= 1.25]
    if far:
        print(f"step_report.sh: {net} {table}: WARNING: the machine beside the steps is not in "
              f"its calibration's state ({', '.join(x['probe'] + ' ' + size(x) for x in far)} off "
              f"by more than 20 %); this table's predictions carry that")
    if plan is None or not others:
        continue
    best = min(others, key=lambda c: others[c]["median_s"])
    m, b = plan["median_s"], others[best]["median_s"]
    pp, pb = plan.get("predicted_s"), others[best].get("predicted_s")
    pred = "" if pp is None or pb is None else f" (predicted {pp * 1e3:.1f} against {pb * 1e3:.1f} ms)"
    print(f"step_report.sh: {net} {table}: planned {m * 1e3:.1f} ms against the best single "
          f"configuration, {best}, {b * 1e3:.1f} ms: {(m / b - 1) * 100:+.1f} %{pred}")
    # Paired by round (the configurations take turns step by step, so the
    # i-th steps of two records ran under the same machine state): the
    # median and the range of planned / best; and, where another
    # configuration ran the plan's strategies layer for layer, the same
    # ratio against it: how far apart identical work lands in these rounds.
    def ratios(x, y):
        return sorted(u / v for u, v in zip(x["step_times_s"], y["step_times_s"]))
    def med(v):
        n = len(v)
        return (v[n // 2] + v[(n - 1) // 2]) / 2
    if "step_times_s" in plan and "step_times_s" in others[best]:
        r = ratios(plan, others[best])
        picks = lambda x: [l["choice"] for l in x["choices"]]
        same = [c for c, o in others.items() if picks(o) == picks(plan)]
        tie = ""
        if best in same:
            tie = f" ({best} ran the plan's strategies: this is the rounds' noise)"
        elif same:
            q = ratios(plan, others[same[0]])
            tie = (f"; against {same[0]}, the same strategies, {(med(q) - 1) * 100:+.1f} % "
                   f"({(q[0] - 1) * 100:+.1f} to {(q[-1] - 1) * 100:+.1f})")
        print(f"step_report.sh: {net} {table}: planned / {best} paired by round: median "
              f"{(med(r) - 1) * 100:+.1f} %, range {(r[0] - 1) * 100:+.1f} to {(r[-1] - 1) * 100:+.1f} % "
              f"over {len(r)} rounds{tie}")
PY
done
