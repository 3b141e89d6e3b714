"""The fixed cost of one `gradsync.allreduce` call: small float32 arrays
reduced in place by gradsync (`rabenseifner` and `mpi`) and by mpi4py's
`Allreduce(MPI.IN_PLACE, ...)`, interleaved in one job, with the cost of
an `MPI_Comm_dup` + `MPI_Comm_free` pair beside them (what a call paid
when it duplicated the communicator each time). Per size and kind, REPS
rounds of CALLS calls after a barrier; prints the median time per call
(rank 0), in microseconds.

    hpc/mpirun.sh -np 2 .venv/bin/python benches/python/call_latency.py [ELEMENTS ...]

Default sizes: 1, 1024 and 262144 elements.
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import gradsync

REPS = 7
CALLS = 200


def main() -> None:
    comm = MPI.COMM_WORLD
    sizes = [int(a) for a in sys.argv[1:]] or [1, 1024, 262144]
    for n in sizes:
        a = np.ones(n, np.float32)
        kinds = {
            "gradsync": lambda: gradsync.allreduce(comm, a),
            "gradsync-mpi": lambda: gradsync.allreduce(comm, a, algo="mpi"),
            "MPI_Allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, a),
            "dup+free": lambda: comm.Dup().Free(),
        }
        times: dict = {}
        for f in kinds.values():
            for _ in range(20):
                f()
        for _ in range(REPS):
            for name, f in kinds.items():
                comm.Barrier()
                t = time.perf_counter()
                for _ in range(CALLS):
                    f()
                times.setdefault(name, []).append((time.perf_counter() - t) / CALLS)
        if comm.rank == 0:
            med = {k: sorted(v)[len(v) // 2] * 1e6 for k, v in times.items()}
            cols = ", ".join(f"{k} {v:.1f}" for k, v in med.items())
            print(f"{n} elements, {comm.size} ranks (µs a call): {cols}", flush=True)


if __name__ == "__main__":
    main()
