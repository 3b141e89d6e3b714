"""gradsync.torch on CUDA models under real mpirun: the DDP comm hook and
DistributedOptimizer, each against the same on a CPU copy of the model.

    mpirun -np 2 python3 -m mpi4py tests/python/check_cuda_torch.py

The model, its inputs and its loss are integer-valued (small integer
weights and inputs, a loss linear in the outputs), so a CUDA backward and
a CPU backward give the same gradients exactly; gradsync then takes the
CUDA gradients through its device path (staged through pinned host
memory) and the CPU ones through the host path (with overlap on the CPU,
falling back to the whole step on CUDA with a RuntimeWarning). After
every step the two models' gradients and parameters must be equal bit
for bit: DDP over gloo with ``gradsync_hook`` (dense and RGC layers), and
``DistributedOptimizer`` (RGC with momentum correction).

Where torch, a GPU or gradsync's cuda feature is missing on any rank,
every rank skips: rank 0 prints ``SKIPPED: <reason>``. Otherwise each rank
prints ``rank R: OK <n> checks``; a failure raises (run with
``python3 -m mpi4py`` to abort the job).
"""

import copy
import sys
import warnings

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
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


reasons = [r for r in comm.allgather(why_not()) if r]
if reasons:
    if rank == 0:
        print(f"SKIPPED: {reasons[0]}", flush=True)
    sys.exit(0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import gradsync  # noqa: E402
import gradsync.torch as gst  # noqa: E402

torch.set_num_threads(1)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dev = torch.device("cuda", rank % torch.cuda.device_count())
torch.cuda.set_device(dev)

store = dist.TCPStore("127.0.0.1", 0, size, True, wait_for_workers=False) if rank == 0 else None
port = comm.bcast(store.port if rank == 0 else None, root=0)
if rank != 0:
    store = dist.TCPStore("127.0.0.1", port, size, False)
dist.init_process_group("gloo", store=store, rank=rank, world_size=size)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 48)
        self.b = nn.Linear(48, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def integer_net():
    torch.manual_seed(3)
    m = Net()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randint(-2, 3, p.shape).float())
    return m


def batch(step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randint(-3, 4, (16, 64), generator=g).float()
    w = torch.randint(-2, 3, (16, 10), generator=g).float()
    return x, w


def same(cpu_model, gpu_model, what):
    for (n, p), q in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        qc = q.detach().cpu()
        ok(torch.equal(p.detach(), qc), f"{what}: parameter {n} differs")
        ok(p.grad is not None and q.grad is not None and torch.equal(p.grad, q.grad.cpu()),
           f"{what}: gradient {n} differs")


def loss(model, x, w):
    return (model(x) * w).sum()


# (a) DDP over gloo with gradsync_hook, CUDA against CPU.
strategy = {"a.weight": "rgc:density=0.05", "a.bias": "dense", "b.weight": "rgc:density=0.1", "b.bias": "dense"}
cpu = integer_net()
gpu = copy.deepcopy(cpu).to(dev)
ddp_cpu = DDP(cpu, bucket_cap_mb=0.01)
ddp_gpu = DDP(gpu, device_ids=[dev.index], bucket_cap_mb=0.01)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    st_cpu = gst.GradSyncHookState(cpu.named_parameters(), strategy=strategy, bucket_cap_mb=0.01, momentum=0.0)
    st_gpu = gst.GradSyncHookState(gpu.named_parameters(), strategy=strategy, bucket_cap_mb=0.01, momentum=0.0)
ddp_cpu.register_comm_hook(st_cpu, gst.gradsync_hook)
ddp_gpu.register_comm_hook(st_gpu, gst.gradsync_hook)
opt_cpu = torch.optim.SGD(cpu.parameters(), lr=0.125)
opt_gpu = torch.optim.SGD(gpu.parameters(), lr=0.125)
for step in range(4):
    x, w = batch(step)
    opt_cpu.zero_grad()
    loss(ddp_cpu, x, w).backward()
    opt_gpu.zero_grad()
    loss(ddp_gpu, x.to(dev), w.to(dev)).backward()
    torch.cuda.synchronize()
    # Before the step: the hook's results.
    for (n, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        ok(torch.equal(p.grad, q.grad.cpu()), f"(a) step {step}: hook result of {n} differs on CUDA")
    opt_cpu.step()
    opt_gpu.step()
    same(cpu, gpu, f"(a) step {step}")
ok(st_gpu.last_stats is not None and st_gpu.last_stats.get("device"),
   f"(a) the CUDA hook ran the engine's device path: {st_gpu.last_stats and st_gpu.last_stats.get('device')}")
st_cpu.close()
st_gpu.close()

# (b) DistributedOptimizer with RedSync's momentum correction in gradsync.
cpu = integer_net()
gpu = copy.deepcopy(cpu).to(dev)
with warnings.catch_warnings():
    warnings.simplefilter("ignore", RuntimeWarning)
    d_cpu = gst.DistributedOptimizer(torch.optim.SGD(cpu.parameters(), lr=0.125), cpu.named_parameters(),
                                     strategy="rgc:density=0.05", momentum=0.5)
    d_gpu = gst.DistributedOptimizer(torch.optim.SGD(gpu.parameters(), lr=0.125), gpu.named_parameters(),
                                     strategy="rgc:density=0.05", momentum=0.5)
for step in range(4):
    x, w = batch(step + 10)
    d_cpu.zero_grad()
    loss(cpu, x, w).backward()
    d_cpu.step()
    d_gpu.zero_grad()
    loss(gpu, x.to(dev), w.to(dev)).backward()
    d_gpu.step()
    torch.cuda.synchronize()
    same(cpu, gpu, f"(b) step {step}")
ok(d_gpu.last_stats is not None and d_gpu.last_stats.get("device"), "(b) the CUDA optimizer ran the device path")
d_cpu.close()
d_gpu.close()

comm.Barrier()
print(f"rank {rank}: OK {checks} checks", flush=True)
dist.destroy_process_group()
