"""Ranks that make different gradsync calls fail alike, within seconds, instead
of waiting in two different collectives (run by tests/python.rs under mpirun
with a time limit, p = 2 and 3). The last rank makes another call than the
others; every rank must raise gradsync.Error naming both calls.

Cases: the resume pattern whose snapshot exists on some ranks only
(load_snapshot against the first step, and against a later step), a layer
registered after the first step on one rank, complete_table and the first
step against load_snapshot, close() against a step. Each rank prints "rank R: OK <n> checks" at the end.
"""

import os
import sys
import tempfile

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


def engine():
    s = gradsync.GradSync(comm, momentum=0.0)
    s.register("w", (64,), strategy="dense")
    s.register("v", (4096,), strategy="rgc:density=0.01")
    return s


def grads(step):
    return [np.full(64, rank + step, np.float32), np.arange(4096, dtype=np.float32) * (rank + 1)]


def both_calls_named(e, mine, theirs, what):
    """The error every rank sees: gradsync.Error naming rank 0's call and the last rank's."""
    print(f"rank {rank}: {what}: {type(e).__name__}: {e}", flush=True)
    text = str(e)
    ok(isinstance(e, gradsync.Error), f"{what}: gradsync.Error, not {type(e).__name__}")
    ok("the call differs across ranks" in text, f"{what}: names the calls: {text}")
    ok(f"rank 0 is in {mine}" in text and f"rank {last} in {theirs}" in text, f"{what}: {text}")


def raises(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError(f"rank {rank}: no exception")


tmp = comm.bcast(tempfile.mkdtemp(prefix="gradsync-calls-") if rank == 0 else None)
path = os.path.join(tmp, f"snap.{rank}")
# A snapshot of step 1 on every rank but the last (its file is lost).
with engine() as s:
    s.sync(grads(0))
    if rank != last:
        s.save_snapshot(path)
comm.Barrier()

# 1. Resuming: `if os.path.exists(path): load_snapshot(path)`, then the step.
with engine() as s:
    def resume_then_step():
        if os.path.exists(path):
            s.load_snapshot(path)
        s.sync(grads(1))

    e = raises(resume_then_step)
    both_calls_named(e, "a restore", "step 0", "resume with one snapshot missing")

# 2. The same after a step: restore against step 1.
with engine() as s:
    s.sync(grads(0))

    def later():
        if rank != last:
            s.load_snapshot(path)
        else:
            s.sync(grads(1))

    e = raises(later)
    both_calls_named(e, "a restore", "step 1", "restore against a later step")
    # Every rank is still in step: the same call everywhere works.
    s.sync(grads(2))
    ok(s.step == 2, f"a step after the mismatch runs everywhere (step {s.step})")

# 3. A layer registered after the first step on the last rank only.
with engine() as s:
    s.sync(grads(0))

    def late_register():
        if rank == last:
            s.register("late", (8,), strategy="dense")
        else:
            s.sync(grads(1))

    e = raises(late_register)
    print(f"rank {rank}: late register: {type(e).__name__}: {e}", flush=True)
    ok(isinstance(e, gradsync.Error), f"late register: gradsync.Error, not {type(e).__name__}")
    ok("the call differs across ranks" in str(e) and "register" in str(e), f"late register: {e}")

# 4. complete_table then the first step, against load_snapshot: the table
# check is one agreement for both (it passes), then the step meets the restore.
with engine() as s:
    def complete_or_load():
        if rank == last:
            s.load_snapshot(os.path.join(tmp, "snap.0"))
        else:
            s.complete_table()
            s.sync(grads(0))

    e = raises(complete_or_load)
    both_calls_named(e, "step 0", "a restore", "complete_table and a step against load_snapshot")

# 5. close() on the last rank while the others step: both calls named, and
# every engine stays open and in step.
with engine() as s:
    s.sync(grads(0))

    def close_or_step():
        if rank == last:
            s.close()
        else:
            s.sync(grads(1))

    e = raises(close_or_step)
    both_calls_named(e, "step 1", "close", "close against a step")
    s.sync(grads(1))
    ok(s.step == 2, f"a step after close's mismatch runs everywhere (step {s.step})")

comm.Barrier()
if rank == 0:
    for f in os.listdir(tmp):
        os.remove(os.path.join(tmp, f))
    os.rmdir(tmp)
print(f"rank {rank}: OK {checks} checks", flush=True)
sys.stdout.flush()
