#!/usr/bin/env bash
# The step model against the engine on this machine, as a report: runs
# hpc/step_bench.sh at p = 2 over shared memory and over the emulated
# 1 Gbit/s network (hpc/netem.sh), each calibrating its profile in the same
# job, and prints one line per (network, table, configuration): the measured
# median, the model's prediction and the relative error, then the largest
# error. Nothing is asserted (timings belong in benchmarks, not tests): its
# purpose is a record of how well the model holds on machines other than
# the one it was tuned on (docs/benchmarks/step-model.md). About 4 minutes.
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
for net in $NETS; do
  log="$OUT/$net.jsonl"
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
    if plan is None or not others:
        continue
    best = min(others, key=lambda c: others[c]["median_s"])
    m, b = plan["median_s"], others[best]["median_s"]
    pp, pb = plan.get("predicted_s"), others[best].get("predicted_s")
    pred = "" if pp is None or pb is None else f" (predicted {pp * 1e3:.1f} against {pb * 1e3:.1f} ms)"
    print(f"step_report.sh: {net} {table}: planned {m * 1e3:.1f} ms against the best single "
          f"configuration, {best}, {b * 1e3:.1f} ms: {(m / b - 1) * 100:+.1f} %{pred}")
PY
done
