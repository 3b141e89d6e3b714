#!/usr/bin/env python3
"""PyTorch's powerSGD_hook on one bucket, for gradsync's PowerSGD to match.

    python3 tests/python/powersgd_torch.py DIR

One process and one rank, no network: the hook's allreduces (the identity
on one rank) are completed futures of their own tensors, so the run cannot
meet another job's sockets or ports. A bucket of one matrix gradient: for each case (rows, cols, rank) the hook
runs two plain steps (``start_powerSGD_iter=2``, its smallest), then four
compressed steps with error feedback and warm start. Writes, per case ``i``,
``case{i}.grads.npy`` (the compressed steps' gradients, steps x rows x cols),
``case{i}.q0.npy`` (the Q the hook draws at its first compressed step,
cols x rank: the same seed and draw as the hook's) and ``case{i}.torch.npy``
(the hook's outputs). tests/python.rs runs gradsync's PowerSGD from the same
Q on the same gradients and compares. Without torch: prints a SKIP line.
"""

import os
import sys

import numpy as np

try:
    import torch
    import torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook as ph
except ImportError as e:
    print(f"powersgd_torch: SKIP: torch is not installed ({e})")
    sys.exit(0)

CASES = [(32, 27, 1), (64, 50, 2), (40, 30, 4)]
STEPS = 4


class OneRank:
    """The process group the hook is given: one rank."""

    def size(self):
        return 1


def identity_all_reduce(tensor, group=None, async_op=False):
    """dist.all_reduce on one rank: the tensor as it is, as a done future."""
    fut = torch.futures.Future()
    fut.set_result([tensor])

    class Work:
        def get_future(self):
            return fut

        def wait(self):
            return True

    return Work() if async_op else None


class Bucket:
    """The part of DDP's GradBucket the hook reads."""

    def __init__(self, buf, shape):
        self.buf = buf
        self.shape = shape

    def buffer(self):
        return self.buf

    def index(self):
        return 0

    def is_last(self):
        return True

    def gradients(self):
        return [self.buf.view(self.shape)]

    def parameters(self):
        return []

    def set_buffer(self, b):
        self.buf = b


def main():
    out = sys.argv[1]
    ph.dist.all_reduce = identity_all_reduce
    gen = torch.Generator().manual_seed(1234)
    for i, (rows, cols, rank) in enumerate(CASES):
        state = ph.PowerSGDState(
            process_group=OneRank(),
            matrix_approximation_rank=rank,
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
            use_error_feedback=True,
            warm_start=True,
            random_seed=i,
        )
        # The hook's own draw at its first compressed step.
        seed = np.random.RandomState(i).randint(1_000_000_000)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            q0 = torch.randn(1, cols, rank)
            ph._orthogonalize(q0, 0)
        grads, outs = [], []
        for it in range(2 + STEPS):
            g = torch.randn(rows * cols, generator=gen)
            res = ph.powerSGD_hook(state, Bucket(g.clone(), (rows, cols))).wait()
            if it >= 2:
                grads.append(g.view(rows, cols).numpy().copy())
                outs.append(res.view(rows, cols).numpy().copy())
        np.save(os.path.join(out, f"case{i}.grads.npy"), np.stack(grads).astype(np.float32))
        np.save(os.path.join(out, f"case{i}.q0.npy"), q0[0].numpy().astype(np.float32))
        np.save(os.path.join(out, f"case{i}.torch.npy"), np.stack(outs).astype(np.float32))
    print(f"powersgd_torch: OK {len(CASES)} cases")


if __name__ == "__main__":
    main()
