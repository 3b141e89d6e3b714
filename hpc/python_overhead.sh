#!/usr/bin/env bash
# Python binding overhead: GradSync.sync called from Python vs
# from Rust on the same one-layer table, 1K..64M elements, on NP ranks
# (default 2, not oversubscribed on a 2-core machine). The two runs
# alternate ROUNDS times (default 3) so both see the same machine; the table
# reports medians over rounds of each run's median, the overhead and the
# budget max(5 %, 20 us). Needs `cargo build --release --examples` and the
# package installed (hpc/test.sh does both).
set -euo pipefail
cd "$(dirname "$0")/.."
NP="${NP:-2}"; ROUNDS="${ROUNDS:-3}"; SIZES="${SIZES:-1K,16K,256K,4M,64M}"; REPS="${REPS:-30}"
PY="${GRADSYNC_PYTHON:-$PWD/.venv/bin/python}"
out=$(mktemp)
for r in $(seq "$ROUNDS"); do
  hpc/mpirun.sh -np "$NP" target/release/examples/sync_bench "$SIZES" "$REPS" 2>/dev/null | grep '^{' >>"$out"
  hpc/mpirun.sh -np "$NP" "$PY" -m mpi4py benches/python/sync_bench.py "$SIZES" "$REPS" 2>/dev/null | grep '^{' >>"$out"
done
"$PY" - "$out" "$NP" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault((r["elements"], r["lang"]), []).append(r["median_s"])
print(f"ranks: {sys.argv[2]}, rounds: {len(by[next(iter(by))])}")
print("| elements | Rust sync (us) | Python sync (us) | overhead (us) | overhead (%) | budget max(5 %, 20 us) |")
print("|---:|---:|---:|---:|---:|:---|")
ok = True
for n in sorted({k[0] for k in by}):
    rs, py = statistics.median(by[(n, "rust")]), statistics.median(by[(n, "python")])
    over = py - rs
    budget = max(0.05 * rs, 20e-6)
    ok &= over <= budget
    print(f"| {n} | {rs*1e6:.1f} | {py*1e6:.1f} | {over*1e6:.1f} | {100*over/rs:.1f} | {'within' if over <= budget else 'OVER'} ({budget*1e6:.1f} us) |")
sys.exit(0 if ok else 1)
PYEOF
