"""The Python call's own cost, in one process (p = 1): GradSync.sync through
the wrapper vs the extension's sync, the stats dict alone (last_stats), and a
getter. Reported in docs/benchmarks/python.md.

    .venv/bin/python benches/python/call_cost.py
"""
import time, numpy as np
from mpi4py import MPI
import gradsync
s = gradsync.GradSync(MPI.COMM_WORLD, momentum=0.0)
s.register("l", (1024,), strategy="auto")
g = np.ones(1024, np.float32)
e = s._engine
for f, name in [(lambda: s.sync([g]), "wrapper"), (lambda: e.sync([g], None), "ext"), (lambda: e.last_stats(), "stats only"), (lambda: e.step, "getter")]:
    for _ in range(200): f()
    t = time.perf_counter(); N = 20000
    for _ in range(N): f()
    print(name, (time.perf_counter() - t) / N * 1e6, "us")
