"""gradsync's Python API under real mpirun (run by tests/python.rs for p = 1..4).

Every check raises AssertionError on failure; each rank prints
"rank R: OK <n> checks" at the end. Failure checks print the exception each
rank saw, so the harness can compare them across ranks.
"""

import os
import sys
import tempfile
import threading
import time

import numpy as np
from mpi4py import MPI

import gradsync

comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
checks = 0


def ok(cond, what):
    global checks
    assert cond, f"rank {rank}: {what}"
    checks += 1


def ints(n, seed, dtype):
    i = np.arange(n, dtype=np.int64)
    return (((i * 7 + rank * 13 + seed) % 101) - 50).astype(dtype)


# 0. gradsync and mpi4py name the same MPI family (Open MPI or MPICH,
# whichever this job runs), and import refuses an mpi4py that uses the
# other one (simulated).
vendor = gradsync.mpi_vendor()
ok(vendor == MPI.get_vendor()[0], f"mpi_vendor {vendor!r} against mpi4py's {MPI.get_vendor()!r}")
other, other_text = (
    ("Open MPI", "Open MPI v4.1.4, package: Debian OpenMPI\n")
    if vendor == "MPICH"
    else ("MPICH", "MPICH Version:\t4.0.2\n")
)
real = MPI.Get_library_version
MPI.Get_library_version = lambda: other_text
try:
    gradsync._check_same_mpi()
    raise AssertionError("a different MPI library was accepted")
except ImportError as e:
    ours = gradsync.mpi_library_version().splitlines()[0][:20]
    ok(
        other in str(e) and vendor in str(e) and ours in str(e) and "--no-binary mpi4py" in str(e),
        f"import check: {e}",
    )
finally:
    MPI.Get_library_version = real
gradsync._check_same_mpi()
if rank == 0:
    print(f"MPI: gradsync and mpi4py both use {vendor}", flush=True)

# 1. gradsync.allreduce == COMM_WORLD.Allreduce, exactly on integer data.
for algo in ["rabenseifner", "ring", "mpi"]:
    for dtype in [np.float32, np.float64]:
        for n in [0, 1, max(p - 1, 1), p + 1, 1000, 100_003]:
            x = ints(n, n, dtype)
            want = np.empty_like(x)
            comm.Allreduce(x, want, op=MPI.SUM)
            gradsync.allreduce(comm, x, algo=algo, op="sum")
            ok(np.array_equal(x, want), f"allreduce {algo} {dtype.__name__} n={n} sum")
        x = ints(1000, 3, dtype)
        want = np.empty_like(x)
        comm.Allreduce(x, want, op=MPI.SUM)
        gradsync.allreduce(comm, x, algo=algo, op="average")
        ok(np.allclose(x, want / p, rtol=1e-6, atol=1e-6), f"allreduce {algo} average")
# 2-D arrays work in place too.
x = ints(600, 1, np.float32).reshape(20, 30)
want = np.empty_like(x)
comm.Allreduce(x, want, op=MPI.SUM)
gradsync.allreduce(comm, x)
ok(np.array_equal(x, want), "allreduce of a 2-D array")
# The duplicate gradsync keeps on a communicator goes with it: on
# communicators made and freed in turn (MPI may give a freed handle to the
# next one), each call reduces over its own communicator's ranks. Kept on
# COMM_SELF and COMM_WORLD until MPI_Finalize, which ends cleanly.
handles = []
for round_ in range(4):
    sub = comm.Split(rank % 2 if round_ % 2 else 0, rank)
    handles.append(sub.py2f())
    for algo in ["rabenseifner", "mpi"]:
        x = np.full(5, rank + 1, np.float32)
        want = np.empty_like(x)
        sub.Allreduce(x, want, op=MPI.SUM)
        gradsync.allreduce(sub, x, algo=algo)
        ok(np.array_equal(x, want), f"allreduce on communicator {round_} of size {sub.Get_size()}")
    sub.Free()
if rank == 0:
    print(f"freed communicators' handles reused: {len(set(handles)) < len(handles)}", flush=True)
x = np.full(3, rank + 1, np.float64)
gradsync.allreduce(MPI.COMM_SELF, x)
ok(np.array_equal(x, np.full(3, rank + 1.0)), "allreduce on COMM_SELF")


def expect_error(fn, local_types, what):
    """Every rank must raise: `local_types` on a rank at fault, gradsync.Error elsewhere."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        print(f"rank {rank}: {what}: {type(e).__name__}: {e}", flush=True)
        return e
    raise AssertionError(f"rank {rank}: {what}: no exception")


last = p - 1
# A bad array on one rank: TypeError/ValueError there, gradsync.Error on the others.
for bad, etype in [
    (lambda: np.arange(10, dtype=np.int32), TypeError),
    (lambda: np.zeros(20, np.float32)[::2], ValueError),
]:
    x = ints(10, 0, np.float32)
    arg = bad() if rank == last else x
    e = expect_error(lambda: gradsync.allreduce(comm, arg), None, "allreduce bad array")
    ok(isinstance(e, etype if rank == last else gradsync.Error), f"allreduce bad array type {type(e)}")
    ok(f"rank {last} failed" in str(e), "the error names the failing rank")
# Lengths or dtypes that differ across ranks: gradsync.Error everywhere.
if p > 1:
    x = ints(11 if rank == last else 10, 0, np.float32)
    e = expect_error(lambda: gradsync.allreduce(comm, x), None, "allreduce sizes differ")
    ok(isinstance(e, gradsync.Error) and "size mismatch" in str(e), "size mismatch error")
    ok(f"10 (rank 0) and 11 (rank {last})" in str(e), f"the size error names the ranks: {e}")
    x = ints(10, 0, np.float64 if rank == last else np.float32)
    e = expect_error(lambda: gradsync.allreduce(comm, x), None, "allreduce dtypes differ")
    ok(isinstance(e, gradsync.Error) and "dtype differs" in str(e), "dtype mismatch error")
    ok(f"rank {last} passed other than rank 0" in str(e), f"the dtype error names the rank: {e}")
    x = ints(10, 0, np.float32)
    e = expect_error(lambda: gradsync.allreduce(comm, x, algo="mpi" if rank == last else "ring"), None, "algos differ")
    ok(isinstance(e, gradsync.Error) and "algorithm differs" in str(e), "algo mismatch error")
    e = expect_error(lambda: gradsync.allreduce(comm, x, op="average" if rank == last else "sum"), None, "ops differ")
    ok(isinstance(e, gradsync.Error) and "operation differs" in str(e), "op mismatch error")
# Arguments of the wrong type on one rank still enter the agreement.
e = expect_error(lambda: gradsync.allreduce(comm, ints(4, 0, np.float32), algo=5 if rank == last else "ring"), None, "algo int")
ok(isinstance(e, TypeError if rank == last else gradsync.Error) and f"rank {last} failed" in str(e), "algo of the wrong type on one rank")
# An engine option out of range on one rank (the progress thread's poll
# interval): every rank's constructor raises, naming it.
e = expect_error(lambda: gradsync.GradSync(comm, progress_poll_us=2_000_000 if rank == last else 100), None, "poll")
ok(f"rank {last} failed" in str(e) and "progress_poll_us" in str(e), f"progress_poll_us out of range on one rank: {e}")
e = expect_error(lambda: gradsync.allreduce(comm, ints(4, 0, np.float32), algo="tree"), None, "bad algo")
ok(isinstance(e, ValueError), "unknown algo is a ValueError")
# A C-contiguous float32 view at an odd byte offset (not aligned): a
# ValueError on that rank, not a panic that leaves the others waiting.
for dtype in [np.float32, np.float64]:
    isz = np.dtype(dtype).itemsize
    mis = np.ndarray((16,), dtype, buffer=memoryview(bytearray(16 * isz + 4))[1 : 1 + 16 * isz])
    e = expect_error(lambda: gradsync.allreduce(comm, mis if rank == last else ints(16, 0, dtype)), None, "misaligned")
    ok(isinstance(e, ValueError if rank == last else gradsync.Error) and "aligned" in str(e), f"misaligned {dtype.__name__}: {e}")
ro = ints(8, 0, np.float32)
ro.setflags(write=False)
e = expect_error(lambda: gradsync.allreduce(comm, ro), None, "read-only array")
ok(isinstance(e, ValueError), "a read-only array is a ValueError")


# 2. The engine: create, use, drop several times; COMM_WORLD still works.
def table(sync):
    sync.register("fc1.weight", (64, 100), strategy="rgc:density=0.01")
    sync.register("fc1.bias", (64,), strategy="dense")
    sync.register("fc2.weight", 5000)  # auto: small, so dense
    return [(64, 100), (64,), (5000,)]


def grads(shapes, step):
    return [ints(int(np.prod(s)), step * 5 + i, np.float32).reshape(s) for i, s in enumerate(shapes)]


for round_ in range(3):
    sync = gradsync.GradSync(comm, momentum=0.9)
    shapes = table(sync)
    ok([l[2] for l in sync.layers()] == ["rgc", "dense", "dense"], f"strategies {sync.layers()}")
    for step in range(3):
        g = grads(shapes, step)
        ids = [id(a) for a in g]
        stats = sync.sync(g)
        ok([id(a) for a in g] == ids, "arrays updated in place")
        ok(stats["step"] == step and len(stats["layers"]) == 3, f"stats {stats.keys()}")
        ok(stats["layers"][0]["name"] == "fc1.weight" and stats["layers"][0]["codec"] == "rgc", "layer stats")
        # Identical result on every rank.
        all_g = comm.allgather([a.tobytes() for a in g])
        ok(all(x == all_g[0] for x in all_g), "same update direction on every rank")
    if round_ == 0:
        # Dense layers with momentum 0.9 at step 0: the average.
        pass
    del sync
    v = np.array([rank], np.int64)
    w = np.empty_like(v)
    comm.Allreduce(v, w)
    ok(w[0] == p * (p - 1) // 2, "COMM_WORLD works after the engine is dropped")

# Dense layers with no momentum equal the average of MPI_Allreduce exactly
# for power-of-two p (exact scaling) and closely otherwise.
sync = gradsync.GradSync(comm, momentum=0.0)
sync.register("a", (1000,), strategy="dense")
g = [ints(1000, 9, np.float32)]
want = np.empty_like(g[0])
comm.Allreduce(g[0], want)
sync.sync(g)
ok(np.allclose(g[0], want / p, rtol=1e-6), "dense layer = average")
sync.close()
sync.close()  # idempotent
e = expect_error(lambda: sync.sync(g), None, "closed engine")
ok(isinstance(e, gradsync.Error) and "closed" in str(e), "a closed engine raises")

# start/wait gives what sync gives.
s1, s2 = gradsync.GradSync(comm, momentum=0.9), gradsync.GradSync(comm, momentum=0.9)
sh = table(s1)
table(s2)
for step in range(3):
    a, b = grads(sh, step), grads(sh, step)
    s1.sync(a)
    s2.start(b)
    b_in = [x.copy() for x in b]
    stats = s2.wait(b)
    ok(all(np.array_equal(x, y) for x, y in zip(a, b)), "start/wait == sync")
    ok(any(not np.array_equal(x, y) for x, y in zip(b, b_in)), "wait wrote the results")

# Arrays the caller's code fails to produce on one rank (a generator that
# raises, a misaligned view): that rank raises its own error, the others
# gradsync.Error, in the same step; the next step runs on every rank.
sf = gradsync.GradSync(comm, momentum=0.9)
sh = table(sf)


def broken(xs):
    for i, x in enumerate(xs):
        if i == 1 and rank == last:
            raise KeyError("no gradient for fc1.bias")
        yield x


e = expect_error(lambda: sf.sync(broken(grads(sh, 0))), None, "generator raises")
ok(isinstance(e, KeyError if rank == last else gradsync.Error) and f"rank {last}" in str(e.__cause__ or e), f"generator: {e!r}")
g = grads(sh, 1)
g[1] = np.ndarray((64,), np.float32, buffer=memoryview(bytearray(260))[2:258]) if rank == last else g[1]
e = expect_error(lambda: sf.sync(g), None, "misaligned gradient")
ok(isinstance(e, ValueError if rank == last else gradsync.Error) and "aligned" in str(e), f"misaligned gradient: {e}")
# One buffer passed twice through DLPack (what a torch tensor passed twice
# is): each view has its own owner, so the engine's borrow check cannot see
# it; refused on every rank instead of one layer's result overwriting another.


class Exported:
    def __init__(self, a):
        self.a = a

    def __dlpack__(self, **kw):
        return self.a.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


g = grads(sh, 2)
if rank == last:
    buf = g[0].reshape(-1)
    g[0] = Exported(buf.reshape(g[0].shape))
    g[1] = Exported(buf[:64])  # overlaps layer 0's memory
e = expect_error(lambda: sf.sync(g), None, "DLPack views sharing memory")
ok(isinstance(e, ValueError if rank == last else gradsync.Error) and "share memory" in str(e), f"aliased DLPack views: {e}")
ok(sf.sync(grads(sh, 3))["step"] == 3, "the step after the failures runs")
sf.close()

# delay > 1: a bad argument in a step without communication fails it on
# every rank (an 8-byte status allreduce); a NaN there voids it everywhere.
sd = gradsync.GradSync(comm, momentum=0.9, delay=2, nonfinite="propagate")
sh = table(sd)
w = [np.zeros(sh_, np.float32) for sh_ in sh]  # the weights, as a training loop moves them


def apply(g):
    for wi, gi in zip(w, g):
        wi -= 0.1 * gi


g = grads(sh, 0)
if rank == last:
    g[0] = g[0].astype(np.float64)
e = expect_error(lambda: sd.sync(g, weights=w), None, "delay: bad dtype in a local step")
ok(isinstance(e, TypeError if rank == last else gradsync.Error) and f"rank {last} failed in step 0" in str(e), f"delay: {e}")
g = grads(sh, 1)
sd.sync(g, weights=w)  # communicating
apply(g)
g = grads(sh, 2)
if rank == last:
    g[2][0] = np.inf
sd.sync(g, weights=w)
ok(all(np.isnan(x).all() for x in g), "delay: an Inf on one rank voids the local step on every rank")
for step in (3, 4, 5):  # communicating, local, communicating
    g = grads(sh, step)
    sd.sync(g, weights=w)
    apply(g)
all_w = comm.allgather(w)
ok(all(a.tobytes() == b.tobytes() for ws in all_w for a, b in zip(ws, all_w[0])), "delay: the ranks' weights agree bit for bit after the failures")
sd.close()

# sparse_exchange="allreduce": the RGC layer by one sparse
# allreduce gives bit for bit what the fused allgatherv gives (integer
# gradients), and the stats report its distinct indices.
s3 = gradsync.GradSync(comm, momentum=0.9, sparse_exchange="allreduce")
s4 = gradsync.GradSync(comm, momentum=0.9, sparse_exchange="allgather")
sh = table(s3)
table(s4)
for step in range(3):
    a, b = grads(sh, step), grads(sh, step)
    st3, st4 = s3.sync(a), s4.sync(b)
    ok(all(np.array_equal(x, y) for x, y in zip(a, b)), f"sparse_exchange allreduce == allgather, step {step}")
    ok(st3["sparse_reduce_nnz"] > 0 and st4["sparse_reduce_nnz"] == 0, f"sparse_reduce_nnz {st3['sparse_reduce_nnz']}")
    ok(st3["fused_bytes"] == 0 and st4["fused_bytes"] > 0, "the RGC layer left the fused message")
s3.close()
s4.close()
# The node-aware exchange (nodes from MPI_Comm_split_type): the same sums.
s5 = gradsync.GradSync(comm, momentum=0.9, sparse_exchange="hierarchical")
s6 = gradsync.GradSync(comm, momentum=0.9)
sh = table(s5)
table(s6)
for step in range(2):
    a, b = grads(sh, step), grads(sh, step)
    st5, st6 = s5.sync(a), s6.sync(b)
    ok(all(np.array_equal(x, y) for x, y in zip(a, b)), f"sparse_exchange hierarchical == allgather, step {step}")
    ok(st5["sparse_reduce_nnz"] > 0, f"hierarchical sparse_reduce_nnz {st5['sparse_reduce_nnz']}")
s5.close()
s6.close()
# sparse_exchange="auto" and allreduce="auto": the cost model picks the
# exchange and the dense algorithm every step from inputs alike on every
# rank; any choice sums what the allgatherv and Rabenseifner sum.
prof = {"version": 2, "alpha": 1e-5, "beta": 1e-9, "gamma_unpack": 1e-9}
s7 = gradsync.GradSync(comm, momentum=0.9, sparse_exchange="auto", allreduce="auto", profile=prof)
s8 = gradsync.GradSync(comm, momentum=0.9)
for s_ in (s7, s8):
    s_.register("fc1.weight", (64, 100), strategy="rgc:density=0.01")
    s_.register("fc1.bias", (64,), strategy="dense")
sh = [(64, 100), (64,)]
for step in range(3):
    a, b = grads(sh, step), grads(sh, step)
    st7, st8 = s7.sync(a), s8.sync(b)
    ok(all(np.array_equal(x, y) for x, y in zip(a, b)), f"sparse_exchange auto == allgather, step {step}")
    ok(st7["sparse_exchange"] in ("allgather", "allreduce"), f"auto took {st7['sparse_exchange']}")
    ok("fill_estimate" in st7 and st8["sparse_exchange"] == "allgather", "stats name the exchange")
    ok(st7["allreduce"] in ("rabenseifner", "ring") and st8["allreduce"] == "rabenseifner", f"allreduce auto took {st7['allreduce']}")
s7.close()
s8.close()
e = expect_error(lambda: gradsync.GradSync(comm, sparse_exchange="auto"), None, "auto needs a profile")
ok("profile" in str(e), "auto without a profile names it")

# Snapshots: save after 2 steps, run 2 more; a fresh engine that loads the
# snapshot reproduces those 2 steps bit for bit.
with tempfile.TemporaryDirectory() as d:
    d = comm.bcast(d if rank == 0 else None)
    path = os.path.join(d, f"gs.rank{rank}.snap")
    comm.Barrier()
    s = gradsync.GradSync(comm, momentum=0.9)
    sh = table(s)
    for step in range(2):
        s.sync(grads(sh, step))
    s.save_snapshot(path)
    after = []
    for step in range(2, 4):
        g = grads(sh, step)
        s.sync(g)
        after.append(g)
    t = gradsync.GradSync(comm, momentum=0.9)
    table(t)
    t.load_snapshot(path)
    ok(t.step == 2, "step restored")
    for k, step in enumerate(range(2, 4)):
        g = grads(sh, step)
        t.sync(g)
        ok(all(np.array_equal(x, y) for x, y in zip(g, after[k])), "snapshot replay is bitwise equal")
    # A corrupt snapshot on one rank fails every rank and changes nothing.
    if rank == last:
        with open(path, "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0x10]))
    comm.Barrier()
    e = expect_error(lambda: t.load_snapshot(path), None, "corrupt snapshot")
    ok(isinstance(e, gradsync.Error) and f"rank {last} failed" in str(e), "corrupt snapshot fails every rank")
    ok(t.step == 4, "a failed load changes nothing")
    # Snapshots from different steps (a stale file on one rank): refused on
    # every rank, naming the file, and nothing changes.
    if p > 1:
        stale = os.path.join(d, f"gs.stale.rank{rank}.snap")
        t.save_snapshot(stale)  # every rank at step 4
        u = gradsync.GradSync(comm, momentum=0.9)
        table(u)
        u.sync(grads(sh, 0))
        if rank == last:
            u.save_snapshot(stale)  # this rank's file at step 1
        comm.Barrier()
        e = expect_error(lambda: t.load_snapshot(stale), None, "snapshots from different steps")
        ok(isinstance(e, gradsync.Error) and "different steps" in str(e) and stale in str(e), f"stale snapshot: {e}")
        ok(t.step == 4, "a refused load changes nothing")
        u.close()
    comm.Barrier()

# 3. Rank-local errors in a step: every rank raises in the same step, no hang.
s = gradsync.GradSync(comm, momentum=0.0)
sh = table(s)
cases = [
    ("float64 array", lambda g: [g[0].astype(np.float64)] + g[1:], TypeError),
    ("non-contiguous", lambda g: [np.asfortranarray(g[0])] + g[1:], ValueError),
    ("wrong shape", lambda g: [g[0].reshape(100, 64)] + g[1:], ValueError),
    ("too few layers", lambda g: g[:2], ValueError),
    ("not an array", lambda g: [g[0].tolist()] + g[1:], TypeError),
    ("arrays out of order", lambda g: [g[0], g[0], g[2]], ValueError),
]
step = 0
for what, corrupt, etype in cases:
    g = grads(sh, 0)
    arg = corrupt(g) if rank == last else g
    e = expect_error(lambda: s.sync(arg), None, what)
    mine = rank == last
    ok(isinstance(e, etype if mine else gradsync.Error), f"{what}: {type(e).__name__} on rank {rank}")
    ok(f"rank {last} failed in step {step}" in str(e), f"{what}: names rank and step: {e}")
    step += 1
    # The next step works everywhere.
    g = grads(sh, 1)
    s.sync(g)
    step += 1
ok(s.step == step, "every rank counted the same steps")
# The same through start().
g = grads(sh, 0)
arg = [g[0].astype(np.float64)] + g[1:] if rank == last else g
e = expect_error(lambda: (s.start(arg), s.wait(g)), None, "start with a float64 array")
ok(isinstance(e, TypeError if rank == last else gradsync.Error), "start: error on every rank")
s.sync(grads(sh, 2))
# wait() with a bad output keeps the result: calling again works.
g = grads(sh, 3)
s.start(g)
e = expect_error(lambda: s.wait(g[:2]), None, "wait with too few arrays")
ok(isinstance(e, ValueError), "wait: ValueError, local")
s.wait(g)
# A bad output on the last rank that is never retried: its next sync
# finishes the kept step (a RuntimeWarning), so it joins its peers in the
# next step instead of refusing it while they wait.
import warnings

g = grads(sh, 4)
s.start(g)
if rank == last:
    expect_error(lambda: s.wait(g[:1]), None, "wait with one array, not retried")
else:
    s.wait(g)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    s.sync(grads(sh, 5))
drained = [w for w in seen if issubclass(w.category, RuntimeWarning) and "discarded" in str(w.message)]
ok(len(drained) == (1 if rank == last else 0), f"the kept step is finished with a warning: {[str(w.message) for w in seen]}")
s.sync(grads(sh, 6))
# A generator of gradients is read once, whole (its first array used to be
# lost to the DLPack probe).
g = grads(sh, 7)
g_in = [x.copy() for x in g]
s.sync(x for x in g)
ok(any(not np.array_equal(x, y) for x, y in zip(g, g_in)), "a generator's arrays get the results")
# A float64 array's error names the argument and what was given.
g = grads(sh, 8)
arg = [g[0].astype(np.float64)] + g[1:] if rank == last else g
e = expect_error(lambda: s.sync(arg), None, "sync with a float64 array")
if rank == last:
    ok(str(e).startswith("gradient 0 (layer") and "got a ndarray of dtype float64" in str(e), f"type error text: {e}")
s.sync(grads(sh, 9))

# weight_decay: a rank that passes no weights fails the step on every rank
# (it used to raise alone while its peers waited in the step).
wd = gradsync.GradSync(comm, weight_decay=1e-4)
wd.register("a", (100,), strategy="dense")
wg, ww = [np.ones(100, np.float32)], [np.ones(100, np.float32)]
e = expect_error(lambda: wd.sync(wg) if rank == last else wd.sync(wg, weights=ww), None, "weight decay without weights")
ok(f"rank {last} failed in step 0" in str(e) and "no weights were given" in str(e), f"weight decay error: {e}")
wd.sync(wg, weights=ww)
ok(wd.step == 2, "the next step ran")
wd.close()

# A huge finite gradient on the last rank overflows its residual a step
# later: that step fails on every rank as non-finite input of that rank,
# and the steps after it run (the residual stayed infinite before).
hv = gradsync.GradSync(comm, momentum=0.9)
hv.register("h", (4096,), strategy="rgc:density=0.01")
outcomes = []
for t in range(5):
    g = np.ones(4096, np.float32)
    if rank == last and t == 1:
        g[:] = 3e38
    try:
        hv.sync([g])
        outcomes.append("ok")
    except gradsync.Error as e:
        outcomes.append(str(e))
ok(outcomes[0] == outcomes[1] == "ok" and outcomes[3:] == ["ok", "ok"], f"overflow: {outcomes}")
ok(f"rank {last}" in outcomes[2] and '"h"' in outcomes[2], f"overflow step names rank and layer: {outcomes[2]}")
hv.close()

# An unknown selection method is an error, not a free selection.
e = expect_error(lambda: gradsync.predict(elements=10**6, ranks=4, density=0.001, alpha=1e-5, bandwidth=1e9, select_method="zzz"), None, "predict with an unknown selection method")
ok("zzz" in str(e), f"select_method error: {e}")
# The two-level model from Python, as `gradsync predict --ranks-per-node`:
# the node-aware strategies appear only when ranks span nodes, a slow link
# between nodes costs the dense allreduce more, and errors name keywords.
net = dict(elements=10**6, ranks=16, density=0.001, alpha=5e-6, bandwidth=1e10)
one = gradsync.predict(**net)
two = gradsync.predict(**net, ranks_per_node=4, inter_alpha=2e-5, inter_bandwidth=1.25e8)
secs = lambda r: {s["name"]: s["seconds"] for s in r["strategies"]}
ok("sparse-hierarchical" in secs(two) and secs(two)["dense-rabenseifner"] > 5 * secs(one)["dense-rabenseifner"],
   f"two-level predict: {secs(one)} vs {secs(two)}")
ok(secs(gradsync.predict(**net, ranks_per_node=4, inter_alpha=2e-5, inter_bandwidth=1.25e8, fill=0.5))["sparse-allreduce"]
   < secs(two)["sparse-allreduce"], "a fill ratio below independent selections makes the sparse allreduce cheaper")
for kw, needle in [(dict(ranks_per_node=0), "ranks_per_node= 0"),
                   (dict(inter_alpha=1e-5), "ranks_per_node="),
                   (dict(ranks_per_node=32), "ranks_per_node= 32 is more than ranks= 16"),
                   (dict(density=0.0), "density= 0"),
                   (dict(ranks_per_node=4, fill=1.5), "fill= 1.5"),
                   (dict(strategies=["zzz"]), "strategies="),
                   # One range check with the command line's.
                   (dict(elements=0), "elements= 0: a layer of 0 elements, nothing to predict"),
                   (dict(alpha=-1.0), "alpha= -1: must be a finite number"),
                   (dict(bandwidth=0.0), "bandwidth= 0: must be a positive number")]:
    e = expect_error(lambda: gradsync.predict(**{**net, **kw}), None, f"predict with {kw}")
    ok(isinstance(e, ValueError) and needle in str(e) and "--" not in str(e), f"predict {kw}: {e}")
# PowerSGD from Python, where the profile prices its products: on the
# layer's shape (first dimension by the rest), else the squarest view.
import json
_prof = json.load(open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "scale", "profile-2x2-1gbit.json")))
_prof["powersgd"] = {"a": 0.0, "per_elem": 7e-10, "per_elem_rank": 7e-10}
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as _f:
    json.dump(_prof, _f)
conv = gradsync.predict(512 * 512 * 9, 64, profile=_f.name, shape=[512, 512, 3, 3], powersgd_rank=2)
ok(conv["powersgd_matrix"] == [512, 4608] and "powersgd" in secs(conv), f"predict shape=: {conv.get('powersgd_matrix')}")
ok(secs(conv)["powersgd"] < secs(gradsync.predict(512 * 512 * 9, 64, profile=_f.name, shape=[512, 512, 3, 3], powersgd_rank=8))["powersgd"],
   "a higher PowerSGD rank costs more")
ok(gradsync.predict(2359296, 64, profile=_f.name)["powersgd_matrix"] == [1536, 1536], "the squarest view without a shape")
e = expect_error(lambda: gradsync.predict(100, 64, profile=_f.name, shape=[10, 11]), None, "predict with a shape of other elements")
ok(isinstance(e, ValueError) and "shape= 10,11" in str(e) and "--" not in str(e), f"predict shape= mismatch: {e}")
os.unlink(_f.name)

# Mismatched layer tables fail on every rank.
t = gradsync.GradSync(comm)
t.register("x", (10,), strategy="dense")
if p > 1:
    e = expect_error(lambda: t.register("y", (11,) if rank == last else (12,), strategy="dense"), None, "tables differ")
    ok(isinstance(e, gradsync.Error) and "differs across ranks" in str(e), "table mismatch on every rank")
    e = expect_error(lambda: t.sync([np.zeros(10, np.float32)]), None, "after a table mismatch")
    ok(isinstance(e, gradsync.Error), "the engine stays failed after a mismatch")
# A bad strategy or shape on one rank.
u = gradsync.GradSync(comm)
e = expect_error(lambda: u.register("z", (10,), strategy="rgc:density=7" if rank == last else "dense"), None, "bad strategy")
ok(isinstance(e, ValueError if rank == last else gradsync.Error), "bad strategy: error on every rank")
e = expect_error(lambda: u.register("z", (10, -1) if rank == last else (10,), strategy="dense"), None, "bad shape")
ok(isinstance(e, TypeError if rank == last else gradsync.Error), "bad shape: error on every rank")
u.register("z", (10,), strategy="dense")  # the table is still consistent
u.sync([np.ones(10, np.float32)])
# A bad option on one rank.
e = expect_error(
    lambda: gradsync.GradSync(comm, **({"momentun": 0.9} if rank == last else {})), None, "bad option"
)
ok(isinstance(e, ValueError if rank == last else gradsync.Error), "bad option: error on every rank")
ok(f"rank {last} failed" in str(e), "bad option names the rank")
# An option that parses but is out of range on one rank.
e = expect_error(lambda: gradsync.GradSync(comm, momentum=1.5 if rank == last else 0.9), None, "momentum out of range")
ok(isinstance(e, ValueError if rank == last else gradsync.Error), "bad momentum: error on every rank")
ok(f"rank {last} failed" in str(e) and "momentum 1.5" in str(e), "bad momentum names the rank and value")
# The same bad argument on every rank (a script's bug): the same exception
# type on every rank, so that `except ValueError` takes the same path
# everywhere (each rank failed itself, not only the lowest).
e = expect_error(lambda: gradsync.GradSync(comm, momentum=1.5), None, "momentum out of range everywhere")
ok(isinstance(e, ValueError) and "rank 0 failed" in str(e), f"bad momentum everywhere: ValueError on every rank ({type(e).__name__})")
dup = gradsync.GradSync(comm)
e = expect_error(lambda: dup.register("", (10,), strategy="dense"), None, "empty name everywhere")
ok(isinstance(e, ValueError) and "name" in str(e), f"empty name everywhere: ValueError on every rank ({type(e).__name__})")
dup.register("a", (10,), strategy="dense")
e = expect_error(lambda: dup.register("a", (10,), strategy="dense"), None, "a name taken everywhere")
ok(isinstance(e, ValueError) and "same name" in str(e), f"duplicate name everywhere: ValueError on every rank ({type(e).__name__})")
# NaN in a dense layer: every rank raises (policy "error").
v = gradsync.GradSync(comm, momentum=0.0)
v.register("n", (100,), strategy="dense")
g = np.ones(100, np.float32)
if rank == last:
    g[7] = np.nan
e = expect_error(lambda: v.sync([g]), None, "NaN gradient")
ok(isinstance(e, gradsync.Error) and "non-finite" in str(e), "NaN raises on every rank")
ok(f'layer "n" from rank {last}' in str(e), f"a NaN in a dense layer names its rank: {e}")

# Wrong argument types on one rank (converted inside, so they still enter
# the collective): name, strategy, shape, snapshot path, profile.
w = gradsync.GradSync(comm)
for what, kw in [
    ("name is an int", dict(name=7)),
    ("strategy is None", dict(strategy=None)),
    ("shape is a float", dict(shape=2.5)),
    ("shape is None", dict(shape=None)),
]:
    args = dict(name="q", shape=(10,), strategy="dense")
    if rank == last:
        args.update(kw)
    if what == "strategy is None" and rank == last:
        args["strategy"] = 3
    e = expect_error(lambda: w.register(**args), None, what)
    ok(isinstance(e, TypeError if rank == last else gradsync.Error), f"{what}: error on every rank")
    ok(f"rank {last} failed" in str(e), f"{what}: names the rank")
# A layer no rank can allocate: an error on every rank, not an abort.
e = expect_error(lambda: w.register("huge", (2**40,), strategy="dense"), None, "huge layer")
ok(isinstance(e, ValueError) and "cannot allocate" in str(e), "a 4 TB layer is a ValueError on every rank")
w.register("q", np.int64(10), strategy="dense")  # numpy integers are shapes
w.register("r", (np.int32(2), 5))
w.sync([np.ones(10, np.float32), np.ones((2, 5), np.float32)])
e = expect_error(lambda: w.load_snapshot(123 if rank == last else "/nonexistent/x.snap"), None, "load path type")
ok(isinstance(e, TypeError if rank == last else gradsync.Error), "load_snapshot: a bad path type fails every rank")
# The other ranks' own snapshots are good: every rank reads the one
# rank's cause (not a file name made of it).
with tempfile.TemporaryDirectory() as d:
    mine = os.path.join(d, f"w{rank}.snap")
    w.save_snapshot(mine)
    e = expect_error(lambda: w.load_snapshot(123 if rank == last else mine), None, "load path type, good peers")
    ok(("a path must be str, bytes or os.PathLike, got int" in str(e) and "\\x00" not in str(e)
        and "NUL" not in str(e) and (p == 1 or f"rank {last} failed" in str(e))),
       f"load_snapshot: the bad path type named on every rank: {e}")
e = expect_error(
    lambda: gradsync.GradSync(comm, profile=42 if rank == last else None), None, "profile is an int"
)
ok(isinstance(e, TypeError if rank == last else gradsync.Error) and f"rank {last} failed" in str(e), "profile type")
e = expect_error(lambda: gradsync.GradSync(comm, profile={"alpha": -1.0}), None, "profile dict is checked")
ok(isinstance(e, ValueError) and "profile" in str(e), "an inline profile gets a file's checks")
# numpy scalars as options, a density warm-up schedule, weight decay.
x = gradsync.GradSync(comm, momentum=np.float32(0.5), warmup_steps=np.int64(0),
                      warmup={"warmup": "density", "schedule": [0.5, 0.1], "steps_per_stage": 1},
                      weight_decay=0.01)
x.register("wd", (100,), strategy="dense")
g, wt = np.ones(100, np.float32), np.full(100, 2.0, np.float32)
e = expect_error(lambda: x.sync([g]), None, "weight decay without weights")
x.sync([g], weights=[wt])
ok(np.allclose(g, 1.0 + 0.01 * 2.0), f"weight decay applied: {g[0]}")
# fail_step: a rank whose backward pass raised takes part in the step.
y = gradsync.GradSync(comm, momentum=0.0)
y.register("a", (8,), strategy="dense")
if rank == last:
    e = expect_error(lambda: y.fail_step("ZeroDivisionError: in backward"), None, "fail_step")
else:
    e = expect_error(lambda: y.sync([np.ones(8, np.float32)]), None, "peer of fail_step")
ok(isinstance(e, gradsync.Error) and f"rank {last} failed in step 0" in str(e) and "backward" in str(e), "fail_step")
g = np.full(8, float(rank), np.float32)
y.sync([g])
ok(g[0] == (p - 1) / 2, "the step after fail_step runs")

# Another thread may read the engine (or call sync) while one syncs: no
# deadlock on the engine's lock (it is never awaited with the GIL held).
z = gradsync.GradSync(comm, momentum=0.0, overlap=False)
z.register("big", (1 << 21,), strategy="rgc:density=0.01")
steps_seen = []
done = threading.Event()


def reader():
    while not done.is_set():
        steps_seen.append(z.step)


th = threading.Thread(target=reader)
th.start()
for _ in range(3):
    z.sync([np.ones(1 << 21, np.float32)])
done.set()
th.join(timeout=30)
ok(not th.is_alive() and len(steps_seen) > 0, "a reader thread ran beside sync")

# 3b. Found by hostile testing (2026-11-25).
# load_snapshot on a rank that kept a step (its wait() raised and was not
# retried) finishes that step first, as sync does: it refused alone while
# its peers waited in the restore's agreement.
ls = gradsync.GradSync(comm, momentum=0.9)
ls.register("a", (10,), strategy="dense")
lg = [np.ones(10, np.float32)]
ls.sync(lg)
snapdir = comm.bcast(tempfile.mkdtemp(prefix="gs_pending_") if rank == 0 else None)
snap = os.path.join(snapdir, f"r{rank}.snap")
ls.save_snapshot(snap)
ls.start(lg)
if rank == last:
    expect_error(lambda: ls.wait([]), None, "wait with no arrays, not retried")
else:
    ls.wait(lg)
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    ls.load_snapshot(snap)
ok(ls.step == 1, f"restored to step 1 on every rank (step {ls.step})")
ls.sync(lg)
ls.close()
os.remove(snap)
comm.Barrier()
if rank == 0:
    os.rmdir(snapdir)
# Arrays that reach the same memory through different owners (numpy's
# borrow flags see only views of one base): refused on every rank, not one
# layer's result written over another's.
al = gradsync.GradSync(comm, momentum=0.0)
al.register("a", (8,), strategy="dense")
al.register("b", (8,), strategy="rgc:density=0.25")
buf = np.arange(12, dtype=np.float32)
for how, alias in [
    ("DLPack", lambda: np.from_dlpack(buf[4:12])),
    ("frombuffer", lambda: np.frombuffer(memoryview(buf[4:12]), dtype=np.float32)),
]:
    pair = [buf[0:8], alias()] if rank == last else [np.zeros(8, np.float32), np.zeros(8, np.float32)]
    e = expect_error(lambda: al.sync(pair), None, f"overlapping arrays ({how})")
    ok(isinstance(e, ValueError if rank == last else gradsync.Error) and "share memory" in str(e), f"{how} alias: {e}")
# start() only reads: overlapping inputs are fine there.
al.start([buf[0:8], buf[4:12]])
al.wait([np.zeros(8, np.float32), np.zeros(8, np.float32)])
# A weight that reaches a gradient's memory through another owner.
wo = gradsync.GradSync(comm, momentum=0.0, weight_decay=1e-4)
wo.register("a", (8,), strategy="dense")
wg = [np.ones(8, np.float32)]
ww = [np.frombuffer(memoryview(wg[0]), dtype=np.float32)] if rank == last else [np.ones(8, np.float32)]
e = expect_error(lambda: wo.sync(wg, weights=ww), None, "a weight over a gradient")
ok("weight 0 and gradient 0 share memory" in str(e), f"weight over gradient: {e}")
wo.close()


# A legacy DLPack producer (no max_version): numpy imports it read-only, so
# the engine's own importer takes it, in place.
class Legacy:
    def __init__(self, a):
        self.a = a

    def __dlpack__(self, stream=None):
        return self.a.__dlpack__()

    def __dlpack_device__(self):
        return self.a.__dlpack_device__()


lgs = gradsync.GradSync(comm, momentum=0.0)
lgs.register("a", (8,), strategy="dense")
lx = np.full(8, float(rank + 1), np.float32)
lgs.sync([Legacy(lx)])
ok(np.allclose(lx, sum(r + 1 for r in range(p)) / p), f"legacy DLPack tensor synced in place: {lx}")
lgs.close()
# Sequences other than lists (UserList, deque) carry tensors to start().
import collections

al.start(collections.deque([np.ones(8, np.float32), np.ones(8, np.float32)]))
al.wait(collections.UserList([np.ones(8, np.float32), np.ones(8, np.float32)]))
al.close()
# Options: NaN named by its option; the engine's spelling non_finite works;
# a negative weight decay and an empty density warm-up are refused.
for kw, needle in [
    (dict(momentum=float("nan")), "option 'momentum': nan is not a finite number"),
    (dict(weight_decay=-1.0), "weight_decay -1 must be finite and not negative"),
    (dict(warmup={"warmup": "density", "schedule": [], "steps_per_stage": 1}), "a schedule of one or more"),
    (dict(momentum=0.99999999), "rounds to 1 in single precision"),
]:
    e = expect_error(lambda: gradsync.GradSync(comm, **kw), None, f"option {kw}")
    ok(needle in str(e), f"{kw}: {e}")
nf = gradsync.GradSync(comm, non_finite="propagate")
nf.close()
e = expect_error(lambda: gradsync.GradSync(comm, nonfinite="error", non_finite="propagate"), None, "both, one default-valued")
ok("not both" in str(e), f"both spellings: {e}")
e = expect_error(lambda: gradsync.GradSync(comm, nonfinite="propagate", non_finite="error"), None, "both spellings")
ok("not both" in str(e), f"both spellings: {e}")
# allreduce: "auto" is no algorithm of a call; a list is named as a list.
e = expect_error(lambda: gradsync.allreduce(comm, np.ones(4, np.float32), algo="auto"), None, "algo auto")
ok(isinstance(e, ValueError) and "engine option" in str(e), f"algo auto: {e}")
e = expect_error(lambda: gradsync.allreduce(comm, [1.0, 2.0]), None, "a list to allreduce")
ok(isinstance(e, TypeError) and "got a list" in str(e), f"a list: {e}")

# 4. The GIL is released while gradsync communicates.
big = gradsync.GradSync(comm, momentum=0.0, overlap=False)
big.register("big", (1 << 22,), strategy="rgc:density=0.01")
counter = [0]
stop = threading.Event()


def spin():
    while not stop.is_set():
        counter[0] += 1


th = threading.Thread(target=spin)
th.start()
time.sleep(0.05)
g = [np.ones(1 << 22, np.float32)]
best = 0
for _ in range(3):
    c0, t0 = counter[0], time.perf_counter()
    big.sync(g)
    best = max(best, counter[0] - c0)
stop.set()
th.join()
ok(best > 1000, f"another Python thread ran during sync ({best} increments)")

# 5. No lock held across a GIL wait or a user callback.
# close() from another thread while a step runs (it waited for the engine's
# lock with the GIL held while the stepping thread needed the GIL: the
# process hung, every peer with it).
# On a communicator of this rank alone: the hang needs no peer, and a close
# that wins the race against the step's start leaves no peer waiting.
solo = comm.Split(rank, 0)
eng = gradsync.GradSync(solo, momentum=0.0)
eng.register("big", (1 << 22,), strategy="rgc:density=0.01")
errs = []
entered = threading.Event()


def steps():
    entered.set()
    try:
        for _ in range(20):
            eng.sync([np.ones(1 << 22, np.float32)])
    except gradsync.Error as e:
        errs.append(e)


th = threading.Thread(target=steps)
th.start()
entered.wait()
time.sleep(0.05)
# close() waits, without the GIL, for the step in flight.
t0 = time.perf_counter()
eng.close()
th.join(60)
ok(not th.is_alive(), f"close() during a step from another thread returned ({time.perf_counter() - t0:.2f} s)")
ok(len(errs) == 1 and "closed" in str(errs[0]), f"the next step found the engine closed: {errs[:1]}")
solo.Free()
comm.Barrier()

# A warnings hook that reads the engine while gradsync warns (it warned
# with its lock held: the hook spun for ever).
import warnings

eng = gradsync.GradSync(comm, momentum=0.0)
eng.register("w", (100,), strategy="dense")
seen = []
old_hook = warnings.showwarning
warnings.showwarning = lambda msg, *a, **k: seen.append((str(msg), eng.step))
try:
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda msg, *a, **k: seen.append((str(msg), eng.step))
        eng.start([np.ones(100, np.float32)])
        # wait() skipped: the next sync finishes that step first and warns.
        eng.sync([np.ones(100, np.float32)])
finally:
    warnings.showwarning = old_hook
ok(len(seen) == 1 and "did not complete" in seen[0][0] and seen[0][1] == 1,
   f"a warnings hook read the engine while gradsync warned: {seen}")
eng.close()

comm.Barrier()
print(f"rank {rank}: OK {checks} checks", flush=True)
