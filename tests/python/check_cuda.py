"""GradSync.sync on PyTorch CUDA tensors under real mpirun.

    mpirun -np 2 python3 -m mpi4py tests/python/check_cuda.py

The ranks may share one GPU (rank r uses device r % count). The engine's
device path stages through pinned host memory (GradSync::sync_device).
For a dense, an
RGC and a quantized RGC layer, with momentum, it runs 4 steps of
integer-valued gradients twice: as CUDA tensors through DLPack (the device
path: python/src/dlpack.rs, gradsync::gpu::BorrowedCuda) and as numpy arrays
(the host engine), and checks that

(a) the device results, written in place into the same CUDA tensors,
    equal the host results bit for bit, every step;
(b) the stats say the step ran on the device (``device`` present);
(c) a bad CUDA tensor (float64) on the last rank fails the step on every
    rank, as the host engine's failed step does, and the next step again
    equals the host's.

Where torch, a GPU, or gradsync's cuda feature is missing on any rank, every
rank skips: rank 0 prints ``SKIPPED: <reason>`` and all exit 0. Otherwise
each rank prints ``rank R: OK <n> checks``; a failure raises (run with
``python3 -m mpi4py`` to abort the job).
"""

import sys

import numpy as np
from mpi4py import MPI

import gradsync

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
last = p - 1
checks = 0


def ok(cond, what):
    global checks
    assert cond, f"rank {rank}: {what}"
    checks += 1


def why_not():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


reason = why_not()
reasons = [r for r in comm.allgather(reason) if r]
if reasons:
    if rank == 0:
        print(f"SKIPPED: {reasons[0]}", flush=True)
    sys.exit(0)

import torch  # noqa: E402

dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)

SHAPES = [(256, 300), (300,), (4096,)]
STRATEGIES = ["rgc:density=0.01", "dense", "rgc-quant:density=0.02"]


def engine():
    s = gradsync.GradSync(comm, momentum=0.9)
    for i, (shape, strat) in enumerate(zip(SHAPES, STRATEGIES)):
        s.register(f"layer{i}", shape, strategy=strat)
    return s


def ints(n, seed):
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 13 + seed * 31) % 101) - 50).astype(np.float32)


def grads(step):
    return [ints(int(np.prod(s)), step * 5 + i).reshape(s) for i, s in enumerate(SHAPES)]


# A device engine that cannot stage (built without the cuda feature) fails
# its first step on every rank alike: that is a skip, not a failure.
host, gpu = engine(), engine()
first = grads(0)
tensors = [torch.from_numpy(a.copy()).to(dev) for a in first]
try:
    stats = gpu.sync(tensors)
except gradsync.Error as e:
    if "without CUDA support" in str(e) or "cuda feature" in str(e):
        if rank == 0:
            print(f"SKIPPED: this gradsync has no CUDA support ({e})", flush=True)
        sys.exit(0)
    raise
host.sync(first)
ok(all(np.array_equal(t.cpu().numpy(), a) for t, a in zip(tensors, first)), "step 0: device = host")
ok("device" in stats and stats["device"], f"stats name the device: {stats.get('device')}")
if rank == 0:
    print(f"device stats: {stats['device']}", flush=True)

for step in range(1, 4):
    want = grads(step)
    tensors = [torch.from_numpy(a.copy()).to(dev) for a in want]
    gpu.sync(tensors)
    host.sync(want)
    for i, (t, a) in enumerate(zip(tensors, want)):
        got = t.cpu().numpy()
        ok(got.tobytes() == a.tobytes(), f"step {step} layer {i} ({STRATEGIES[i]}): device = host, "
           f"max |diff| {float(np.max(np.abs(got - a)))}")

# (c) A float64 CUDA tensor on the last rank fails the step everywhere.
bad = grads(4)
tensors = [torch.from_numpy(a.copy()).to(dev) for a in bad]
if rank == last:
    tensors[1] = tensors[1].double()
try:
    gpu.sync(tensors)
except Exception as e:  # noqa: BLE001
    ok("float32" in str(e), f"names float32: {e}")
else:
    raise AssertionError(f"rank {rank}: a float64 tensor on rank {last} did not fail the step")
host_ok = False
try:
    if rank == last:
        host.fail_step("the same failure")
    else:
        host.sync(bad)
except gradsync.Error:
    host_ok = True
ok(host_ok, "the host engine fails the same step")
want = grads(5)
tensors = [torch.from_numpy(a.copy()).to(dev) for a in want]
gpu.sync(tensors)
host.sync(want)
ok(all(t.cpu().numpy().tobytes() == a.tobytes() for t, a in zip(tensors, want)), "the step after the failure")

comm.Barrier()
print(f"rank {rank}: OK {checks} checks", flush=True)
