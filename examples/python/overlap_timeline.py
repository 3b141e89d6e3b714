#!/usr/bin/env python3
"""Where a training step's time goes with gradsync's overlapping optimizer:
forward, backward (``loss.backward()``, during which buckets are submitted),
``step()`` (what is left to wait for), and when each bucket was submitted,
on ``train_torch.py``'s model with every layer dense.

    hpc/netem.sh --rate 800mbit -- hpc/mpirun.sh -np 2 -x OV -x POLL \\
        .venv/bin/python examples/python/overlap_timeline.py

``OV=0``: the whole step after backward (no overlap); ``POLL``: the
engine's ``progress_poll_us`` (100 by default; 0: MPI's blocking calls).
Prints on rank 0 the medians of 35 steps (after 5 warm-up steps), in ms,
then backward alone (no communication).
"""

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradsync  # noqa: E402
import gradsync.torch as gst  # noqa: E402
from train_torch import Net  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
comm = MPI.COMM_WORLD
model = Net()
x, y = torch.randn(256, 1, 8, 8), torch.randint(0, 10, (256,))
overlap = os.environ.get("OV", "1") == "1"
poll = int(os.environ.get("POLL", "100"))
opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                               strategy="dense", overlap=overlap, bucket_cap_mb=2, progress_poll_us=poll)
submits = []
submit = gradsync.GradSync.submit_bucket


def timed_submit(self, ids, *a, **k):
    submits.append(time.perf_counter())
    return submit(self, ids, *a, **k)


gradsync.GradSync.submit_bucket = timed_submit
rows = []
for it in range(40):
    submits.clear()
    comm.Barrier()
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    t3 = time.perf_counter()
    if it >= 5:
        rows.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, [s - t1 for s in submits]))
opt.sync.close()


def med(i):
    return statistics.median(r[i] for r in rows) * 1e3


if comm.rank == 0:
    print(f"overlap={overlap} progress_poll_us={poll}: forward {med(0):.1f} backward {med(1):.1f} "
          f"step() {med(2):.1f} total {med(3):.1f} ms; buckets submitted at "
          f"{[round(s * 1e3, 1) for s in rows[-1][4]]} ms into backward")
alone = []
for _ in range(20):
    model.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    t = time.perf_counter()
    torch.autograd.backward(loss, inputs=[p for p in model.parameters()])
    alone.append(time.perf_counter() - t)
if comm.rank == 0:
    print(f"backward alone {statistics.median(alone) * 1e3:.1f} ms")
