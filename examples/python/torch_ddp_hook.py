# mpirun -np 4 python -m mpi4py examples/python/torch_ddp_hook.py
import socket
import zlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI

import gradsync.torch as gst

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
# DDP's process group (gloo, for its parameter broadcast): rank 0's host and a free port.
if rank == 0:
    with socket.socket() as s:
        s.bind(("", 0))
        where = (socket.gethostname(), s.getsockname()[1])
host, port = comm.bcast(where if rank == 0 else None)
dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=comm.Get_size())

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
ddp = torch.nn.parallel.DistributedDataParallel(model)
state = gst.GradSyncHookState(model.named_parameters(), strategy="auto")  # profile=... for the cost model
ddp.register_comm_hook(state, gst.gradsync_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

w_true = torch.randn(64, 10, generator=torch.Generator().manual_seed(42))
data = torch.Generator().manual_seed(rank)  # each rank its own shard
for step in range(50):
    x = torch.randn(32, 64, generator=data)
    y = (x @ w_true).argmax(1)
    opt.zero_grad()
    loss = F.cross_entropy(ddp(x), y)
    loss.backward()  # gradsync synchronizes DDP's buckets
    opt.step()

# Every rank holds the same weights.
crc = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
assert len(set(comm.allgather(crc))) == 1
if rank == 0:
    print(f"loss {loss.item():.3f} after {state.steps} steps; layers: {[s for _, _, s in state.sync.layers()]}")
    print("torch_ddp_hook: OK")
state.close()
dist.destroy_process_group()
