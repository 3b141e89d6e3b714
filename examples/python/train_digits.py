#!/usr/bin/env python3
"""Data-parallel training of a numpy MLP on scikit-learn's digits, synchronized by gradsync.

What it does
------------
scikit-learn's ``load_digits()`` (shipped with scikit-learn, no download):
1797 images of 8x8 pixels, 10 classes, pixels scaled to [0, 1]. A fixed
shuffle (seed 20240101, independent of ``--seed``) puts 1437 samples in the
training set and 360 in the test set, the same on every rank and in every run.
The model is an MLP 64 -> H -> H -> 10 (ReLU, softmax cross-entropy) written
in numpy with float32 parameters and gradients; with the default H=256 its
weights have 16384, 65536 and 2560 elements.

Every rank starts from the same parameters (same seed) and shuffles the
training set with the same seed, so each global mini-batch of ``--batch``
samples is the same on every rank; rank r takes its own disjoint shard of it
(``np.array_split`` into ``size`` parts). Each step:

1. forward/backward on the local shard; gradients are the mean over the
   shard, plus ``--weight-decay * w`` for the weights (plain L2, computed
   locally, the same in every mode);
2. ``sync.sync(grads)`` replaces every gradient in place by its update
   direction: averaged over the ranks, momentum applied (``--momentum``,
   passed to ``GradSync(momentum=...)``), and for sparse layers RedSync's
   residual error feedback and momentum correction, all inside the engine;
3. ``w -= lr * d`` on every parameter.

Modes (``--mode``):

* ``mpi-dense``: no gradsync: the gradients fused into one buffer,
  ``MPI_Allreduce`` through mpi4py, averaged, momentum ``u = m u + g`` (the
  baseline a user has today; the same update as ``dense``);
* ``dense`` (or ``gradsync-dense``): every layer registered ``"dense"``
  (plain momentum SGD, gradsync's fused Rabenseifner allreduce);
* ``auto``:  every layer registered ``"auto"``: with ``--profile`` (a
  ``gradsync calibrate`` file) the step model chooses per layer; without,
  layers of at least 32768 elements, here the H x H weight, are RGC at 0.1 %;
  ``--auto-powersgd R`` lets the plan choose PowerSGD at rank R as well;
* ``rgc``:   every weight registered ``"rgc:density=D"`` (``--density``,
  default 0.001: 65 of 65536, 16 of 16384 and 2 of 2560 elements per rank
  and step), biases ``"dense"``;
* ``powersgd``: every weight registered ``"powersgd:rank=R,start=0"``
  (``--rank``, default 2: factors of 640, 1024 and 532 elements instead
  of 16384, 65536 and 2560), biases ``"dense"``.

Warm-up: ``--warmup 50`` (default) dense steps first (GradSync
``warmup_steps``, as RedSync does), passed identically in every mode (a no-op
for ``dense``) so that the comparison stays fair. Without it the compressed
runs still converged, but 1 seed in 6 ended 0.56-0.83 points below dense;
with it none of 10 did for ``rgc``.

At the end rank 0 prints the test accuracy and the loss on the whole training
set; the ranks compare an exact checksum (CRC-32 of the parameters' bytes)
with an allgather, and the script exits with status 1 if the parameters
differ across ranks (they cannot: the engine returns identical directions on
every rank). numpy runs with one BLAS thread per rank (set before the import):
on the 2-core VM OpenBLAS's threads made oversubscribed runs 10x slower.

How to run
----------
From the repository root::

    hpc/mpirun.sh -np 4 python3 examples/python/train_digits.py --mode dense
    hpc/mpirun.sh -np 4 python3 examples/python/train_digits.py --mode rgc --density 0.001
    hpc/mpirun.sh -np 4 python3 examples/python/train_digits.py --mode auto --json

``--json`` prints one JSON line from rank 0: ``{"mode", "ranks", "steps",
"test_acc", "train_loss", "seconds", "bytes_sent_per_step",
"sync_s_per_step", "compute_s_per_step"}`` (seconds: the training loop,
slowest rank, without ``--eval-every``'s evaluations; sync: the ``sync``
calls; bytes: mean over the steps of the stats' ``fused_bytes +
dense_bytes``, warm-up steps included). ``--eval-every N`` measures the test
accuracy every N steps (every rank, not timed), ``--curve FILE`` writes the
run's record (those fields, the accuracy curve, each layer's strategy and
bytes per step) for ``hpc/demo_report.py``, ``--progress`` shows a progress
bar on rank 0's stderr. ``hpc/demo.sh`` runs the four modes at
``--hidden 1024 --steps 300 --warmup 0``.

Measured
--------
Defaults (H=256, 1500 steps, global batch 64, lr 0.05, momentum 0.9, weight
decay 5e-4, 50 warm-up steps), 2-core VM shared with a compile (Open MPI, TCP
loopback when oversubscribed). Test accuracy, seed 0:

=====  ======  ======  ======  ==============================
ranks  dense   auto    rgc     bytes/step dense / auto / rgc
=====  ======  ======  ======  ==============================
1      98.06   98.06   98.33
2      98.06   98.06   98.61
4      98.06   98.06   98.06   340008 / 87159 / 14125
=====  ======  ======  ======  ==============================

4 ranks, seeds 0-9: rgc minus dense is +0.00 to +1.11 points (never below),
auto minus dense -0.56 to +0.56 points (below only for seed 7: 98.06 vs
98.61); 1 and 2 ranks, seeds 0-2: within -0.28..+0.56 points. A 4-rank run
takes 5-12 s wall (about 2 s of training, the rest is start-up: MPI,
scikit-learn's import).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

# One BLAS thread per rank: the matrices are tiny, and several ranks per core
# with OpenBLAS's spinning threads ran 10x slower on the 2-core VM.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import gradsync  # noqa: E402


N_TEST = 360


def load_data():
    """The digits split: (x_train, y_train, x_test, y_test), float32 inputs in [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)  # pixel values are 0..16
    y = d.target.astype(np.int64)
    # A fixed shuffle (its own seed, not --seed): the same split on every rank
    # and in every run. (The last 360 samples in file order, written by
    # other people than most of the rest, cap every model near 93 %.)
    perm = np.random.RandomState(20240101).permutation(len(x))
    train, test = perm[:-N_TEST], perm[-N_TEST:]
    return x[train], y[train], x[test], y[test]


def init_params(hidden: int, seed: int):
    """He-initialized MLP 64 -> H -> H -> 10: list of (name, array), identical for a given seed."""
    rng = np.random.default_rng(seed)
    sizes = [64, hidden, hidden, 10]
    params = []
    for i in range(3):
        fan_in, fan_out = sizes[i], sizes[i + 1]
        w = (rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        b = np.zeros(fan_out, np.float32)
        params.append((f"fc{i + 1}.weight", w))
        params.append((f"fc{i + 1}.bias", b))
    return params


def forward(ws, x):
    """Logits and the activations the backward pass needs."""
    w1, b1, w2, b2, w3, b3 = ws
    z1 = x @ w1 + b1
    a1 = np.maximum(z1, 0)
    z2 = a1 @ w2 + b2
    a2 = np.maximum(z2, 0)
    logits = a2 @ w3 + b3
    return logits, (x, z1, a1, z2, a2)


def softmax_xent(logits, y):
    """Mean cross-entropy and its gradient with respect to the logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    p = e / e.sum(axis=1, keepdims=True)
    n = logits.shape[0]
    loss = float(-np.log(p[np.arange(n), y] + 1e-12).mean())
    dlogits = p
    dlogits[np.arange(n), y] -= 1.0
    dlogits /= n
    return loss, dlogits.astype(np.float32)


def backward(ws, cache, dlogits):
    """Gradients (float32, C-contiguous) in the order of the parameters."""
    w1, b1, w2, b2, w3, b3 = ws
    x, z1, a1, z2, a2 = cache
    gw3 = a2.T @ dlogits
    gb3 = dlogits.sum(axis=0)
    da2 = dlogits @ w3.T
    dz2 = da2 * (z2 > 0)
    gw2 = a1.T @ dz2
    gb2 = dz2.sum(axis=0)
    da1 = dz2 @ w2.T
    dz1 = da1 * (z1 > 0)
    gw1 = x.T @ dz1
    gb1 = dz1.sum(axis=0)
    return [np.ascontiguousarray(g, dtype=np.float32) for g in (gw1, gb1, gw2, gb2, gw3, gb3)]


def accuracy(ws, x, y) -> float:
    logits, _ = forward(ws, x)
    return float((logits.argmax(axis=1) == y).mean())


MODES = ["mpi-dense", "gradsync-dense", "dense", "auto", "rgc", "powersgd"]


class MpiDense:
    """The baseline a user has today: every gradient fused into one buffer,
    ``MPI_Allreduce`` (mpi4py, the MPI library's own algorithm), averaged,
    then momentum SGD's direction (``u = m u + g``, the same update as
    gradsync's dense layers)."""

    def __init__(self, comm, params, momentum: float):
        self.comm = comm
        self.sizes = [w.size for _, w in params]
        self.buf = np.zeros(sum(self.sizes), np.float32)
        self.u = np.zeros_like(self.buf)
        self.momentum = np.float32(momentum)
        self.inv = np.float32(1.0 / comm.Get_size())

    def sync(self, grads):
        off = 0
        for g in grads:
            self.buf[off:off + g.size] = g.ravel()
            off += g.size
        self.comm.Allreduce(MPI.IN_PLACE, self.buf, op=MPI.SUM)
        self.buf *= self.inv
        if self.momentum:
            self.u *= self.momentum
            self.u += self.buf
            d = self.u
        else:
            d = self.buf
        off = 0
        for g in grads:
            g.ravel()[:] = d[off:off + g.size]
            off += g.size
        return {"fused_bytes": 0, "dense_bytes": 4 * self.buf.size}


class Progress:
    """One progress bar per run on rank 0's stderr (a line per 10 % when
    stderr is not a terminal)."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = sys.stderr.isatty()
        self.last_tenth = -1

    def update(self, step: int, wall: float, acc):
        if not self.enabled:
            return
        frac = step / max(self.total, 1)
        tenth = int(frac * 10)
        if not self.tty and tenth == self.last_tenth and step != self.total:
            return
        self.last_tenth = tenth
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        a = "" if acc is None else f"  test acc {acc * 100:5.1f} %"
        line = f"{self.label:>15s} [{bar}] {step:5d}/{self.total}  {wall:7.1f} s{a}"
        end = "\n" if (not self.tty or step == self.total) else ""
        print(("\r" if self.tty else "") + line, end=end, file=sys.stderr, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, default="dense",
                    help="mpi-dense: MPI_Allreduce from mpi4py; gradsync-dense (or dense): gradsync's "
                         "fused Rabenseifner; auto: the cost model; rgc: RGC weights, dense biases")
    ap.add_argument("--density", type=float, default=0.001, help="RGC density for --mode rgc")
    ap.add_argument("--rank", type=int, default=2, help="PowerSGD rank for --mode powersgd")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--batch", type=int, default=64, help="global mini-batch (split across ranks)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--weight-decay", type=float, default=5e-4,
                    help="L2 coefficient added to the local weight gradients (g += wd * w) before sync")
    ap.add_argument("--warmup", type=int, default=50, help="dense warm-up steps (same in every mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON line (rank 0)")
    ap.add_argument("--profile", default=None,
                    help="cluster profile from `gradsync calibrate` (JSON); --mode auto plans with it")
    ap.add_argument("--auto-powersgd", type=int, default=0,
                    help="--mode auto: the PowerSGD rank the plan may choose (0: not offered)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="also measure the test accuracy every N steps (not counted in the times)")
    ap.add_argument("--curve", default=None,
                    help="write the run's record (accuracy curve, times, per-layer choice) to this JSON file")
    ap.add_argument("--progress", action="store_true", help="a progress bar on rank 0's stderr")
    ap.add_argument("--label", default=None, help="the run's name in the progress bar and the record")
    args = ap.parse_args(argv)
    mode = "gradsync-dense" if args.mode == "dense" else args.mode
    label = args.label or mode
    for flag, v in (("--steps", args.steps), ("--hidden", args.hidden), ("--batch", args.batch)):
        if v < 1:
            print(f"{flag} must be at least 1 (got {v})", file=sys.stderr)
            return 2
    if args.eval_every < 0 or args.warmup < 0:
        print("--eval-every and --warmup must be >= 0", file=sys.stderr)
        return 2

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.batch < size:
        if rank == 0:
            print(f"--batch {args.batch} is smaller than the {size} ranks", file=sys.stderr)
        return 2

    x_train, y_train, x_test, y_test = load_data()
    params = init_params(args.hidden, args.seed)
    names = [n for n, _ in params]
    ws = [w for _, w in params]

    if mode == "mpi-dense":
        sync = MpiDense(comm, params, args.momentum)
    else:
        extra = {"auto_powersgd": args.auto_powersgd} if args.auto_powersgd else {}
        sync = gradsync.GradSync(comm, profile=args.profile, momentum=args.momentum,
                                 warmup_steps=args.warmup, **extra)
        for name, w in params:
            if mode == "gradsync-dense":
                strategy = "dense"
            elif mode == "auto":
                strategy = "auto"
            elif mode == "powersgd":
                # Compression from the first step after the warm-up.
                strategy = (f"powersgd:rank={args.rank},start=0" if name.endswith("weight")
                            else "dense")
            else:
                strategy = f"rgc:density={args.density}" if name.endswith("weight") else "dense"
            sync.register(name, w.shape, strategy=strategy)

    rng = np.random.default_rng(args.seed + 1)  # same on every rank: same global batches
    n = len(x_train)
    order = rng.permutation(n)
    pos = 0
    bytes_total = 0
    layer_bytes = np.zeros(len(names))
    losses = []
    curve = []
    sync_s = compute_s = 0.0
    last_stats = None
    bar = Progress(label, args.steps, args.progress and rank == 0)
    comm.Barrier()
    for step in range(args.steps):
        t0 = time.perf_counter()
        if pos + args.batch > n:
            order = rng.permutation(n)
            pos = 0
        batch = order[pos:pos + args.batch]
        pos += args.batch
        shard = np.array_split(batch, size)[rank]  # disjoint across ranks

        logits, cache = forward(ws, x_train[shard])
        loss, dlogits = softmax_xent(logits, y_train[shard])
        grads = backward(ws, cache, dlogits)
        if args.weight_decay:
            for name, g, w in zip(names, grads, ws):
                if name.endswith("weight"):
                    g += args.weight_decay * w
        t1 = time.perf_counter()
        stats = sync.sync(grads)  # in place: grads now hold the update directions
        t2 = time.perf_counter()
        bytes_total += stats["fused_bytes"] + stats["dense_bytes"]
        if "layers" in stats:
            layer_bytes += [ls["bytes_sent"] for ls in stats["layers"]]
            last_stats = stats
        else:
            layer_bytes += [4 * g.size for g in grads]
        for w, d in zip(ws, grads):
            w -= args.lr * d
        losses.append(loss)
        t3 = time.perf_counter()
        sync_s += t2 - t1
        compute_s += (t1 - t0) + (t3 - t2)
        done = step + 1
        # Every rank evaluates (the same parameters, the same cost), so no
        # rank waits for another in the next step; not counted in the times.
        acc = None
        if args.eval_every and (done % args.eval_every == 0 or done == args.steps):
            acc = accuracy(ws, x_test, y_test)
            curve.append({"step": done, "wall_s": round(sync_s + compute_s, 6), "test_accuracy": acc})
        bar.update(done, sync_s + compute_s, acc)
    # The slowest rank's times.
    seconds = comm.allreduce(sync_s + compute_s, op=MPI.MAX)
    sync_max = comm.allreduce(sync_s, op=MPI.MAX)

    # Every rank must hold exactly the same parameters.
    crc = 0
    for w in ws:
        crc = zlib.crc32(np.ascontiguousarray(w).tobytes(), crc)
    crcs = comm.allgather(crc)
    identical = all(c == crcs[0] for c in crcs)

    test_acc = accuracy(ws, x_test, y_test)
    logits, _ = forward(ws, x_train)
    train_loss, _ = softmax_xent(logits, y_train)
    if mode == "mpi-dense":
        layers = [(nm, tuple(w.shape), "mpi-allreduce") for nm, w in params]
        strategies = ["mpi-allreduce"] * len(names)
    else:
        layers = sync.layers()
        # The strategy each layer ran at the last step (auto: the plan's).
        strategies = ([f"{ls['strategy']}" + (f":{ls['codec']}" if ls["codec"] != "none" else "")
                       for ls in last_stats["layers"]] if last_stats else [s for _, _, s in layers])
        sync.close()
    steps = max(args.steps, 1)
    record = {
        "name": label,
        "mode": args.mode,  # as given (`dense` stays `dense` for existing readers)
        "ranks": size,
        "steps": args.steps,
        "test_acc": round(test_acc, 6),
        "test_accuracy": round(test_acc, 6),
        "train_loss": round(train_loss, 6),
        "seconds": round(seconds, 3),
        "wall_s": round(seconds, 3),
        "sync_s_per_step": sync_max / steps,
        "compute_s_per_step": (seconds - sync_max) / steps,
        "bytes_sent_per_step": bytes_total / steps,
        "bytes_per_step": bytes_total / steps,
        "layers": [{"name": nm, "shape": list(shape), "elements": int(np.prod(shape)),
                    "strategy": st, "bytes_per_step": float(b / steps)}
                   for (nm, shape, _), st, b in zip(layers, strategies, layer_bytes)],
        "curve": curve,
    }

    if rank == 0:
        if args.curve:
            with open(args.curve, "w") as f:
                json.dump(record, f, indent=1)
        if args.json:
            print(json.dumps({k: record[k] for k in (
                "mode", "ranks", "steps", "test_acc", "train_loss", "seconds", "bytes_sent_per_step",
                "sync_s_per_step", "compute_s_per_step")}), flush=True)
        else:
            print(f"mode={mode} ranks={size} steps={args.steps} lr={args.lr} momentum={args.momentum} "
                  f"batch={args.batch} hidden={args.hidden} weight_decay={args.weight_decay} warmup={args.warmup} "
                  f"seed={args.seed}")
            for (name, shape, strategy), st in zip(layers, strategies):
                print(f"  {name:11s} {str(tuple(shape)):12s} {strategy} ({st} at the last step)")
            print(f"test accuracy {test_acc * 100:.2f} %  train loss {train_loss:.4f}  "
                  f"{seconds:.2f} s ({sync_max / steps * 1e3:.2f} ms/step synchronizing)  "
                  f"{bytes_total / steps:.0f} bytes sent per step")
            print("parameters identical on every rank" if identical else f"PARAMETERS DIFFER: crc32 {crcs}")
    if not identical:
        if rank == 0 and args.json:
            print(f"PARAMETERS DIFFER across ranks: crc32 {crcs}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
