"""GradSync.sync on DLPack tensors under real mpirun (tests/python.rs, p = 1..3).

The engine's own DLPack import (python/src/dlpack.rs) is what CUDA tensors
take; here it is driven with CPU tensors (numpy arrays behind a wrapper that
only exports __dlpack__, so gradsync.GradSync's numpy conversion is
bypassed) and with a hand-made capsule that claims CUDA memory. Every check
raises AssertionError on failure; each rank prints "rank R: OK <n> checks".
"""

import ctypes

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


class Tensor:
    """A tensor of another library: DLPack only."""

    def __init__(self, a, device=None, capsule=None):
        self.a, self.device, self.capsule = a, device, capsule

    def __dlpack__(self, stream=None, **kw):
        self.stream = stream
        return self.capsule() if self.capsule else self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.device or self.a.__dlpack_device__()


def ints(n, seed):
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 13 + seed) % 101) - 50).astype(np.float32)


SHAPES = [(64, 100), (64,), (5000,)]


def engine():
    s = gradsync.GradSync(comm, momentum=0.9)
    s.register("fc1.weight", SHAPES[0], strategy="rgc:density=0.01")
    s.register("fc1.bias", SHAPES[1], strategy="dense")
    s.register("fc2.weight", SHAPES[2], strategy="dense")
    return s


def grads(step):
    return [ints(int(np.prod(s)), step * 5 + i).reshape(s) for i, s in enumerate(SHAPES)]


def expect_error(f, kind_here, needle):
    """f() must raise on every rank: kind_here on the last rank (None: the
    same gradsync.Error everywhere), gradsync.Error naming it elsewhere."""
    try:
        f()
    except Exception as e:  # noqa: BLE001
        want = kind_here if (rank == last and kind_here) else gradsync.Error
        ok(isinstance(e, want), f"{needle}: {type(e).__name__}: {e}")
        ok(needle in str(e), f"{needle!r} not in {e}")
        ok(f"rank {last}" in str(e) or (rank == last and kind_here), f"names rank {last}: {e}")
        return e
    raise AssertionError(f"rank {rank}: no error for {needle}")


# 1. The DLPack path equals the numpy path bit for bit, in place.
host, dl = engine(), engine()
for step in range(3):
    want = grads(step)
    host.sync(want)
    got = grads(step)
    stats = dl._engine.sync([Tensor(a) for a in got])
    ok(stats["step"] == step, f"stats {stats['step']}")
    ok(all(a.tobytes() == b.tobytes() for a, b in zip(got, want)), f"step {step}: DLPack = numpy, in place")

def host_fail(g):
    """The host engine takes the same failed step: the last rank fails it,
    the others pass their gradients `g` (it raises everywhere)."""
    try:
        if rank == last:
            host.fail_step("the same failure")
        else:
            host.sync([np.array(a, np.float32) for a in g])
    except gradsync.Error:
        return
    raise AssertionError("the failed step did not raise")


# 2. Bad tensors on the last rank fail the step on every rank; then it works.
bad = grads(3)
bad[1] = bad[1].astype(np.float64) if rank == last else bad[1]
expect_error(lambda: dl._engine.sync([Tensor(a) for a in bad]), TypeError, "float32")
host_fail(bad)
strided = np.zeros(10000, np.float32)[::2] if rank == last else np.zeros(5000, np.float32)
g = grads(4)
g[2] = strided
expect_error(lambda: dl._engine.sync([Tensor(a) for a in g]), ValueError, "not contiguous")
host_fail(g)
g = grads(5)
if rank == last:
    g[2] = g[0].reshape(-1)[:5000]  # shares memory with gradient 0
expect_error(lambda: dl._engine.sync([Tensor(a) for a in g]), ValueError, "share memory")
host_fail(g)
want, got = grads(6), grads(6)
host.sync(want)
dl._engine.sync([Tensor(a) for a in got])
ok(all(a.tobytes() == b.tobytes() for a, b in zip(got, want)), "the step after the failures")


# 3. A capsule that claims CUDA memory on the last rank (host memory
# really): without the cuda feature, or without a GPU, the step fails on
# every rank naming it; the capsule is consumed and its deleter runs once.
class DLManagedTensor(ctypes.Structure):
    pass


DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [
    ("data", ctypes.c_void_p),
    ("device_type", ctypes.c_int32),
    ("device_id", ctypes.c_int32),
    ("ndim", ctypes.c_int32),
    ("code", ctypes.c_uint8),
    ("bits", ctypes.c_uint8),
    ("lanes", ctypes.c_uint16),
    ("shape", ctypes.POINTER(ctypes.c_int64)),
    ("strides", ctypes.POINTER(ctypes.c_int64)),
    ("byte_offset", ctypes.c_uint64),
    ("manager_ctx", ctypes.c_void_p),
    ("deleter", DELETER),
]
deleted = []
on_delete = DELETER(lambda m: deleted.append(1))
keep = []


def cuda_capsule(a):
    shape = (ctypes.c_int64 * a.ndim)(*a.shape)
    m = DLManagedTensor(a.ctypes.data, 2, 0, a.ndim, 2, 32, 1, shape, None, 0, None, on_delete)
    keep.extend([shape, m])
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(m), b"dltensor", None)


g = grads(7)
ts = [Tensor(a) for a in g]
if rank == last:
    ts = [Tensor(a, device=(2, 0), capsule=lambda a=a: cuda_capsule(a)) for a in g]
e = expect_error(lambda: dl._engine.sync(ts), None, "CUDA")
ok(any(s in str(e) for s in ("without CUDA support", "libcuda not found", "not CUDA device memory")), f"CUDA cause: {e}")
if rank == last:
    ok(all(t.stream == 1 for t in ts[:1]), "asked for the legacy default stream (stream=1)")
    ok(len(deleted) == len(g), f"each capsule's deleter ran once: {len(deleted)}")

print(f"rank {rank}: OK {checks} checks", flush=True)
