"""The engine's dense step with MPI's own allreduce against Rabenseifner's.

One dense layer of N elements, momentum 0.9, in two engines
(``allreduce="mpi"`` and ``"rabenseifner"``), ``GradSync.sync`` timed with a
barrier before each, the two interleaved; rank 0 prints the medians (ms)::

    hpc/mpirun.sh -np 2 .venv/bin/python benches/python/engine_mpi_bench.py 16777216 11
"""
import time, sys, json
import numpy as np
from mpi4py import MPI
import gradsync
comm = MPI.COMM_WORLD
n = int(sys.argv[1]); reps = int(sys.argv[2])
engines = {}
for algo in ["mpi", "rabenseifner"]:
    s = gradsync.GradSync(comm, allreduce=algo, momentum=0.9)
    s.register("layer", (n,), strategy="dense")
    engines[algo] = s
pat = np.arange(n + 1024, dtype=np.float32) % 13 - 6
g = np.empty(n, dtype=np.float32)
times = {a: [] for a in engines}
for r in range(reps + 2):
    for a, s in engines.items():
        np.copyto(g, pat[r % 1024 : r % 1024 + n])
        comm.Barrier()
        t = time.perf_counter()
        s.sync([g])
        dt = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
        if r >= 2:
            times[a].append(dt)
if comm.rank == 0:
    print(json.dumps({a: round(float(np.median(v)) * 1e3, 2) for a, v in times.items()} | {"elements": n, "reps": reps}))
for s in engines.values():
    s.close()
