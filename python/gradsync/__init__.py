"""gradsync: cheap gradient synchronization for data-parallel training under mpirun.

The Rust engine of gradsync (RedSync's residual sparse compression fused into
one allgather, Rabenseifner dense allreduce, the papers' codecs, an
alpha-beta-gamma cost model that picks a strategy per layer), called from an
mpi4py training loop. Gradients are numpy ``float32`` arrays updated in place
(no copy); the GIL is released while gradsync communicates; gradsync never
initializes or finalizes MPI.

Run a training script under mpirun, for example::

    mpirun -np 4 python -m mpi4py train.py

(``python -m mpi4py`` aborts the whole job when one rank raises an uncaught
exception, instead of leaving its peers waiting in a collective.)

Minimal use::

    from mpi4py import MPI
    import numpy as np
    import gradsync

    sync = gradsync.GradSync(MPI.COMM_WORLD, momentum=0.9)
    sync.register("fc1.weight", (256, 64))          # "auto": by size or the cost model
    sync.register("fc1.bias", (256,), strategy="dense")
    g1 = np.ones((256, 64), np.float32); g2 = np.ones(256, np.float32)
    stats = sync.sync([g1, g2])      # g1, g2 now hold the update directions

Errors on one rank never hang the others: an argument that is wrong on one
rank (dtype, layout, shape, number of layers) fails that step on every rank,
raising ``TypeError``/``ValueError`` on every rank at fault (on every rank
when all passed the same bad argument) and ``gradsync.Error`` on the
others; the next step runs normally.
"""

from __future__ import annotations

import collections.abc as _abc
import json as _json

import math as _math
import numpy as _np
import os as _os
from typing import Any, Dict, Iterable, Optional, Sequence, Union

from mpi4py import MPI as _MPI  # initializes MPI (gradsync never does)

from . import _gradsync
from ._gradsync import Error

__all__ = ["GradSync", "Error", "allreduce", "predict", "mpi_library_version", "mpi_vendor", "__version__"]
__version__: str = _gradsync.__version__


def mpi_library_version() -> str:
    """The ``MPI_Get_library_version`` string of the MPI library gradsync is linked with."""
    return _gradsync.mpi_library_version()


def _vendor_of(version: str) -> str:
    """The MPI family an ``MPI_Get_library_version`` string names, as
    mpi4py's ``MPI.get_vendor()`` spells it: ``"Open MPI"``, ``"MPICH"``
    (also Cray MPICH), ``"Intel MPI"``, ``"MVAPICH"``, else the string's
    first word."""
    low = version.lower()
    if "open mpi" in low:
        return "Open MPI"
    if "intel(r) mpi" in low or "intel mpi" in low:
        return "Intel MPI"
    if "mvapich" in low:
        return "MVAPICH"
    if "mpich" in low:
        return "MPICH"
    words = version.split()
    return words[0] if words else "?"


def mpi_vendor() -> str:
    """The MPI family gradsync is linked with (``"Open MPI"``, ``"MPICH"``,
    ``"Intel MPI"``, ``"MVAPICH"``; compare ``mpi4py.MPI.get_vendor()[0]``).
    Handles are passed as Fortran integers (``comm.py2f()``), which both
    families' mpi4py give, so nothing else differs for the caller."""
    return _vendor_of(_gradsync.mpi_library_version())


def _check_same_mpi() -> None:
    ours = _gradsync.mpi_library_version().replace("\x00", "").strip()
    theirs = _MPI.Get_library_version().replace("\x00", "").strip()
    first = lambda s: s.splitlines()[0].strip() if s else ""  # noqa: E731
    if first(ours) != first(theirs):
        raise ImportError(
            f"gradsync was built against a different MPI library ({_vendor_of(ours)}) "
            f"than mpi4py uses ({_vendor_of(theirs)}):\n"
            f"  gradsync: {first(ours) or '?'}\n"
            f"  mpi4py:   {first(theirs) or '?'}\n"
            "Install mpi4py from source against the same MPI "
            "(pip install --no-binary mpi4py mpi4py) or rebuild gradsync with that MPI's mpicc."
        )


_check_same_mpi()

PathLike = Union[str, "_os.PathLike[str]"]


class GradSync:
    """The per-step gradient synchronization engine over an mpi4py communicator.

    ``GradSync(comm, profile=None, momentum=0.9, nesterov=False, warmup_steps=0,
    nonfinite="error", **options)`` is collective over ``comm``, which it
    duplicates (``COMM_WORLD`` keeps working after the engine is gone).

    Parameters
    ----------
    comm:
        An mpi4py intra-communicator, e.g. ``MPI.COMM_WORLD``.
    profile:
        A cluster profile from ``gradsync calibrate`` (a path or the loaded
        dict). With one, ``register(..., strategy="auto")`` lets the cost
        model choose dense or sparse per layer; without, layers of at least
        ``compress_threshold`` (32768) elements are sparse (RGC at 0.1 %).
    momentum, nesterov:
        Momentum SGD, with RedSync's momentum correction for sparse layers.
        ``sync`` returns update directions: apply ``w -= lr * d``.
    warmup_steps:
        Dense steps before sparse ones.
    nonfinite:
        ``"error"`` (NaN/Inf in a gradient raises on every rank) or
        ``"propagate"`` (the layer's result is NaN on every rank).
    **options:
        Any other engine option: ``codec`` (e.g. ``"rgc:density=0.01"``),
        ``compress_threshold``, ``weight_decay`` (then pass ``weights`` to
        :meth:`sync`), ``clip_norm``, ``delay``, ``warmup`` (a density
        schedule, ``{"warmup": "density", "schedule": [...], "steps_per_stage": n}``),
        ``allreduce`` (``"rabenseifner"``, ``"ring"``, ``"mpi"``, ``"hierarchical"``),
        ``allgather`` (``"auto"``, the default: with ``profile`` the cost
        model's choice of ``"recdbl"`` or the node-aware ``"node"`` each
        step; ``"recdbl"``, ``"node"``, ``"mpi"``), ``sparse_exchange``
        (``"allgather"``, or ``"allreduce"``: the RGC and quantized RGC
        layers by one O(k) sparse allreduce instead of the fused
        allgatherv, same results; ``"hierarchical"``: the node-aware
        sparse allreduce; ``"auto"``: the cost model's choice among them
        every step, needs ``profile``), ``overlap``, ``auto_density``,
        ``auto_quant``, ``auto_powersgd`` (the PowerSGD rank ``"auto"`` may
        choose for matrices, 0: never). Unknown names raise ``ValueError``.
    """

    def __init__(
        self,
        comm: Any,
        profile: Optional[Union[PathLike, Dict[str, Any]]] = None,
        momentum: float = 0.9,
        nesterov: bool = False,
        warmup_steps: int = 0,
        nonfinite: Optional[str] = None,
        **options: Any,
    ) -> None:
        try:
            opts: Dict[str, Any] = dict(options)
            if "non_finite" in opts:
                # The engine's own spelling of ``nonfinite``: one of the two.
                if nonfinite is not None:
                    raise ValueError("give nonfinite or non_finite, not both")
                nonfinite = opts.pop("non_finite")
            if nonfinite is None:
                nonfinite = "error"
            opts.update(momentum=momentum, nesterov=nesterov, nonfinite=nonfinite)
            for k, v in opts.items():
                # JSON has no NaN or infinity: name the option, not the encoder.
                if isinstance(v, float) and not _math.isfinite(v):
                    raise ValueError(f"option {k!r}: {v} is not a finite number")
            if "warmup" not in opts or warmup_steps:
                opts["warmup_steps"] = warmup_steps
            if profile is not None:
                opts["profile"] = profile if isinstance(profile, dict) else _os.fsdecode(profile)
            text = _json.dumps(opts, allow_nan=False, default=_plain)
        except Exception as e:  # noqa: BLE001
            # This rank's own options failed: still enter the collective
            # set-up (every rank fails alike, naming this one), then raise
            # the original error type here.
            why = f"{type(e).__name__}: {e}"
            try:
                _gradsync.GradSync(comm, "null", why)
            except Exception as collective:  # noqa: BLE001
                raise type(e)(f"{e} (raised on every rank: {collective})") from collective
            raise
        self._engine = _gradsync.GradSync(comm, text)
        # For set-up agreements of the layers above it (gradsync.torch).
        self._comm = comm
        # The options as given (gradsync.torch reads weight_decay, delay).
        self._options = dict(opts)

    def _delayed(self) -> bool:
        delay = self._options.get("delay", 1)
        return isinstance(delay, int) and delay > 1

    def register(self, name: str, shape: Union[int, Sequence[int]], strategy: str = "auto") -> int:
        """Register a layer (collective: every rank registers the same layers in the same order).

        ``strategy`` is ``"auto"`` (the cost model with a profile, else by
        size), ``"dense"``, ``"gradiveq"`` (optionally ``"gradiveq:k=768,d=96"``)
        or a codec string: ``"rgc:density=0.001"``, ``"rgc-quant:density=0.001"``,
        ``"3lc:s=1.75"``, ``"sbc"``, ``"qsgd:bits=4"``, ``"fastsgd"``, ``"fp16"``,
        ``"int8"``. Returns the layer's index. A table that differs across
        ranks raises ``gradsync.Error`` on every rank.
        """
        return self._engine.register(name, shape, strategy)

    def complete_table(self) -> None:
        """Declare the layer table complete now (collective; the first step does it otherwise).

        Runs the check that every rank registered the same layers and, with
        ``strategy="auto"``, the cost model's plan (``layers()`` then shows
        the choices). Call it where several engines' first steps may start
        in orders that differ across ranks. No layer can be registered after.
        """
        self._engine.complete_table()

    def strategies(self) -> list:
        """Every layer's strategy as a JSON string (``auto`` resolved once the
        table is complete), which :meth:`register` takes as ``strategy``."""
        return self._engine.strategies()

    def sync(self, grads: Sequence[Any], weights: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
        """One step: replace each gradient (in place) by its layer's update direction.

        ``grads`` holds one C-contiguous writable ``float32`` array per
        registered layer, in registration order, of the registered shape (or
        flat): numpy arrays, or CPU tensors of another library (PyTorch,
        JAX, ...) that support DLPack, used in place through a zero-copy
        view. Half precision: numpy ``float16`` arrays and DLPack tensors of
        ``float16`` or ``bfloat16`` (several dtypes in one table) are
        widened into float32 workspaces, stepped in float32 and written back
        rounded once to their dtype (the bound is in ``docs/pytorch.md``). CUDA tensors (DLPack device type 2) need a gradsync built with
        the cargo feature ``cuda`` (``maturin build --features cuda``): they
        are imported through DLPack with ``stream=1`` (the producer's pending
        work is ordered before gradsync's copies), staged through pinned host
        memory, stepped by the host engine and written back in place on the
        device; without the feature, or without a usable GPU, the step fails
        on every rank naming the cause. Returns the step's stats: ``step``, ``fused_bytes``,
        ``dense_bytes``, timings in seconds, and ``layers``, one dict per
        layer (``name``, ``strategy``, ``codec``, ``density``,
        ``bytes_sent``, ``ratio``, ...). With the ``weight_decay`` option,
        pass ``weights`` (one array per layer, read only) too. With ``delay``
        above 1 pass ``weights`` at every step, writable (float32 numpy arrays,
        or CPU tensors viewed in place): each communicating step writes the
        weights of the last one back into them, so that every rank's weights
        are the same, bit for bit, once the result is applied.
        """
        g, w = self._inputs(grads, weights, writable=True)
        return self._engine.sync(g, w)

    def start(self, grads: Sequence[Any], weights: Optional[Sequence[Any]] = None) -> None:
        """Compress this step's gradients and start communicating on gradsync's progress thread.

        Returns as soon as the gradients have been consumed (they may be
        overwritten); finish with :meth:`wait`. A bad argument on one rank
        fails this step on every rank: that rank raises here (the step is
        then over: do not call :meth:`wait`), its peers raise
        ``gradsync.Error`` from their :meth:`wait`.
        """
        g, w = self._inputs(grads, weights, writable=False)
        self._engine.start(g, w)

    def _inputs(self, grads: Any, weights: Any, writable: bool) -> Any:
        """The step's arrays; if reading them raises (a generator, a
        container or a tensor of the caller's), the step still fails on every
        rank, through :meth:`fail_step`, before this rank raises that error:
        its peers are about to enter the step's collectives."""
        try:
            # With a delay the engine writes the weights back: views that
            # can be written (a tensor's numpy view, not a read-only copy).
            return _arrays(grads, writable), _arrays(weights, writable=self._delayed())
        except Exception as e:  # noqa: BLE001 - re-raised below
            try:
                self._engine.fail_step(f"reading the arrays raised {type(e).__name__}: {e}")
            except Exception as step_error:  # noqa: BLE001 - the caller's error first
                raise e from step_error
            raise e

    def wait(self, grads: Sequence[Any]) -> Dict[str, Any]:
        """Finish the step begun by :meth:`start`, writing update directions into ``grads`` in place.

        A bad output argument raises on this rank only and keeps the result,
        so ``wait`` can be called again with the right arrays. The next
        :meth:`sync`, :meth:`start` or :meth:`fail_step` without that
        finishes the kept step first and discards its result on this rank
        (a ``RuntimeWarning`` says so), so this rank never refuses a step
        its peers are already in.
        """
        # Read-only views stay: the engine's error names why (a legacy
        # DLPack import); wait has no path for raw tensors.
        return self._engine.wait(_arrays(grads, writable=False))

    def submit_bucket(self, layers: Sequence[int], grads: Sequence[Any],
                      weights: Optional[Sequence[Any]] = None) -> None:
        """Submit one bucket of this step: ``grads[j]`` is layer ``layers[j]``'s gradient.

        The step in parts, as DDP and Horovod cut it: call it as soon as
        backward has produced a bucket's gradients (any subset of the
        layers not yet submitted this step, e.g. the last layers first).
        Its compression runs here and its collectives on gradsync's
        progress thread while backward goes on; the arrays are only read (but
        with ``delay`` above 1 the weights are written back at a communicating step)
        and may be reused when it returns. Finish the step with
        :meth:`finish_step`. The results equal :meth:`sync`'s of the whole
        step bit for bit (``docs/pytorch.md`` says how, and which options
        make the engine run the step at its last bucket instead). Every
        rank must cut the step alike: if one rank cuts it otherwise, every
        rank's :meth:`finish_step` raises ``gradsync.Error`` for that step.
        A bad array fails the step on every rank (this rank raises here);
        a layer index out of range or already submitted raises
        ``ValueError`` here only.
        """
        g, w = self._bucket_inputs(layers, grads, weights)
        self._engine.submit_bucket(list(layers), g, w)

    def _bucket_inputs(self, layers: Any, grads: Any, weights: Any) -> Any:
        try:
            return _arrays(grads, writable=False), _arrays(weights, writable=self._delayed())
        except Exception as e:  # noqa: BLE001 - re-raised below
            self._engine.fail_bucket(list(layers), f"reading the arrays raised {type(e).__name__}: {e}")
            raise e

    def fail_bucket(self, layers: Sequence[int], reason: Any) -> None:
        """Submit bucket ``layers`` carrying an error found on this rank.

        Every rank's step then fails alike at :meth:`finish_step`, naming
        this rank and ``reason``; the next step runs normally.
        """
        self._engine.fail_bucket(list(layers), reason)

    def finish_step(self, grads: Sequence[Any]) -> Dict[str, Any]:
        """Finish the step whose buckets were submitted, writing every layer's direction into ``grads``.

        ``grads`` holds one array per registered layer, as for :meth:`wait`.
        Layers never submitted fail the step on every rank. Returns the
        step's stats (``buckets``: how many the step had).
        """
        return self._engine.finish_step(_arrays(grads, writable=False))

    def plan_buckets(self, backward_s: float, bucket_cap_mb: Optional[float] = None) -> Dict[str, Any]:
        """The step model's plan of this table as a step in buckets against a backward pass of ``backward_s`` seconds.

        Cut at ``bucket_cap_mb`` MiB (reverse registration order), or with
        ``None`` at the cap of least predicted step time. Returns a dict:
        ``cap_bytes`` (``None``: the whole table as one bucket),
        ``buckets`` (each with ``layers``, ``elements``, ``ready_s``,
        ``start_s``, ``end_s``, ``seconds``), ``step_s`` (from the start of
        backward to the step's end), ``exposed_s``, ``whole_s`` (the whole
        step after backward) and ``tried``. Needs the ``profile`` option
        and a complete table (:meth:`complete_table` or a step); local:
        give every rank the same ``backward_s``.
        """
        cap = None if bucket_cap_mb is None else int(bucket_cap_mb * 2**20)
        return self._engine.plan_buckets(float(backward_s), cap)

    @property
    def pending(self) -> bool:
        """Whether a step was started (or has buckets) and is not finished."""
        return self._engine.pending()

    def fail_step(self, reason: Any) -> None:
        """Take part in this step with an error found on this rank, so that no peer waits.

        Call it instead of :meth:`sync` when this rank cannot produce its
        gradients (its data loader or backward pass raised): every rank's
        step fails alike, the others raising ``gradsync.Error`` naming this
        rank and ``reason`` from their :meth:`sync` or :meth:`wait`, and the
        next step runs normally. Raises ``gradsync.Error`` here too::

            try:
                loss = model.backward(batch)
            except Exception as e:
                sync.fail_step(f"{type(e).__name__}: {e}")  # raises on every rank
        """
        self._engine.fail_step(reason)

    def save_snapshot(self, path: PathLike) -> None:
        """Write this rank's engine state (residuals, momentum, step, codec state) to ``path``.

        Each rank writes its own file (e.g. ``f"ckpt/gradsync.rank{rank}.snap"``).
        """
        self._engine.save_snapshot(path)

    def load_snapshot(self, path: PathLike) -> None:
        """Restore the state written by :meth:`save_snapshot` (collective).

        A missing or corrupt file on one rank, or files from different
        steps or different runs (each job that creates or restores an
        engine writes its own run identity), fail every rank with
        ``gradsync.Error`` and change no engine. A step this rank kept after
        its :meth:`wait` raised is finished first, with a ``RuntimeWarning``.
        """
        self._engine.load_snapshot(path)

    def last_stats(self) -> Dict[str, Any]:
        """The last step's stats (as returned by :meth:`sync`)."""
        return self._engine.last_stats()

    def layers(self) -> list:
        """The registered layers: ``(name, shape, strategy)`` tuples; ``auto`` shows its choice."""
        return self._engine.layers()

    @property
    def rank(self) -> int:
        """This rank in the engine's communicator."""
        return self._engine.rank

    @property
    def size(self) -> int:
        """Number of ranks."""
        return self._engine.size

    @property
    def step(self) -> int:
        """Steps run so far."""
        return self._engine.step

    def close(self) -> None:
        """Free the engine and its duplicated communicator now (also done when it is garbage collected).

        Call it on every rank at the same point, as ``MPI_Comm_free``: a rank
        that closes while its peers go on to another step leaves them
        waiting in that step.
        """
        self._engine.close()

    def __enter__(self) -> "GradSync":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _arrays(xs: Any, writable: bool = True) -> Any:
    """numpy arrays as they are; other CPU tensors (PyTorch, JAX, ...) as
    zero-copy numpy views through DLPack. Anything that does not convert is
    passed on unchanged, so the engine reports it (on every rank); so is,
    where ``writable``, a tensor whose numpy view came back read-only
    (numpy marks imports of legacy, unversioned DLPack capsules so): the
    engine's own DLPack importer writes those in place."""
    if isinstance(xs, _abc.Iterator) or (
        isinstance(xs, _abc.Sequence) and not isinstance(xs, (list, tuple, str, bytes))
    ):
        # A generator is read once: into a list, so no array is lost; other
        # sequences (UserList, deque) into a list, so their tensors convert.
        xs = list(xs)
    if not isinstance(xs, (list, tuple)):
        return xs
    # Overlapping memory (a tensor passed twice) is refused by the engine,
    # by address, for the arrays it writes.
    return [x if type(x) is _np.ndarray else _dlpack_view(x, writable) for x in xs]


def _dlpack_view(x: Any, writable: bool = True) -> Any:
    if hasattr(x, "__dlpack__"):
        try:
            v = _np.from_dlpack(x)
        except Exception:  # noqa: BLE001 - the engine reports it
            return x
        if writable and not v.flags.writeable and not _versioned_dlpack(x):
            # numpy marks every import of a legacy (unversioned) capsule
            # read-only; the engine's importer takes those in place. A
            # versioned producer's read-only flag is its own: kept.
            return x
        return v
    return x


def _versioned_dlpack(x: Any) -> bool:
    """Whether ``x.__dlpack__`` takes ``max_version`` (DLPack 1.0 and later)."""
    import inspect

    try:
        params = inspect.signature(x.__dlpack__).parameters
    except (TypeError, ValueError):
        return True  # cannot tell: keep the read-only view (the safe side)
    return "max_version" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _plain(o: Any) -> Any:
    """JSON for numpy scalars and paths in options."""
    if hasattr(o, "item") and callable(o.item):
        return o.item()
    if isinstance(o, _os.PathLike):
        return _os.fsdecode(o)
    raise TypeError(f"option value {o!r} is not JSON-serializable")


def allreduce(comm: Any, array: Any, algo: str = "rabenseifner", op: str = "sum") -> None:
    """In-place allreduce of a C-contiguous writable ``float32`` or ``float64`` numpy array over ``comm``.

    ``algo``: ``"rabenseifner"`` (recursive halving/doubling), ``"ring"``,
    ``"mpi"`` (the MPI library's own ``MPI_Allreduce``) or ``"hierarchical"``
    (node-aware: within each node, then across nodes); ``op``: ``"sum"`` or
    ``"average"``. Lengths, dtypes and local errors are agreed first, so a
    mismatch or a bad array on one rank raises on every rank (as do an
    ``algo`` or ``op`` that differ across ranks), naming the rank: the
    failing one, or the lowest that passed the smallest and the largest
    length, or the lowest whose dtype, ``algo`` or ``op`` is not rank 0's.
    The values are not
    inspected, as ``MPI_Allreduce`` does not inspect them: a NaN or Inf
    reaches every rank's result alike (``GradSync.sync`` checks gradients).
    ``"average"`` divides the sum by the number of ranks. The algorithm's
    scratch (half the array for ``"rabenseifner"``, the whole array for
    ``"mpi"``) is kept for the next call, so a loop of calls does not fault
    fresh pages in every time; it stays, for the life of the process, as
    large as the largest it needed.
    """
    _gradsync.allreduce(comm, _dlpack_view(array) if type(array) is not _np.ndarray else array, algo, op)


def predict(
    elements: int,
    ranks: int,
    density: float = 0.001,
    profile: Optional[PathLike] = None,
    **model: Any,
) -> Dict[str, Any]:
    """The cost model's prediction for one layer, as ``gradsync predict --json`` prints it.

    Give ``profile`` (a ``gradsync calibrate`` file), or ``alpha`` (seconds)
    and ``bandwidth`` (bytes/s). Other keywords: ``gamma_reduce``,
    ``gamma_unpack``, ``select_cost``, ``select_fixed``, ``select_method``,
    ``gradiveq_ratio``, ``strategies`` (a list of names), and the
    two-level model's ``ranks_per_node`` (block placement; the node-aware
    strategies are priced only when it is below ``ranks``),
    ``inter_alpha`` (seconds) and ``inter_bandwidth`` (bytes/s) for the
    link between nodes (default: the profile's ``inter_node``), ``fill``
    (a measured fill ratio in (0, 1]), ``shape`` (the layer's, a list
    whose product is ``elements``) and ``powersgd_rank`` (1): with a
    profile that prices PowerSGD, ``powersgd`` is priced on the shape's
    matrix (first dimension by the rest), or without one on the most
    nearly square view, given as ``powersgd_matrix``. Errors name these
    keywords. Returns ``{"elements", "bytes", "ranks", "density",
    "strategies": [{"name", "seconds", "wire_bytes"}, ...], "choice"}``
    (and ``"powersgd_matrix": [rows, cols]`` where PowerSGD is priced).

    >>> import gradsync
    >>> r = gradsync.predict(10**6, 64, alpha=5e-6, bandwidth=1e10,
    ...                      ranks_per_node=8, inter_alpha=2e-5, inter_bandwidth=1.25e8)
    >>> "sparse-hierarchical" in [s["name"] for s in r["strategies"]]
    True
    """
    return _gradsync.predict(
        elements, ranks, density, _os.fspath(profile) if profile is not None else None, **model
    )
