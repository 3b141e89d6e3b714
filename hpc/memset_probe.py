"""Clearing (memset) cost per byte, alone and on every rank at once, by
buffer size: the measurement behind `calibrate`'s gamma_clear_curve
(docs/benchmarks/cluster.md, "Three jobs a point"). Run on an emulated cluster:

    hpc/cluster.sh --hosts 2 --ranks-per-host 2 --link 1gbit -- .venv/bin/python hpc/memset_probe.py

Rank 0 prints, per size, the span from a barrier to the slowest rank's
end (through a second barrier), each rank's own time with all ranks at
once, and each rank's time alone (one rank at a time), medians of 15.
"""
import ctypes
import time

import numpy as np
from mpi4py import MPI


def main():
    c = MPI.COMM_WORLD
    r = c.Get_rank()
    med = lambda v: sorted(v)[len(v) // 2] * 1e3  # noqa: E731 (ms)
    for mib in (4, 8, 16, 32, 64, 128):
        y = np.ones(mib << 18, dtype=np.float32)  # real pages, not the zero page
        p, nb = y.ctypes.data, y.nbytes
        span, own, alone = [], [], []
        for _ in range(15):
            c.Barrier()
            t0 = time.perf_counter()
            ctypes.memset(p, 0, nb)
            t1 = time.perf_counter()
            c.Barrier()
            own.append(t1 - t0)
            span.append(time.perf_counter() - t0)
            for k in range(c.Get_size()):
                c.Barrier()
                if k == r:
                    t0 = time.perf_counter()
                    ctypes.memset(p, 0, nb)
                    alone.append(time.perf_counter() - t0)
        owns, alones = c.gather(med(own)), c.gather(med(alone))
        if r == 0:
            print(f"{mib} MiB: span {med(span):.2f} ms ({med(span) * 1e6 / nb:.3f} ns/B), "
                  f"own {' '.join('%.2f' % x for x in owns)} ms, "
                  f"alone {' '.join('%.2f' % x for x in alones)} ms "
                  f"({min(alones) * 1e6 / nb:.3f} ns/B)", flush=True)


if __name__ == "__main__":
    main()
