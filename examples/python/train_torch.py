#!/usr/bin/env python3
"""Data-parallel training in PyTorch, gradsync against DDP's own hooks.

    mpirun -np 4 python -m mpi4py examples/python/train_torch.py --config ddp --json
    mpirun -np 4 python -m mpi4py examples/python/train_torch.py --config gradsync-hook --profile profile.json

A convolutional network (four 3x3 convolutions, 32, 64, 128 and 128
channels, then an 8192-256-10 MLP: 2.34M parameters) shaped like the CNNs
people train: most of the compute in the convolutions, which backward
reaches last, most of the parameters in the linear layers, whose gradients
come first (what lets DDP and Horovod hide the communication behind
backward; with the compute in the linear layers instead, the big gradient
is ready late and little is left to hide it behind), on scikit-learn's digits (8x8 images,
1437 training and 360 test images, a fixed split), each rank on its shard of
every global batch (32 images a rank), SGD with momentum 0.9, the same model,
data, seed and hyper-parameters in every configuration:

* ``ddp``: ``DistributedDataParallel`` over gloo, its default allreduce;
* ``ddp-fp16``: DDP with ``default_hooks.fp16_compress_hook``;
* ``ddp-powersgd``: DDP with ``powerSGD_hook`` as torch's documentation
  sets it up (``matrix_approximation_rank=1``, ``start_powerSGD_iter=10``,
  ``min_compression_rate=0.5``, error feedback and warm start on), one bucket
  (with several, its hook deadlocks over gloo at 4 ranks);
* ``noop``: DDP with ``debugging_hooks.noop_hook``: no communication (the
  compute-only limit; its replicas drift apart);
* ``gradsync-hook``: DDP with ``gradsync_hook`` (``--strategy``, ``auto`` by
  default, with ``--profile``), the momentum in gradsync (RedSync's
  momentum correction) and SGD without it;
* ``gradsync-opt``: ``gradsync.torch.DistributedOptimizer`` (overlapping),
  the same strategy and momentum;
* ``gradsync-opt-whole``, ``gradsync-hook-whole``: the same without
  overlap (``overlap=False``).

``--auto-density`` sets the gradsync configurations' ``auto_density``; the
environment variable ``GRADSYNC_PROGRESS_POLL_US`` their
``progress_poll_us`` (how the progress thread waits while backward runs).

Prints one JSON line on rank 0 with ``--json``: ``config``, ``ranks``,
``steps``, ``test_accuracy``, ``wall_s`` (training time, evaluation
excluded), ``step_s`` (median step), ``bytes_per_step`` (gradient bytes a
rank hands to the collectives per step), ``curve`` (``[step, seconds,
accuracy]`` every ``--eval-every`` steps) and ``layers`` (gradsync's
choices).
"""

import argparse
import json
import os
import socket
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from mpi4py import MPI

import gradsync.torch as gst

CONFIGS = ["ddp", "ddp-fp16", "ddp-powersgd", "noop", "gradsync-hook", "gradsync-hook-whole", "gradsync-opt",
           "gradsync-opt-whole"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 128, 3, padding=1)
        self.conv4 = nn.Conv2d(128, 128, 3, padding=1)
        self.fc1 = nn.Linear(128 * 8 * 8, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        h = F.relu(self.conv3(F.relu(self.conv2(F.relu(self.conv1(x))))))
        h = F.relu(self.conv4(h))
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    n_test = 360
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def powersgd_bytes(model, rank_r: int) -> int:
    """What powerSGD_hook hands to its allreduces per step once it
    compresses: P and Q (float32) of every matrix view (shape[0], -1) it
    compresses (min_compression_rate=0.5), the 1-D tensors uncompressed."""
    total = 0
    for p in model.parameters():
        if p.dim() <= 1:
            total += 4 * p.numel()
            continue
        n, m = p.shape[0], p.numel() // p.shape[0]
        r = min(n, m, rank_r)
        total += 4 * r * (n + m) if n * m >= 0.5 * r * (n + m) else 4 * p.numel()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", choices=CONFIGS, required=True)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=32, help="images a rank per step")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--strategy", default="auto", help="gradsync configurations: the registration strategy")
    ap.add_argument("--profile", default=None, help="gradsync calibrate's profile, for auto")
    ap.add_argument("--auto-density", type=float, default=None,
                    help="gradsync configurations: the density of the sparse strategies auto considers")
    ap.add_argument("--auto-powersgd", type=int, default=0,
                    help="gradsync configurations: the PowerSGD rank auto may choose (0: not offered)")
    ap.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's and gradsync's bucket size")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--progress", action="store_true")
    args = ap.parse_args()
    # GRADSYNC_PROGRESS_POLL_US: the engine's progress_poll_us (how its progress thread waits).
    extra = {"progress_poll_us": int(os.environ["GRADSYNC_PROGRESS_POLL_US"])} if "GRADSYNC_PROGRESS_POLL_US" in os.environ else {}
    if args.auto_density is not None:
        extra["auto_density"] = args.auto_density
    if args.auto_powersgd:
        extra["auto_powersgd"] = args.auto_powersgd

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    if rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            where = (socket.gethostname(), s.getsockname()[1])
    host, port = comm.bcast(where if rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=size)

    (xtr, ytr), (xte, yte) = digits()
    torch.manual_seed(0)
    model = Net()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = args.config
    gradsync_momentum = cfg.startswith("gradsync")
    torch_momentum = 0.0 if gradsync_momentum else args.momentum
    state = None
    bytes_per_step = 4 * n_params
    if cfg.startswith("ddp") or cfg in ("noop", "gradsync-hook", "gradsync-hook-whole"):
        cap = 1000.0 if cfg == "ddp-powersgd" else args.bucket_cap_mb
        net = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cap)
        if cfg == "ddp-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
            bytes_per_step = 2 * n_params
        elif cfg == "ddp-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

            state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                     start_powerSGD_iter=10, min_compression_rate=0.5,
                                     use_error_feedback=True, warm_start=True)
            net.register_comm_hook(state, ps.powerSGD_hook)
            bytes_per_step = powersgd_bytes(model, 1)
        elif cfg == "noop":
            from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks

            net.register_comm_hook(None, debugging_hooks.noop_hook)
            bytes_per_step = 0
        elif cfg.startswith("gradsync-hook"):
            state = gst.GradSyncHookState(model.named_parameters(), strategy=args.strategy, profile=args.profile,
                                          bucket_cap_mb=args.bucket_cap_mb, momentum=args.momentum,
                                          overlap=(cfg == "gradsync-hook"), **extra)
            net.register_comm_hook(state, gst.gradsync_hook)
        opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=torch_momentum)
    else:
        net = model
        gst.broadcast_parameters(model.state_dict(), root=0)
        opt = gst.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=torch_momentum),
                                       model.named_parameters(), strategy=args.strategy, profile=args.profile,
                                       overlap=(cfg == "gradsync-opt"), bucket_cap_mb=args.bucket_cap_mb,
                                       momentum=args.momentum, **extra)

    def evaluate() -> float:
        with torch.no_grad():
            return float((model(xte).argmax(1) == yte).float().mean())

    n_train = len(ytr)
    per_step = args.batch * size
    times, curve, sent = [], [], []
    train_s = 0.0
    order, order_epoch = None, -1
    comm.Barrier()
    for step in range(args.steps):
        epoch, k = divmod(step * per_step, n_train)
        if epoch != order_epoch:  # one permutation an epoch
            order = torch.randperm(n_train, generator=torch.Generator().manual_seed(1000 + epoch))
            order_epoch = epoch
        idx = order[(torch.arange(per_step) + k) % n_train][rank * args.batch:(rank + 1) * args.batch]
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
        opt.step()
        dt = time.perf_counter() - t0
        times.append(dt)
        train_s += dt
        stats = state.last_stats if cfg.startswith("gradsync-hook") else getattr(opt, "last_stats", None)
        if stats:
            sent.append(sum(layer.get("bytes_sent", 0) for layer in stats.get("layers", [])))
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            acc = evaluate()
            curve.append([step + 1, train_s, acc])
            if args.progress and rank == 0:
                print(f"{cfg}: step {step + 1}/{args.steps} test accuracy {acc:.4f} ({train_s:.1f} s)",
                      file=sys.stderr, flush=True)
    if cfg == "ddp-powersgd":
        bytes_per_step = powersgd_bytes(model, 1)
    if sent:
        bytes_per_step = int(statistics.median(sent))
    layers = None
    if cfg.startswith("gradsync"):
        sync = state.sync if state is not None else opt.sync
        layers = [s for _, _, s in sync.layers()]
    # Replicas: every rank's parameters (equal, except without communication).
    crc = comm.allgather(float(sum(p.detach().double().sum() for p in model.parameters())))
    out = {
        "config": cfg,
        "ranks": size,
        "steps": args.steps,
        "parameters": n_params,
        "test_accuracy": curve[-1][2],
        "wall_s": train_s,
        "step_s": statistics.median(times),
        "bytes_per_step": bytes_per_step,
        "replicas_equal": len(set(crc)) == 1,
        "layers": layers,
        "curve": curve,
    }
    if args.json and rank == 0:
        print(json.dumps(out), flush=True)
    if state is not None and hasattr(state, "close"):
        state.close()
    if hasattr(opt, "close"):
        opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
