"""gradsync.allreduce against MPI_Allreduce (mpi4py, in place) on one
float32 array, interleaved in the same job: per size, REPS rounds of
gradsync's rabenseifner sum, its average and MPI's sum, a barrier before
each call; prints the medians (rank 0).

    hpc/mpirun.sh -np 2 .venv/bin/python benches/python/allreduce_bench.py [ELEMENTS ...]

Default sizes: ResNet-50's and the LSTM table's gradients (25557032 and
69206016 elements).
"""
import sys
import time

import numpy as np
from mpi4py import MPI

import gradsync

REPS = 7


def main() -> None:
    comm = MPI.COMM_WORLD
    sizes = [int(a) for a in sys.argv[1:]] or [25557032, 69206016]
    for n in sizes:
        a = np.ones(n, np.float32)
        times: dict = {}
        for _ in range(REPS):
            for what in ("sum", "average", "mpi"):
                comm.Barrier()
                t = time.perf_counter()
                if what == "mpi":
                    comm.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
                else:
                    gradsync.allreduce(comm, a, algo="rabenseifner", op=what)
                times.setdefault(what, []).append(time.perf_counter() - t)
        if comm.rank == 0:
            med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
            print(
                f"{n * 4 / 1e6:.1f} MB, {comm.size} ranks: gradsync sum {med['sum']:.1f} ms, "
                f"average {med['average']:.1f} ms, MPI_Allreduce {med['mpi']:.1f} ms "
                f"(sum / MPI {med['sum'] / med['mpi']:.2f})"
            )


if __name__ == "__main__":
    main()
