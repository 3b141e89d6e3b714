#!/usr/bin/env python3
"""Check gradsync's DDP comm hook and half-precision gradients under mpirun.

    hpc/mpirun.sh -np 3 .venv/bin/python -m mpi4py tests/python/check_torch_hook.py

Needs PyTorch (prints ``SKIP: ...`` on rank 0 and exits 0 without it; the
test runner refuses that skip where torch must be installed). Checks, each
printing a line on rank 0:

(a) DDP over gloo with ``gradsync_hook`` (dense, rgc, auto, PowerSGD; several buckets,
    so DDP's bucket rebuild after the first iteration is crossed) gives the
    parameters, bit for bit, of a plain model whose gradients go through the
    whole-step engine (``GradSync.sync``) with the same options;
(b) ``no_sync()`` gradient accumulation, and ``find_unused_parameters=True``
    with a branch unused on some steps, equal that reference too;
(c) a bfloat16 model under DDP and a float16 model under
    ``DistributedOptimizer``: each gradient is the float32 engine's result on
    the widened gradients rounded once to its dtype (bit for bit), and within
    the bound of ``docs/pytorch.md`` of a float64 average; a table mixing
    numpy float16 and float32 arrays likewise;
(d) a hook input that differs on one rank (a parameter missing from its
    buckets; a float64 bucket) fails every rank's futures within seconds,
    naming the rank, and the next step works;
(e) the overlapping ``DistributedOptimizer`` (several buckets, one and two
    backward passes per step) gives the whole-step engine's parameters bit
    for bit (dense, rgc with gradsync's momentum, auto), starts buckets
    before backward reaches the first layer, and refuses ``zero_grad()``
    while buckets are in flight;
(f) a closure that raises on one rank after backward fails the overlapped
    step on every rank; a non-contiguous gradient and a
    zero-element parameter give the whole step's results.
"""

import copy
import sys
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
last = size - 1

try:
    import torch
except ImportError:
    if rank == 0:
        print("SKIP: torch is not installed (the DDP hook is tested where torch is importable)")
    sys.exit(0)

import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradsync  # noqa: E402
import gradsync.torch as gst  # noqa: E402

torch.set_num_threads(1)
# Rank 0's store binds a port of the kernel's choosing and keeps it (a port
# found free and closed again can be taken before the store binds it:
# EADDRINUSE in CI); the others connect to it.
store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False) if rank == 0 else None
port = comm.bcast(store.port if rank == 0 else None, root=0)
if rank != 0:
    store = dist.TCPStore("127.0.0.1", port, size, False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=size)


def say(text: str) -> None:
    comm.Barrier()
    if rank == 0:
        print(text, flush=True)


class Net(nn.Module):
    """Convolution and linear layers; fc1 (36 864 weights) is large enough
    for ``auto`` to make it sparse without a profile."""

    def __init__(self, side: bool = False) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, 256)
        self.fc2 = nn.Linear(256, 10)
        # A branch used only on some steps (find_unused_parameters=True).
        self.side = nn.Linear(256, 10) if side else None

    def forward(self, x, use_side: bool = False):
        h = F.relu(self.fc1(F.relu(self.conv(x)).flatten(1)))
        out = self.fc2(h)
        return out + self.side(h) if use_side else out


def batch(step: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own shard
    x = torch.randn(8, 1, 8, 8, generator=g).to(dtype)
    y = torch.randint(0, 10, (8,), generator=g)
    return x, y


def bits(t):
    return t.detach().reshape(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same_bits(a, b) -> bool:
    return all(torch.equal(bits(p), bits(q)) for p, q in zip(a.parameters(), b.parameters()))


def reference_engine(model, strategy, **options):
    options.setdefault("momentum", 0.0)
    eng = gradsync.GradSync(comm, **options)
    for name, p in model.named_parameters():
        eng.register(name, tuple(p.shape), strategy=strategy)
    return eng


def reference_sync(eng, model, weights=False):
    grads = []
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    # numpy views of the parameters: a delay writes them back.
    eng.sync(grads, [p.detach().numpy() for p in model.parameters()] if weights else None)


def ddp_pair(strategy, cap_mb=0.05, find_unused=False, momentum=0.9, overlap=True, **options):
    torch.manual_seed(5)
    model = Net(side=find_unused)
    ref = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=cap_mb, find_unused_parameters=find_unused)
    state = gst.GradSyncHookState(model.named_parameters(), strategy=strategy, bucket_cap_mb=cap_mb,
                                  overlap=overlap, **options)
    assert state.overlap == overlap, (state.overlap, overlap)
    ddp.register_comm_hook(state, gst.gradsync_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=momentum)
    return model, ddp, state, opt, ref, ref_opt, reference_engine(ref, strategy, **options)


# --- (a) the hook equals the whole-step engine, bit for bit ---------------
for strategy, overlap in [("dense", True), ("rgc:density=0.05", True), ("auto", True),
                          ("powersgd:rank=2,start=2", True), ("dense", False), ("auto", False)]:
    model, ddp, state, opt, ref, ref_opt, eng = ddp_pair(strategy, overlap=overlap)
    for step in range(6):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        ref_opt.zero_grad()
        F.cross_entropy(ref(x), y).backward()
        reference_sync(eng, ref)
        ref_opt.step()
        assert same_bits(model, ref), f"(a) {strategy} step {step}: the hook differs from the whole-step engine"
    assert state.steps == 6 and state.last_stats["step"] == 5, (state.steps, state.last_stats)
    assert state.buckets > 1, f"(a) one bucket: the multi-bucket path was not crossed ({state.buckets})"
    if overlap:
        # Run bucket by bucket in the engine, not staged (PowerSGD too).
        assert state.last_stats["buckets"] > 1, (strategy, state.last_stats["buckets"])
    buckets = state.buckets
    kinds = [layer[2] for layer in state.sync.layers()]
    assert kinds == [layer[2] for layer in eng.layers()], kinds
    if strategy == "auto":
        assert any(k.startswith("rgc") for k in kinds) and "dense" in kinds, kinds
    state.close()
    eng.close()
    ours = len(state.sync.buckets) if overlap else 1
    say(f"(a) hook == whole-step engine, bit for bit, 6 steps: {strategy}, overlap={overlap} "
        f"(layers {kinds}, {buckets} DDP buckets, {ours} gradsync buckets) OK")

# --- (b) no_sync accumulation; find_unused_parameters ---------------------
for strategy in ["dense", "rgc:density=0.05"]:
    model, ddp, state, opt, ref, ref_opt, eng = ddp_pair(strategy)
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(3):  # two local backward passes, then a synchronized one
            x, y = batch(10 * step + micro)
            if micro < 2:
                with ddp.no_sync():
                    F.cross_entropy(ddp(x), y).backward()
            else:
                F.cross_entropy(ddp(x), y).backward()
            F.cross_entropy(ref(x), y).backward()
        opt.step()
        reference_sync(eng, ref)
        ref_opt.step()
        assert same_bits(model, ref), f"(b) no_sync {strategy} step {step}"
    assert state.steps == 4
    state.close()
    eng.close()
    say(f"(b) no_sync() accumulation over 3 micro-batches == reference, bit for bit: {strategy} OK")

model, ddp, state, opt, ref, ref_opt, eng = ddp_pair("dense", find_unused=True, momentum=0.0)
for step in range(5):
    x, y = batch(step)
    use_side = step % 2 == 1
    opt.zero_grad()
    F.cross_entropy(ddp(x, use_side), y).backward()
    opt.step()
    ref_opt.zero_grad()
    F.cross_entropy(ref(x, use_side), y).backward()
    reference_sync(eng, ref)
    ref_opt.step()
    assert same_bits(model, ref), f"(b) find_unused_parameters step {step}"
state.close()
eng.close()
say("(b) find_unused_parameters=True, a branch unused on even steps == reference, bit for bit OK")

# --- (c) bfloat16 and float16 ----------------------------------------------
U = {torch.bfloat16: (2.0**-8, 2.0**-134), torch.float16: (2.0**-11, 2.0**-25)}


def check_half(name, got, local, engine_f32):
    """got: this rank's synchronized gradient (half); local: this rank's own
    gradient before; engine_f32: the float32 engine's result on the widened
    local gradients."""
    dtype = got.dtype
    want = engine_f32.to(dtype)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"(c) {name}: not the float32 result rounded once"
    xs = np.stack(comm.allgather(local.double().numpy().reshape(-1)))
    reference = xs.mean(axis=0)
    u = 2.0**-24
    gamma = size * u / (1 - size * u)
    e = gamma * np.abs(xs).sum(axis=0) / size
    uh, eta = U[dtype]
    bound = uh * (np.abs(reference) + e) + e + eta
    err = np.abs(got.double().numpy().reshape(-1) - reference)
    assert (err <= bound).all(), f"(c) {name}: error {err.max()} above the bound"
    return float((err / bound).max())


# bfloat16 model under DDP with the hook.
torch.manual_seed(6)
model = Net().to(torch.bfloat16)
plain = copy.deepcopy(model)
ddp = DDP(model, bucket_cap_mb=0.05)
state = gst.GradSyncHookState(model.named_parameters(), strategy="dense")
assert not state.overlap, "bfloat16 gradients: the hook falls back to the whole step"
ddp.register_comm_hook(state, gst.gradsync_hook)
f32_eng = reference_engine(model, "dense")
worst = 0.0
for step in range(3):
    x, y = batch(step, torch.bfloat16)
    model.zero_grad()
    plain.zero_grad()
    F.cross_entropy(ddp(x).float(), y).backward()
    F.cross_entropy(plain(x).float(), y).backward()
    local = [p.grad.clone() for p in plain.parameters()]
    wide = [g.float().contiguous() for g in local]
    f32_eng.sync(wide)
    for (name, p), g, w in zip(model.named_parameters(), local, wide):
        worst = max(worst, check_half(f"bf16 {name}", p.grad, g, w))
    with torch.no_grad():  # keep both models equal for the next step
        for p, q in zip(model.parameters(), plain.parameters()):
            p -= 0.05 * p.grad
            q.copy_(p)
state.close()
f32_eng.close()
say(f"(c) bfloat16 under DDP: float32 result rounded once, bit for bit; largest error {worst:.2f} of the bound OK")

# float16 model under DistributedOptimizer.
torch.manual_seed(7)
model = Net().half()
gst.broadcast_parameters(model.state_dict())
opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               strategy="dense", overlap=False)  # float16: the whole step
f32_eng = reference_engine(model, "dense")
worst = 0.0
for step in range(3):
    x, y = batch(step, torch.float16)
    opt.zero_grad()
    F.cross_entropy(model(x).float(), y).backward()
    local = [p.grad.clone() for p in model.parameters()]
    wide = [g.float().contiguous() for g in local]
    f32_eng.sync(wide)
    opt.synchronize()
    for (name, p), g, w in zip(model.named_parameters(), local, wide):
        worst = max(worst, check_half(f"fp16 {name}", p.grad, g, w))
    with opt.skip_synchronize():
        opt.step()
opt.close()
f32_eng.close()
say(f"(c) float16 under DistributedOptimizer: rounded once, bit for bit; largest error {worst:.2f} of the bound OK")

# numpy float16 beside float32 in one table, and a bfloat16 tensor with them.
eng = gradsync.GradSync(comm, momentum=0.0)
f32 = gradsync.GradSync(comm, momentum=0.0)
for e in (eng, f32):
    e.register("h", (500,), strategy="dense")
    e.register("f", (300,), strategy="dense")
    e.register("b", (40000,), strategy="rgc:density=0.01")
rng = np.random.default_rng(rank)
h = rng.standard_normal(500).astype(np.float16)
f = rng.standard_normal(300).astype(np.float32)
b = torch.from_numpy(rng.standard_normal(40000).astype(np.float32)).to(torch.bfloat16)
wide = [h.astype(np.float32), f.copy(), b.float().numpy().copy()]
f32.sync(wide)
eng.sync([h, f, b])
assert np.array_equal(h.view(np.int16), wide[0].astype(np.float16).view(np.int16)), "(c) numpy float16"
assert np.array_equal(f.view(np.int32), wide[1].view(np.int32)), "(c) float32 beside float16"
assert torch.equal(b.view(torch.int16), torch.from_numpy(wide[2]).to(torch.bfloat16).view(torch.int16)), "(c) bfloat16 rgc"
eng.close()
f32.close()
say("(c) numpy float16 + float32 + torch bfloat16 (rgc) in one table: the float32 step rounded once OK")


# --- (h) a branch that gets no gradient on some ranks only, overlapped ------
# Its bucket goes at step() on those ranks; every rank submits the buckets in
# the same order, so the step equals the whole step (zeros for the branch).
torch.manual_seed(11)
model = Net(side=True)
ref = copy.deepcopy(model)
opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               strategy="dense", bucket_cap_mb=0.0005)
assert opt.overlap and len(opt.sync.buckets) > 2, len(opt.sync.buckets)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
eng = reference_engine(ref, "dense")
for step in range(3):
    opt.zero_grad()
    ref_opt.zero_grad()
    x, y = batch(500 + step)
    use = rank % 2 == 0 and step != 1
    F.cross_entropy(model(x, use_side=use), y).backward()
    F.cross_entropy(ref(x, use_side=use), y).backward()
    opt.step()
    reference_sync(eng, ref)
    ref_opt.step()
    assert same_bits(model, ref), f"(h) unused on some ranks, step {step}"
opt.close()
eng.close()
say("(h) a branch without gradient on some ranks only, overlapped: == whole step, bit for bit OK")


# --- (g) no bucket_cap_mb: the step model cuts the buckets after step 0 -----
prof = {"version": 2, "alpha": 1e-5, "beta": 1e-9, "gamma_unpack": 1e-9}
for profile in (prof, None):
    torch.manual_seed(9)
    model = Net()
    ref = copy.deepcopy(model)
    opts = {"profile": profile} if profile else {}
    opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                   strategy="dense", **opts)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    eng = reference_engine(ref, "dense")
    for step in range(4):
        opt.zero_grad()
        ref_opt.zero_grad()
        x, y = batch(300 + step)
        F.cross_entropy(model(x), y).backward()
        F.cross_entropy(ref(x), y).backward()
        opt.step()
        reference_sync(eng, ref)
        ref_opt.step()
        assert same_bits(model, ref), f"(g) tuned buckets, step {step}"
    plan = opt.sync.bucket_plan
    assert plan is not None and plan["backward_s"] > 0, plan
    if profile:
        assert "error" not in plan and plan["buckets"] and plan["step_s"] >= plan["backward_s"], plan
        want = len(plan["buckets"])
    else:
        assert "profile" in plan["error"] and opt.sync.cap_bytes == 25 * 2**20, plan
        want = 1
    assert len(opt.sync.buckets) == want, (len(opt.sync.buckets), plan)
    opt.close()
    eng.close()
    say(f"(g) bucket_cap_mb=None, profile {'given' if profile else 'none'}: after step 0 "
        f"{len(opt.sync.buckets)} bucket(s) (backward {plan['backward_s'] * 1e3:.2f} ms), "
        "bit for bit the whole step OK")


# --- (e) the overlapping DistributedOptimizer --------------------------------
# Options that once needed the whole step: weight decay (the buckets carry
# the weights), a communication delay, the sparse allreduce, and local
# clipping (the engine runs the step when its last bucket arrives).
for strategy, options in [("dense", {}), ("rgc:density=0.05", {"momentum": 0.9}), ("auto", {}),
                          ("rgc:density=0.05", {"momentum": 0.9, "weight_decay": 1e-3}),
                          ("rgc:density=0.05", {"delay": 2, "momentum": 0.9}),
                          ("rgc:density=0.05", {"sparse_exchange": "allreduce"}),
                          ("dense", {"clip_norm": 0.5})]:
    for passes in (1, 2):
        torch.manual_seed(9)
        model = Net()
        ref = copy.deepcopy(model)
        opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                                       strategy=strategy, bucket_cap_mb=0.05, backward_passes_per_step=passes,
                                       **options)
        assert opt.overlap and len(opt.sync.buckets) > 1, (opt.overlap, getattr(opt.sync, "buckets", None))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
        eng = reference_engine(ref, strategy, **options)
        early = []
        model.conv.weight.register_hook(lambda g: early.append(sum(opt.sync._started)))
        for step in range(5):
            opt.zero_grad()
            ref_opt.zero_grad()
            for micro in range(passes):
                x, y = batch(100 * step + micro)
                F.cross_entropy(model(x), y).backward()
                F.cross_entropy(ref(x), y).backward()
            if step == 0:
                try:
                    opt.zero_grad()
                except RuntimeError as e:
                    assert "before step()" in str(e), e
                else:
                    raise AssertionError("(e) zero_grad() with buckets in flight did not raise")
            opt.step()
            reference_sync(eng, ref, weights="weight_decay" in options or "delay" in options)
            ref_opt.step()
            assert same_bits(model, ref), f"(e) overlap {strategy} {options} passes={passes} step {step}"
        assert [r[2] for r in opt.sync.layers()] == [r[2] for r in eng.layers()]
        # Buckets were in flight before backward reached the first layer.
        assert min(early[passes - 1 :: passes]) >= 1, early
        nb = len(opt.sync.buckets)
        opt.close()
        eng.close()
        say(f"(e) overlapping DistributedOptimizer == whole-step engine, bit for bit: {strategy} "
            f"{options or ''} backward_passes_per_step={passes} ({nb} buckets, "
            f"{min(early[passes - 1 :: passes])}+ started before backward reached the first layer) OK")

# --- (f) the corners: a closure that raises after backward, a non-contiguous
# gradient, a zero-element parameter --------------------
torch.manual_seed(11)
model = Net()
opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               strategy="dense", bucket_cap_mb=0.05)
assert opt.overlap


def closure():
    x, y = batch(7)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()  # every bucket but the last starts here
    if rank == last:
        raise RuntimeError("the closure failed after backward")
    return 0.0


before = [p.detach().clone() for p in model.parameters()]
try:
    opt.step(closure)
except gradsync.Error as e:
    assert rank != last and "the closure raised" in str(e), (rank, e)
except RuntimeError as e:
    assert rank == last and "failed after backward" in str(e), (rank, e)
else:
    raise AssertionError("(f) a closure that raised after backward did not fail the step on every rank")
assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "(f) a failed step changed the weights"
x, y = batch(8)
opt.zero_grad()
F.cross_entropy(model(x), y).backward()
opt.step()  # the next step runs on every rank
assert_same = comm.allgather(float(sum(p.double().sum() for p in model.parameters())))
assert len(set(assert_same)) == 1, assert_same
opt.close()
say("(f) a closure that raises on one rank after backward fails the overlapped step on every rank OK")

torch.manual_seed(12)
model = Net()
with torch.no_grad():  # a transposed (non-contiguous) parameter: its gradient is non-contiguous too
    model.fc2.weight = nn.Parameter(model.fc2.weight.detach().t().contiguous().t())
ref = copy.deepcopy(model)
opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters(),
                               strategy="dense", bucket_cap_mb=0.05)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
eng = reference_engine(ref, "dense")
for step in range(3):
    x, y = batch(step)
    opt.zero_grad()
    ref_opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x), y).backward()
    noncontig = not ref.fc2.weight.grad.is_contiguous()  # the layout autograd gives (no hooks there)
    opt.step()
    for p in ref.parameters():
        p.grad = p.grad.contiguous()
    reference_sync(eng, ref)
    ref_opt.step()
    assert same_bits(model, ref), f"(f) channels_last step {step}"
opt.close()
eng.close()
assert noncontig, "(f) the transposed parameter's gradient was contiguous: nothing tested"
assert model.fc2.weight.grad.is_contiguous(), "(f) the overlapped path made it contiguous, in place"
say("(f) a non-contiguous gradient (a transposed parameter), overlapped == whole step, bit for bit OK")


class WithEmpty(Net):
    def __init__(self) -> None:
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, x, use_side: bool = False):
        return super().forward(x) + self.empty.sum()


for overlap in (True, False):
    torch.manual_seed(13)
    model = WithEmpty()
    ref = copy.deepcopy(model)
    ddp = DDP(model, bucket_cap_mb=0.05)
    state = gst.GradSyncHookState(model.named_parameters(), strategy="dense", overlap=overlap, bucket_cap_mb=0.05)
    ddp.register_comm_hook(state, gst.gradsync_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    eng = gradsync.GradSync(comm, momentum=0.0)
    for name, p in ref.named_parameters():
        if p.numel():
            eng.register(name, tuple(p.shape), strategy="dense")
    for step in range(3):
        x, y = batch(step)
        opt.zero_grad()
        ref_opt.zero_grad()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        F.cross_entropy(ref(x), y).backward()
        eng.sync([p.grad for p in ref.parameters() if p.numel()])
        ref_opt.step()
        assert same_bits(model, ref), f"(f) zero-element parameter, overlap={overlap}, step {step}"
    state.close()
    eng.close()
say("(f) a zero-element parameter under DDP with the hook (overlap and not) == whole step OK")

# --- (d) a hook input that differs on one rank -----------------------------
class FakeBucket:
    """What DDP hands the hook (``GradBucket``'s methods the hook uses)."""

    def __init__(self, index, params, last_bucket, dtype=torch.float32, drop=None):
        self.params = [p for p in params if p is not drop]
        self.buf = torch.cat([torch.full((p.numel(),), float(rank + 1)) for p in self.params]).to(dtype)
        self.i, self.last = index, last_bucket

    def buffer(self):
        return self.buf

    def parameters(self):
        return self.params

    def is_last(self):
        return self.last

    def index(self):
        return self.i


torch.manual_seed(8)
model = Net()
params = list(model.parameters())
for overlap in (True, False):
    state = gst.GradSyncHookState(model.named_parameters(), strategy="dense", overlap=overlap, bucket_cap_mb=0.05)
    stranger = nn.Parameter(torch.zeros(3))
    for what, odd in [("a parameter missing from its buckets", {"drop": params[0]}),
                      ("a float64 bucket", {"dtype": torch.float64}),
                      ("an unregistered parameter in the last bucket", {"extra": stranger})]:
        mine = odd if rank == last else {}
        t0 = time.monotonic()
        first = {k: v for k, v in mine.items() if k != "extra"}
        tail = params[4:] + ([mine["extra"]] if "extra" in mine else [])
        futs = [gst.gradsync_hook(state, FakeBucket(0, params[:4], False, **first)),
                gst.gradsync_hook(state, FakeBucket(1, tail, True))]
        while not all(f.done() for f in futs):
            assert time.monotonic() - t0 < 60, f"(d) {what}: a future did not complete in 60 s"
            time.sleep(0.01)
        failed = []
        for fut in futs:
            try:
                fut.wait()
            except Exception as e:  # noqa: BLE001
                assert f"rank {last}" in str(e), f"(d) {what}: the error does not name rank {last}: {e}"
                failed.append(fut)
        # DDP raises from backward() when any future failed: every rank has
        # one, and the step's last bucket always carries the step's error.
        assert futs[-1] in failed, f"(d) {what}: rank {rank}'s last future completed without the error"
        say(f"(d) overlap={overlap}: {what} on rank {last}: every rank's futures failed "
            f"({len(failed)} of 2) in {time.monotonic() - t0:.2f} s naming it OK")
    # The next step works, and averages.
    futs = [gst.gradsync_hook(state, FakeBucket(0, params[:4], False)),
            gst.gradsync_hook(state, FakeBucket(1, params[4:], True))]
    out = torch.cat([f.wait() for f in futs])
    assert torch.all(out == (size + 1) / 2), out
    state.close()
    say(f"(d) overlap={overlap}: the next step averages OK")

# A DDP hook cannot write the weights back: weight decay and a delay are
# refused on every rank, saying what to use instead.
for opts, want in [({"weight_decay": 1e-3}, "give it to the torch optimizer"),
                   ({"delay": 2}, "use gradsync.torch.DistributedOptimizer")]:
    try:
        gst.GradSyncHookState(Net().named_parameters(), strategy="dense", **opts)
        raise AssertionError(f"GradSyncHookState({opts}) did not raise")
    except ValueError as e:
        assert want in str(e), e
say("(h) weight_decay and delay > 1 refused by the hook, naming what to use OK")
# With a delay the optimizer must keep no state of its own (each rank's
# local directions would enter it, and the weights drift apart).
for make in (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), lambda ps: torch.optim.Adam(ps)):
    m = Net()
    try:
        gst.DistributedOptimizer(make(m.parameters()), m.named_parameters(), strategy="dense", delay=2)
        raise AssertionError("a stateful optimizer with delay=2 did not raise")
    except ValueError as e:
        assert "stateless optimizer" in str(e), e
say("(h) delay > 1 with a stateful torch optimizer refused OK")
# Ranks in different helpers (the last broadcasts the parameters, the others
# set up the optimizer) all raise, naming both calls, and stay in step.
if size > 1:
    m = Net()
    try:
        if rank == last:
            gst.broadcast_parameters(m.named_parameters())
        else:
            gst.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                     strategy="dense")
        raise AssertionError("different helpers did not raise")
    except gradsync.Error as e:
        assert "the call differs across ranks" in str(e) and "broadcast_parameters" in str(e) \
            and "set-up" in str(e), e
    gst.broadcast_parameters(m.named_parameters())
    say("(h) broadcast_parameters against the optimizer's set-up: every rank raised naming both OK")

dist.destroy_process_group()
say("check_torch_hook: OK")
