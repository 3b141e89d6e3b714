"""`GradSync.sync` timed from Python: the same table and protocol as
examples/sync_bench.rs (see there); prints {"lang": "python", ...} lines.

    mpirun -np 2 python -m mpi4py benches/python/sync_bench.py 1K,16K,256K,4M,64M 50
"""
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import gradsync

comm = MPI.COMM_WORLD
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse(s):
    return int(s[:-1]) * UNITS[s[-1]] if s[-1] in UNITS else int(s)


sizes = sys.argv[1] if len(sys.argv) > 1 else "1K,64K,1M"
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 30
for s in sizes.split(","):
    n = parse(s)
    sync = gradsync.GradSync(comm, momentum=0.9)
    sync.register("layer", (n,), strategy="auto")
    g = np.zeros(n, np.float32)
    src = (((np.arange(n + 13) * 7) % 13) - 6.0).astype(np.float32)
    times = []
    for it in range(reps + 5):
        s0 = it % 13
        np.copyto(g, src[s0 : s0 + n])  # as the Rust side: one copy of a window
        comm.Barrier()
        t = time.perf_counter()
        sync.sync([g])
        if it >= 5:
            times.append(time.perf_counter() - t)
    times.sort()
    if comm.Get_rank() == 0:
        print(json.dumps({"lang": "python", "elements": n, "median_s": times[reps // 2], "min_s": times[0], "reps": reps}), flush=True)
    sync.close()
