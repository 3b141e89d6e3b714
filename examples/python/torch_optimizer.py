# mpirun -np 4 python -m mpi4py examples/python/torch_optimizer.py
import zlib

import torch
import torch.nn.functional as F
from mpi4py import MPI

import gradsync.torch as gst

comm = MPI.COMM_WORLD
rank = comm.Get_rank()

torch.manual_seed(rank)  # different on purpose: broadcast_parameters makes them equal
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
gst.broadcast_parameters(model.state_dict(), root=0)
# RedSync's momentum correction: the momentum in gradsync, plain SGD in torch.
opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                               strategy="auto", momentum=0.9)

w_true = torch.randn(64, 10, generator=torch.Generator().manual_seed(42))
data = torch.Generator().manual_seed(rank)  # each rank its own shard
for step in range(50):
    x = torch.randn(32, 64, generator=data)
    y = (x @ w_true).argmax(1)
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()  # gradsync synchronizes every gradient, then SGD

# Every rank holds the same weights.
crc = zlib.crc32(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
assert len(set(comm.allgather(crc))) == 1
if rank == 0:
    print(f"loss {loss.item():.3f} after {opt.sync.step} steps; layers: {[s for _, _, s in opt.sync.layers()]}")
    print("torch_optimizer: OK")
opt.close()
