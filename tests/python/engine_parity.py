"""Writes a run's gradients and the Python engine's results (tests/python.rs
then replays the gradients through the Rust engine, examples/engine_replay.rs,
and compares the two bit for bit).

    mpirun -np 3 python -m mpi4py tests/python/engine_parity.py DIR
"""

import json
import os
import sys

import numpy as np
from mpi4py import MPI

import gradsync

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
out_dir = sys.argv[1]
steps = 6

layers = [
    {"name": "conv1.weight", "shape": [16, 3, 3, 3], "strategy": "dense"},
    {"name": "fc1.weight", "shape": [256, 200], "strategy": "rgc:density=0.01"},
    {"name": "fc1.bias", "shape": [256], "strategy": "auto"},
    {"name": "fc2.weight", "shape": [64, 1000], "strategy": "rgc-quant:density=0.005"},
    {"name": "fc3.weight", "shape": [40000], "strategy": "3lc:s=1.75"},
    {"name": "fc4.weight", "shape": [50000], "strategy": "auto"},
    {"name": "fc5.weight", "shape": [30000], "strategy": "sbc"},
]
options = {"momentum": 0.9, "nesterov": True, "warmup_steps": 1, "nonfinite": "error"}

sync = gradsync.GradSync(comm, **options)
for l in layers:
    sync.register(l["name"], tuple(l["shape"]), strategy=l["strategy"])
sizes = [int(np.prod(l["shape"])) for l in layers]
total = sum(sizes)

rng = np.random.default_rng(1000 + rank)
inputs = rng.standard_normal((steps, total)).astype(np.float32)
outputs = inputs.copy()
for s in range(steps):
    row = outputs[s]
    grads, off = [], 0
    for l, n in zip(layers, sizes):
        grads.append(row[off : off + n].reshape(l["shape"]))  # views: in place
        off += n
    stats = sync.sync(grads)
    assert stats["step"] == s
np.save(os.path.join(out_dir, f"in.rank{rank}.npy"), inputs)
np.save(os.path.join(out_dir, f"py.rank{rank}.npy"), outputs)
if rank == 0:
    with open(os.path.join(out_dir, "table.json"), "w") as f:
        json.dump({"options": options, "layers": layers}, f)
    print("strategies:", [l[2] for l in sync.layers()])
print(f"rank {rank}: wrote", flush=True)
