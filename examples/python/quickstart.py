# mpirun -np 4 python -m mpi4py examples/python/quickstart.py
import zlib

import numpy as np
from mpi4py import MPI

import gradsync

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

# The dense collectives on any float32/float64 array, in place.
x = np.full(1000, rank + 1, dtype=np.float64)
gradsync.allreduce(comm, x, algo="ring", op="sum")
assert x[0] == size * (size + 1) / 2

# The engine: register the layers once, then sync every step.
sync = gradsync.GradSync(comm, momentum=0.9)           # duplicates comm
sync.register("fc1.weight", (512, 256), strategy="rgc:density=0.01")
sync.register("fc1.bias", (512,), strategy="dense")
sync.register("fc2.weight", (10, 512))                # "auto": dense below 32768 elements
w = [np.zeros((512, 256), np.float32), np.zeros(512, np.float32), np.zeros((10, 512), np.float32)]
rng = np.random.default_rng(rank)
lr = 0.1
for step in range(20):
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in w]  # backward pass
    stats = sync.sync(grads)            # in place: update directions, identical on every rank
    for p, d in zip(w, grads):
        p -= lr * d
    if rank == 0 and step % 10 == 0:
        sent = stats["fused_bytes"] + stats["dense_bytes"]
        print(f"step {step}: sent {sent} B, fc1.weight ratio {stats['layers'][0]['ratio']:.1f}")

# Every rank holds the same weights.
digest = comm.allgather(zlib.crc32(w[0].tobytes()))
assert len(set(digest)) == 1
sync.close()
if rank == 0:
    print("quickstart: OK")
