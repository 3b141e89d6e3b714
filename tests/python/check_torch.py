#!/usr/bin/env python3
"""Check gradsync.torch (DistributedOptimizer, broadcast_parameters) under mpirun.

    hpc/mpirun.sh -np 2 python3 -m mpi4py tests/python/check_torch.py
    hpc/mpirun.sh -np 4 python3 -m mpi4py tests/python/check_torch.py

Without PyTorch it checks that ``import gradsync.torch`` works and that using
the wrappers raises a clear ImportError, prints a SKIP line and exits 0.
With PyTorch it trains a tiny ``torch.nn.Linear`` for 20 steps on synthetic
data, each rank on its shard of every global batch, and checks that

(a) the parameters are bit-identical on every rank (allgather of a CRC-32),
(b) with every layer ``"dense"``, gradsync momentum 0 and torch SGD, the
    parameters equal a single-process SGD on the whole global batch (up to
    float32 rounding) and the loss went down,
(c) the gradients were modified in place: same storage pointer before and
    after ``step()``, and holding the average of the ranks' gradients;

plus ``broadcast_parameters`` (different initial values become rank 0's),
RedSync-style use (gradsync momentum 0.9, a sparse layer, plain SGD) keeping
the ranks identical, and a bad gradient on one rank raising there and
``gradsync.Error`` on the others without hanging. Prints ``OK`` on rank 0;
any failure raises (``-m mpi4py`` then aborts the job with a non-zero status).
"""

import sys
import zlib

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()

try:
    import torch
except ImportError:
    import gradsync.torch as gst  # must import without torch

    for what, call in (
        ("DistributedOptimizer", lambda: gst.DistributedOptimizer(None, [])),
        ("broadcast_parameters", lambda: gst.broadcast_parameters([])),
    ):
        try:
            call()
        except ImportError as e:
            assert "PyTorch" in str(e) and "not installed" in str(e), f"unclear ImportError: {e}"
        else:
            raise AssertionError(f"{what} without torch did not raise ImportError")
    if rank == 0:
        print("SKIP: torch is not installed (gradsync.torch tested where torch is importable)")
    sys.exit(0)

import gradsync  # noqa: E402
import gradsync.torch as gst  # noqa: E402


def checksum(module) -> int:
    crc = 0
    for t in module.state_dict().values():
        crc = zlib.crc32(t.detach().contiguous().numpy().tobytes(), crc)
    return crc


def assert_identical(module, what: str) -> None:
    crcs = comm.allgather(checksum(module))
    assert all(c == crcs[0] for c in crcs), f"{what}: parameters differ across ranks: {crcs}"


torch.manual_seed(1234 + rank)  # different on purpose: broadcast_parameters must fix it
N_IN, N_OUT, PER_RANK, STEPS, LR = 8, 3, 4, 20, 0.1
gen = torch.Generator().manual_seed(7)  # the same data on every rank
X = torch.randn(STEPS, size * PER_RANK, N_IN, generator=gen)
W_TRUE = torch.randn(N_IN, N_OUT, generator=gen)
Y = X @ W_TRUE + 0.01 * torch.randn(STEPS, size * PER_RANK, N_OUT, generator=gen)
shard = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
mse = torch.nn.functional.mse_loss

# --- broadcast_parameters -------------------------------------------------
model = torch.nn.Linear(N_IN, N_OUT)
gst.broadcast_parameters(model.state_dict(), root=0)
assert_identical(model, "after broadcast_parameters")

# --- (a), (b), (c): all dense, gradsync momentum 0, torch SGD -------------
reference = torch.nn.Linear(N_IN, N_OUT)
reference.load_state_dict(model.state_dict())
ref_opt = torch.optim.SGD(reference.parameters(), lr=LR)
opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(), strategy="dense")
assert [layer[2] for layer in opt.sync.layers()] == ["dense", "dense"], opt.sync.layers()
assert opt.param_groups is opt.optimizer.param_groups
with torch.no_grad():
    loss0 = float(mse(model(X.reshape(-1, N_IN)), Y.reshape(-1, N_OUT)))
for step in range(STEPS):
    opt.zero_grad()
    mse(model(X[step, shard]), Y[step, shard]).backward()
    params = list(model.parameters())
    ptrs = [p.grad.data_ptr() for p in params]
    expected = []
    for p in params:  # the average of the ranks' gradients, computed with mpi4py
        g = p.grad.detach().numpy().astype(np.float64)
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
        expected.append(g / size)
    opt.step()
    for p, ptr, exp in zip(params, ptrs, expected):
        assert p.grad.data_ptr() == ptr, "(c) the gradient was replaced, not modified in place"
        np.testing.assert_allclose(p.grad.numpy(), exp, rtol=1e-5, atol=1e-6,
                                   err_msg="(c) the gradient is not the ranks' average")
    assert opt.last_stats is not None and opt.last_stats["step"] == step
    ref_opt.zero_grad()
    mse(reference(X[step]), Y[step]).backward()  # the whole global batch in one process
    ref_opt.step()
    assert_identical(model, f"(a) step {step}")
for p, q in zip(model.parameters(), reference.parameters()):
    np.testing.assert_allclose(p.detach().numpy(), q.detach().numpy(), rtol=1e-4, atol=1e-5,
                               err_msg="(b) differs from single-process SGD on the averaged gradient")
with torch.no_grad():
    loss1 = float(mse(model(X.reshape(-1, N_IN)), Y.reshape(-1, N_OUT)))
assert loss1 < 0.5 * loss0, f"(b) the loss did not go down: {loss0} -> {loss1}"
state = opt.state_dict()
opt.load_state_dict(state)
opt.close()

# --- RedSync-style: gradsync momentum, a sparse layer, plain SGD -----------
torch.manual_seed(99)
big = torch.nn.Sequential(torch.nn.Linear(N_IN, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                          torch.nn.ReLU(), torch.nn.Linear(256, N_OUT))
unused = torch.nn.Parameter(torch.zeros(5))  # never gets a .grad: zeros are synchronized
named = list(big.named_parameters()) + [("unused", unused)]
strategies = {"2.weight": "rgc:density=0.01"}
opt = gst.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=0.01), named,
                               strategy=strategies, momentum=0.9, warmup_steps=2)
layers = {name: strat for name, _shape, strat in opt.sync.layers()}
assert layers["2.weight"] == "rgc", layers
with torch.no_grad():
    l0 = float(mse(big(X.reshape(-1, N_IN)), Y.reshape(-1, N_OUT)))
for step in range(STEPS):
    opt.zero_grad()
    mse(big(X[step, shard]), Y[step, shard]).backward()
    opt.step()
    assert unused.grad is not None
assert_identical(big, "RedSync-style run")
with torch.no_grad():
    l1 = float(mse(big(X.reshape(-1, N_IN)), Y.reshape(-1, N_OUT)))
assert l1 < l0, f"RedSync-style run: the loss did not go down: {l0} -> {l1}"
opt.close()

# --- a bad gradient on one rank fails that step everywhere, no hang --------
bad_rank = size - 1
p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float64 if rank == bad_rank else torch.float32))
opt = gst.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), [("p", p)], strategy="dense")
p.grad = torch.ones_like(p)
try:
    opt.step()
except ValueError as e:
    assert rank == bad_rank and "float32" in str(e), (rank, e)
except gradsync.Error:
    assert rank != bad_rank, rank
else:
    raise AssertionError("a float64 gradient did not fail the step")
opt.close()

# --- torch tensors straight to GradSync (DLPack views, in place) ----------
eng = gradsync.GradSync(comm, momentum=0.0)
eng.register("t", (6, 5), strategy="dense")
t = torch.full((6, 5), float(rank + 1))
ptr = t.data_ptr()
eng.sync([t])
assert t.data_ptr() == ptr and float(t[0, 0]) == (size + 1) / 2, (float(t[0, 0]), size)
x = torch.arange(10, dtype=torch.float64) * (rank + 1)
gradsync.allreduce(comm, x, algo="ring")
assert float(x[3]) == 3 * size * (size + 1) / 2, float(x[3])
# One tensor passed twice: each DLPack view has its own owner, so numpy's
# borrow flags cannot see it; refused on every rank, not one result lost.
eng.close()
eng = gradsync.GradSync(comm, momentum=0.0)
eng.register("a", (4,), strategy="dense")
eng.register("b", (4,), strategy="dense")
t = torch.zeros(4)
try:
    eng.sync([t, t] if rank == bad_rank else [torch.zeros(4), torch.zeros(4)])
except ValueError as e:
    assert rank == bad_rank and "share memory" in str(e), (rank, e)
except gradsync.Error as e:
    assert rank != bad_rank and "share memory" in str(e), (rank, e)
else:
    raise AssertionError("a tensor passed twice was accepted")
eng.close()

# A closure that raises on one rank fails the step on every rank.
p = torch.nn.Parameter(torch.zeros(4))
opt = gst.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), [("p", p)], strategy="dense")


def closure():
    if rank == bad_rank:
        raise RuntimeError("backward failed")
    p.grad = torch.ones_like(p)
    return 0.0


try:
    opt.step(closure)
except gradsync.Error as e:  # before RuntimeError: gradsync.Error is one
    assert rank != bad_rank and "the closure raised" in str(e), (rank, e)
except RuntimeError as e:
    assert rank == bad_rank and "backward failed" in str(e), (rank, e)
else:
    raise AssertionError("a closure that raised did not fail the step")
p.grad = torch.ones_like(p)
opt.step()  # the next step runs on every rank
opt.close()

# A model with one parameter fewer on one rank (a frozen last layer), and a
# given engine whose table does not match on one rank: errors on every rank
# in the constructor, not a rank that returns while the others register.
m = torch.nn.Linear(3, 2, bias=(rank != bad_rank or size == 1))
try:
    gst.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters())
except ValueError as e:
    assert size > 1 and "different numbers of parameters" in str(e), e
else:
    assert size == 1, "parameter counts that differ were accepted"
eng = gradsync.GradSync(comm, momentum=0.0)
eng.register("w", (4,), strategy="dense")
w = torch.nn.Parameter(torch.zeros(5 if rank == bad_rank else 4))
try:
    gst.DistributedOptimizer(torch.optim.SGD([w], lr=0.1), [("w", w)], sync=eng)
except ValueError as e:
    assert rank == bad_rank and "does not match" in str(e), (rank, e)
except gradsync.Error as e:
    assert rank != bad_rank and f"rank {bad_rank} failed" in str(e), (rank, e)
else:
    raise AssertionError("a mismatched given engine was accepted")
eng.close()

# broadcast_parameters: a tensor that cannot take the bytes (an expanded
# view) on one rank raises on every rank before anything is broadcast.
c0 = torch.full((4,), float(rank))
tensors = {"b": torch.full((1,), 2.0).expand(4) if rank == bad_rank else torch.zeros(4), "c": c0}
try:
    gst.broadcast_parameters(tensors)
except ValueError as e:
    # The bad rank raises its own error; its peers name it and its reason.
    assert "expanded" in str(e), (rank, e)
    assert (f"rank {bad_rank} failed" in str(e)) == (rank != bad_rank), (rank, e)
else:
    raise AssertionError("an expanded view was accepted")
assert float(c0[0]) == float(rank), "nothing was broadcast"

comm.Barrier()
if rank == 0:
    print(f"OK: gradsync.torch on {size} rank(s), torch {torch.__version__}")
