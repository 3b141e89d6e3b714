"""SBC's communication delay without drift, as a training loop uses it (run
by tests/python.rs under mpirun with a time limit, p = 2 and 3): with
delay = 3, a dense and two sparse layers, momentum, and a learning rate that
changes every step (a warm-up, then a decay), every rank's weights are the
same bit for bit after every communicating step; they differ in between
(each rank's own local steps). A delayed step without the weights, or with
read-only weights, raises on every rank, saying why, and the run goes on;
a communicating step's result lost on one rank fails every rank's next step.
Each rank prints "rank R: OK <n> checks" at the end.
"""

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


shapes = {"bias": (16,), "fc": (40, 25), "emb": (300,)}
specs = {"bias": "dense", "fc": "rgc:density=0.05", "emb": "rgc:density=0.1"}
for momentum in (0.0, 0.9):
    s = gradsync.GradSync(comm, delay=3, momentum=momentum)
    for name, shape in shapes.items():
        s.register(name, shape, strategy=specs[name])
    w = [np.full(shape, 0.5, np.float32) for shape in shapes.values()]
    rng = np.random.default_rng(100 + rank)
    apart = 0
    for step in range(12):
        lr = np.float32(0.05 * min(1.0 + step, 4.0) / (1.0 + 0.1 * step))
        g = [rng.standard_normal(shape).astype(np.float32) for shape in shapes.values()]
        st = s.sync(g, weights=w)
        for wi, gi in zip(w, g):
            wi -= lr * gi
        every = comm.allgather(b"".join(x.tobytes() for x in w))
        same = all(x == every[0] for x in every)
        if st["communicated"]:
            ok(same, f"m {momentum} step {step}: the ranks' weights differ after a communicating step")
        else:
            apart += not same
    ok(step % 3 == 2 and st["communicated"], f"m {momentum}: the last step communicated")
    ok(p == 1 or apart >= 4, f"m {momentum}: the local steps never differed ({apart})")

    # Without the weights, or with read-only ones: every rank raises.
    g = [np.ones(shape, np.float32) for shape in shapes.values()]
    for what, call in [
        ("no weights", lambda: s.sync(g)),
        ("read-only weights", lambda: s.sync(g, weights=[x.copy() for x in w] if rank else ro)),
    ]:
        ro = [x.copy() for x in w]
        for x in ro:
            x.flags.writeable = False
        try:
            call()
            ok(False, f"{what}: no error")
        except (gradsync.Error, ValueError) as e:
            text = str(e)
            if what == "no weights":
                ok("delay > 1 needs the weights" in text, f"{what}: {text}")
            else:
                ok("rank 0 failed" in text and "weight 0 cannot be written" in text, f"{what}: {text}")
    st = s.sync(g, weights=w)
    ok(st["step"] == 14, f"the run goes on: step {st['step']}")
    s.close()

# A communicating step's result lost on one rank after its weights were
# written back (its wait refused a bad output, then the next sync discarded
# the kept result): every rank's next step raises, naming that rank, and no
# rank waits for another.
last = p - 1
s = gradsync.GradSync(comm, delay=2)
s.register("w", (8,), strategy="dense")
w = [np.full(8, 0.5, np.float32)]
s.sync([np.ones(8, np.float32)], weights=w)  # step 0, local
if rank == last:
    s.start([np.ones(8, np.float32)], weights=w)  # step 1 communicates
    try:
        s.wait([np.ones(7, np.float32)])
        ok(False, "a bad output was accepted")
    except ValueError:
        pass
else:
    s.sync([np.ones(8, np.float32)], weights=w)
try:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        s.sync([np.ones(8, np.float32)], weights=w)
    ok(False, "the step after a lost result ran")
except gradsync.Error as e:
    ok(f"was discarded on rank {last}" in str(e), f"lost result: {e}")
s.close()

print(f"rank {rank}: OK {checks} checks", flush=True)
