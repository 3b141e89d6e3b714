"""gradsync.torch: PyTorch integration in Horovod's shape (CPU tensors).

::

    import torch
    from mpi4py import MPI
    import gradsync.torch as gst

    model = Net()
    gst.broadcast_parameters(model.state_dict(), root=0)     # same start on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = gst.DistributedOptimizer(opt, model.named_parameters())
    for x, y in shard_of_the_data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()            # gradients synchronized in place, then SGD

Run it under mpirun (``mpirun -np 4 python -m mpi4py train.py``).

This module imports without PyTorch (``import gradsync.torch`` always works);
PyTorch is imported when :class:`DistributedOptimizer` or
:func:`broadcast_parameters` is used, which raise a clear ``ImportError``
when it is missing.

Gradients are ``float32``, ``float16`` or ``bfloat16`` (several in one
model is fine). float32 CPU gradients are read and written in place through
numpy views that share the tensors' memory (no copy); half-precision ones go
to the engine through DLPack, are summed, selected and kept as residuals in
float32 and written back rounded once to their dtype (the bound is in
``docs/pytorch.md``). CUDA gradients
go to the engine as they are, through DLPack (a gradsync built with the cargo
feature ``cuda``; otherwise the step fails on every rank naming the cause).
:func:`broadcast_parameters` takes CPU tensors only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

__all__ = ["DistributedOptimizer", "GradSyncHookState", "broadcast_parameters", "gradsync_hook"]

Strategy = Union[str, Mapping[str, str], Callable[[str, Any], str]]


def _import_torch() -> Any:
    """Import PyTorch, or raise an ``ImportError`` saying what needs it."""
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "gradsync.torch.DistributedOptimizer and broadcast_parameters need PyTorch, "
            "which is not installed (pip install torch); the rest of gradsync works without it"
        ) from e
    return torch


def _engine_view(torch: Any, name: str, t: Any, what: str) -> Any:
    """What the engine takes for ``t`` (float32, contiguous): a flat numpy view
    sharing a CPU tensor's memory, a CUDA tensor itself (the engine imports it
    through DLPack; that needs a gradsync built with the cargo feature
    ``cuda``), or a clear error."""
    if t.layout != torch.strided:
        raise TypeError(f"{what} of {name!r} is a sparse tensor: gradsync needs dense float32 tensors")
    if t.device.type not in ("cpu", "cuda"):
        raise TypeError(f"{what} of {name!r} is on {t.device}: gradsync takes CPU and CUDA tensors")
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"{what} of {name!r} is {t.dtype}: gradsync synchronizes torch.float32, float16 and bfloat16"
        )
    if not t.is_contiguous():
        raise ValueError(f"{what} of {name!r} is not contiguous")
    if t.device.type == "cuda" or t.dtype != torch.float32:
        # Half precision: the engine imports the tensor through DLPack and
        # steps it through a float32 workspace (numpy has no bfloat16).
        return t
    arr = t.detach().numpy().reshape(-1)  # shares memory: a view, never a copy
    if t.numel() and arr.__array_interface__["data"][0] != t.data_ptr():
        raise RuntimeError(f"internal error: the numpy view of {what} of {name!r} does not share its memory")
    return arr


_SETUP = "gradsync.torch set-up (DistributedOptimizer or GradSyncHookState)"
_BROADCAST = "gradsync.torch.broadcast_parameters"


def _call_kind(comm: Any, kind: str) -> None:
    """The first collective of a ``gradsync.torch`` helper (one small
    allgather over ``comm``): ranks in different helpers (one broadcasts the
    parameters while another sets up the optimizer) all raise
    ``gradsync.Error`` naming both calls, as the engine's own calls do,
    instead of meeting in two different collectives."""
    import gradsync

    tag = "gradsync-call"
    kinds = comm.allgather((tag, kind))
    odd = next((r for r, k in enumerate(kinds) if k != kinds[0]), None)
    if odd is not None:
        def name(k: Any) -> str:
            return k[1] if isinstance(k, tuple) and len(k) == 2 and k[0] == tag else repr(k)

        raise gradsync.Error(
            f"the call differs across ranks: rank 0 is in {name(kinds[0])}, rank {odd} in "
            f"{name(kinds[odd])}; every rank must make the same gradsync calls in the same order"
        )


def _agree(comm: Any, local_error: Optional[BaseException], count: int) -> None:
    """Collective over ``comm`` (``COMM_WORLD`` when ``None``): every rank
    raises if any rank passed an error (its own error type on that rank,
    ``gradsync.Error`` naming it elsewhere), or if the ranks' ``count`` of
    parameters differ."""
    import gradsync

    if comm is None:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    why = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
    infos = comm.allgather((why, count))
    failed = [(r, w) for r, (w, _) in enumerate(infos) if w is not None]
    if failed:
        r, w = failed[0]
        text = f"rank {r} failed: {w}"
        if len(failed) > 1:
            text += f" (and {len(failed) - 1} other rank{'s' if len(failed) > 2 else ''})"
        if local_error is not None:
            raise type(local_error)(f"{local_error} (raised on every rank: {text})") from local_error
        raise gradsync.Error(text)
    counts = [c for _, c in infos]
    if len(set(counts)) > 1:
        raise ValueError(
            "the ranks synchronize different numbers of parameters (those that require grad): "
            + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        )


def _engine_for(
    torch: Any,
    named_parameters: Iterable[Tuple[str, Any]],
    sync: Optional[Any],
    strategy: Strategy,
    gradsync_options: Dict[str, Any],
    optimizer: Optional[Any] = None,
    setup_error: Optional[BaseException] = None,
    overlap: Optional[Tuple[Optional[float], int, bool]] = None,
) -> Tuple[Any, List[Tuple[str, Any]], bool]:
    """The engine of :class:`DistributedOptimizer` and :class:`GradSyncHookState`
    (collective): ``(sync, params, owns_sync)``, with ``params`` the
    ``(name, tensor)`` pairs registered in order. A check that fails on one
    rank (``setup_error`` included) fails every rank without a hang.
    ``optimizer``'s parameters must all be among ``named_parameters``.
    ``overlap=(bucket_cap_mb, backward_passes_per_step, param_hooks)``: the step in
    buckets (:mod:`gradsync._overlap`) where every rank can overlap."""
    import gradsync
    from mpi4py import MPI

    _call_kind(getattr(sync, "_comm", None) or MPI.COMM_WORLD, _SETUP)
    try:
        if setup_error is not None:
            raise setup_error
        if isinstance(named_parameters, Mapping):
            named_parameters = named_parameters.items()
        params: List[Tuple[str, Any]] = []
        seen_ids: Dict[int, str] = {}
        seen_names = set()
        for item in named_parameters:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(
                    "named_parameters must yield (name, tensor) pairs, e.g. model.named_parameters()"
                )
            name, p = item
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameter {name!r} is a {type(p).__name__}, not a torch.Tensor")
            if name in seen_names:
                raise ValueError(f"parameter name {name!r} appears twice in named_parameters")
            seen_names.add(name)
            if not p.requires_grad or id(p) in seen_ids or p.numel() == 0:
                continue
            seen_ids[id(p)] = name
            params.append((name, p))
        missing = [
            tuple(p.shape)
            for group in (optimizer.param_groups if optimizer is not None else [])
            for p in group["params"]
            if p.requires_grad and p.numel() and id(p) not in seen_ids
        ]
        if missing:
            raise ValueError(
                f"{len(missing)} parameter(s) of the optimizer (shapes {missing[:4]}) are not in "
                "named_parameters: their gradients would not be synchronized and the ranks would diverge"
            )
    except Exception as e:  # noqa: BLE001
        if sync is not None:
            # A given engine: the agreement below carries this rank's
            # error to every rank (the peers enter it too).
            local_error: Optional[BaseException] = e
            params = []
        else:
            # A check that failed on this rank only: still enter the
            # collective the peers are entering now (the engine's
            # set-up), so they fail too instead of waiting; then raise
            # the original error here.
            why = f"{type(e).__name__}: {e}"
            try:
                from mpi4py import MPI

                gradsync._gradsync.GradSync(MPI.COMM_WORLD, "null", why)
            except Exception as collective:  # noqa: BLE001
                raise type(e)(f"{e} (raised on every rank: {collective})") from collective
            raise
    else:
        local_error = None

    if sync is None:
        from mpi4py import MPI

        opts = dict(gradsync_options)
        opts.setdefault("momentum", 0.0)
        sync = gradsync.GradSync(MPI.COMM_WORLD, **opts)
        owns = True
    else:
        if gradsync_options and local_error is None:
            local_error = TypeError(
                "give either sync (an engine of your own) or gradsync options "
                f"({', '.join(sorted(gradsync_options))}), not both"
            )
        owns = False

    existing = sync.layers()
    if existing and local_error is None:
        ours = [(n, int(p.numel())) for n, p in params]
        theirs = [(n, int(np.prod(s, dtype=np.int64))) for n, s, _ in existing]
        if ours != theirs:
            local_error = ValueError(
                "the given sync engine already has a layer table that does not match the "
                f"parameters: engine {theirs[:4]}..., parameters {ours[:4]}..."
            )
    # Every rank: one agreement on this rank's outcome and on how many
    # parameters it synchronizes, before any registration. A rank whose
    # check failed, or with fewer parameters (a frozen last layer),
    # would otherwise return while its peers wait in a registration.
    _agree(getattr(sync, "_comm", None), local_error, len(params))
    if owns and overlap is not None:
        bucketed = _bucketed(torch, sync, params, strategy, gradsync_options, overlap)
        if bucketed is not None:
            return bucketed, params, owns
    if not existing:
        _register_all(sync, params, strategy)
    return sync, params, owns


def _register_all(sync: Any, params: List[Tuple[str, Any]], strategy: Strategy) -> None:
    """Register ``params`` on ``sync`` in order (collective); a strategy
    that fails on one rank fails every rank's registration alike."""
    for name, p in params:
        try:
            spec, mine = _strategy_of(strategy, name, p), None
        except Exception as e:  # noqa: BLE001
            # Register anyway with a spec that cannot parse: every
            # rank's registration fails alike.
            spec, mine = f"<{type(e).__name__}: {e}>", e
        try:
            sync.register(name, tuple(p.shape) if p.dim() else (1,), strategy=spec)
        except Exception as collective:  # noqa: BLE001
            if mine is not None:
                raise type(mine)(f"{mine} (raised on every rank: {collective})") from collective
            raise


def _bucketed(
    torch: Any,
    sync: Any,
    params: List[Tuple[str, Any]],
    strategy: Strategy,
    options: Dict[str, Any],
    overlap: Tuple[float, int, bool],
) -> Optional[Any]:
    """The engine ``sync`` with its layers registered, behind the buckets of
    an overlapped step (collective over the engine's communicator, entered by
    every rank), or ``None`` when some rank cannot overlap (every rank then
    keeps the whole-step engine ``sync``, which has no layers yet; rank 0
    says why once in a warning)."""
    from gradsync import _overlap

    cap_mb, passes, param_hooks = overlap
    opts = dict(options)
    opts.setdefault("momentum", 0.0)
    refusal = _overlap.overlap_refusal(torch, params, opts)
    reasons = sync._comm.allgather(refusal)
    refused = [(r, why) for r, why in enumerate(reasons) if why is not None]
    if refused:
        if sync.rank == 0:
            import warnings

            r, why = refused[0]
            warnings.warn(
                f"gradsync.torch: no overlap (rank {r}: {why}); "
                "synchronizing the whole step at once",
                RuntimeWarning,
                stacklevel=4,
            )
        return None
    # One engine, one table: the buckets are parts of its step.
    _register_all(sync, params, strategy)
    sync.complete_table()
    cap = None if cap_mb is None else int(cap_mb * 2**20)
    weights = _needs_weights(opts)
    return _overlap.BucketedSync(torch, sync, cap, params, passes, param_hooks, weights)


def _needs_weights(opts: Mapping[str, Any]) -> bool:
    """Whether the engine takes the parameters with the gradients: weight
    decay reads them (``g += wd·w``); a communication delay (``delay > 1``)
    writes them (each communicating step puts back the weights every rank
    had at the last one, so the replicas never drift)."""
    delay = opts.get("delay", 1)
    return bool(opts.get("weight_decay")) or (isinstance(delay, int) and delay > 1)


def _stateless(torch: Any, optimizer: Any) -> bool:
    """Whether ``optimizer`` keeps no state from one step to the next:
    ``torch.optim.SGD`` without momentum or weight decay."""
    return type(optimizer) is torch.optim.SGD and all(
        not g.get("momentum") and not g.get("weight_decay") for g in optimizer.param_groups
    )


def _strategy_of(strategy: Strategy, name: str, p: Any) -> str:
    if isinstance(strategy, str):
        return strategy
    if isinstance(strategy, Mapping):
        return strategy.get(name, "auto")
    if callable(strategy):
        return strategy(name, p)
    raise TypeError(f"strategy must be a string, a mapping or a callable, not {type(strategy).__name__}")


class DistributedOptimizer:
    """Wrap a PyTorch optimizer so that ``step()`` first synchronizes the gradients with gradsync.

    ``DistributedOptimizer(optimizer, named_parameters, sync=None,
    strategy="auto", overlap=True, bucket_cap_mb=None,
    backward_passes_per_step=1, **gradsync_options)``, collective over the engine's
    communicator (``MPI.COMM_WORLD`` unless ``sync`` is given): every rank
    must construct it with the same parameters in the same order.

    Parameters
    ----------
    optimizer:
        The ``torch.optim.Optimizer`` to wrap. ``zero_grad``, ``state_dict``,
        ``load_state_dict``, ``param_groups`` and every other attribute are
        delegated to it (LR schedulers: attach them to ``opt.optimizer``,
        which shares ``param_groups``).
    named_parameters:
        ``model.named_parameters()``: the ``(name, tensor)`` pairs to
        synchronize. Those that require grad are registered with the engine,
        in this order (a parameter listed twice, e.g. tied weights, once).
        Every parameter of ``optimizer`` must be among them.
    sync:
        A :class:`gradsync.GradSync` of your own. If it has no layers yet,
        the parameters are registered on it; if it has, its table must list
        exactly these parameters (names and element counts) in this order.
        Do not combine it with ``gradsync_options``.
    overlap:
        ``True`` (the default): synchronize while backward runs, as Horovod
        does. The parameters are cut into buckets of up to ``bucket_cap_mb``
        (reverse registration order, as backward produces them), fixed for
        the run, the parts of one engine's step
        (:meth:`gradsync.GradSync.submit_bucket`); a hook on every parameter
        submits a bucket as soon as all its gradients are accumulated (its
        collectives run on the engine's progress thread), and ``step()``
        waits only for what is still in flight. The result is the
        whole-step engine's, bit for bit, for every strategy and option
        (with ``clip_norm`` or an ``allreduce`` whose rounding depends on
        the fused layout the engine runs the step when its last bucket
        arrives). Falls back to the whole step, with a ``RuntimeWarning``
        on rank 0 naming why, where a rank cannot overlap: MPI below
        ``MPI_THREAD_SERIALIZED``, gradients that are not float32 on the
        CPU (see :mod:`gradsync._overlap`); a ``sync`` of your own is used
        whole, without a warning.
        ``False``: today's whole step inside ``step()``.
    bucket_cap_mb:
        Bucket size with overlap, MiB. ``None`` (the default): 25 (DDP's
        default) for the first step, then the cap the step model predicts
        fastest for the backward pass that step measured (the ranks'
        longest; needs the ``profile`` option, else 25 stays;
        ``sync.bucket_plan`` shows the plan, :meth:`gradsync.GradSync.plan_buckets`).
    backward_passes_per_step:
        Gradient accumulation with overlap: a bucket starts when each of its
        gradients has been accumulated this many times (the sum is
        averaged over the ranks, not divided by the passes).
    strategy:
        The registration strategy: one string for every parameter
        (``"auto"``, ``"dense"``, ``"rgc:density=0.001"``, ...), a mapping
        ``name -> strategy`` (missing names: ``"auto"``) or a callable
        ``(name, param) -> strategy``.
    **gradsync_options:
        Options for the engine created when ``sync`` is None
        (``GradSync(MPI.COMM_WORLD, **gradsync_options)``), with
        ``momentum=0.0`` unless given.

    Why ``momentum=0.0`` by default: gradsync's ``sync`` returns update
    *directions* with its own momentum already applied, and the wrapped torch
    optimizer then applies *its* momentum (and weight decay, Adam moments,
    ...) to those directions. With both, momentum would be applied twice. So
    by default gradsync only averages (dense layers) or compresses with error
    feedback (sparse layers) and the torch optimizer does the rest. For
    RedSync's momentum correction on sparse layers (momentum accumulated
    before compression, which keeps RGC at 0.1 % close to dense), give
    gradsync the momentum instead and use plain SGD without it::

        opt = DistributedOptimizer(torch.optim.SGD(params, lr=0.1),   # momentum=0
                                   model.named_parameters(), momentum=0.9)

    Attributes: ``optimizer`` (the wrapped optimizer), ``sync`` (the
    :class:`gradsync.GradSync` engine, or with overlap its bucketed step
    behind the same calls: ``sync.layers()``, ``sync.step``,
    ``sync.save_snapshot(path)`` for residuals and momentum), ``overlap`` (whether it overlaps), ``last_stats`` (the last
    step's stats, or None).

    Errors: a gradient that is not a dense ``float32``, ``float16`` or
    ``bfloat16`` tensor raises ``TypeError`` (sparse, other devices) or
    ``ValueError`` (other dtypes) on its rank and ``gradsync.Error`` on the
    others, without hanging them (with overlap, from ``step()``). CUDA
    gradients take the engine's device path (float32 only; a gradsync built
    with the cargo feature ``cuda``, else the step fails on every rank).
    """

    def __init__(
        self,
        optimizer: Any,
        named_parameters: Iterable[Tuple[str, Any]],
        sync: Optional[Any] = None,
        strategy: Strategy = "auto",
        overlap: bool = True,
        bucket_cap_mb: Optional[float] = None,
        backward_passes_per_step: int = 1,
        **gradsync_options: Any,
    ) -> None:
        torch = _import_torch()
        try:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
            if not (isinstance(backward_passes_per_step, int) and backward_passes_per_step >= 1):
                raise ValueError(f"backward_passes_per_step must be an int >= 1, not {backward_passes_per_step!r}")
            if not (bucket_cap_mb is None or (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0)):
                raise ValueError(f"bucket_cap_mb must be None or a positive number, not {bucket_cap_mb!r}")
            if backward_passes_per_step > 1 and not overlap:
                raise ValueError("backward_passes_per_step counts gradients with per-parameter hooks: it needs overlap=True")
            delayed = _needs_weights({"delay": (getattr(sync, "_options", None) or gradsync_options).get("delay", 1)})
            if delayed and not _stateless(torch, optimizer):
                raise ValueError(
                    "delay > 1 needs a stateless optimizer (torch.optim.SGD without momentum or "
                    "weight_decay): a stateful one takes each rank's local directions into its "
                    "state (momentum buffers, Adam's moments), and the ranks' weights drift apart; "
                    "give gradsync momentum= and weight_decay= instead"
                )
            setup_error: Optional[BaseException] = None
        except Exception as e:  # noqa: BLE001 - carried into the collective set-up
            setup_error = e
        bucketing = (
            (None if bucket_cap_mb is None else float(bucket_cap_mb), int(backward_passes_per_step), True)
            if overlap and sync is None and setup_error is None
            else None
        )
        sync, params, self._owns_sync = _engine_for(
            torch, named_parameters, sync, strategy, gradsync_options, optimizer, setup_error, bucketing
        )
        self.overlap = not hasattr(sync, "register")  # the bucketed step
        # Weight decay in gradsync (`g += wd·w` before compression) reads
        # the weights, a delay writes them: every step passes them.
        self._weight_decay = _needs_weights(getattr(sync, "_options", None) or gradsync_options)
        self.optimizer = optimizer
        self.sync = sync
        self._params = params
        self._skip_sync = False
        self.last_stats: Optional[Dict[str, Any]] = None

    @staticmethod
    def _strategy(strategy: Strategy, name: str, p: Any) -> str:
        return _strategy_of(strategy, name, p)

    def sync_gradients(self) -> Dict[str, Any]:
        """Replace every registered parameter's ``.grad`` in place by its update direction.

        Collective. Parameters without a gradient get ``p.grad =
        torch.zeros_like(p)`` first, so every rank passes the same table; a
        non-contiguous gradient is replaced by a contiguous copy first.
        The gradients are handed to :meth:`gradsync.GradSync.sync` as numpy
        views sharing their memory (no copy). Returns the step's stats (also
        kept in ``last_stats``).
        """
        if self.overlap:
            stats = self.sync.finish()
            self.last_stats = stats
            return stats
        torch = _import_torch()
        views: List[Any] = []
        error: Optional[BaseException] = None
        for name, p in self._params:
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif p.grad.layout == torch.strided and not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()  # rare (a non-contiguous parameter); in place from here on
            try:
                views.append(_engine_view(torch, name, p.grad, "the gradient"))
            except (TypeError, ValueError, RuntimeError) as e:
                error = e
                break
        if error is not None:
            # Still take part in the step, carrying this rank's error, so
            # that the peers fail it too (naming this rank and the cause)
            # instead of waiting.
            try:
                self.sync.fail_step(f"{type(error).__name__}: {error}")
            except Exception as collective:  # noqa: BLE001
                raise type(error)(f"{error} (raised on every rank: {collective})") from collective
            raise error
        weights = None
        if self._weight_decay:
            weights = [_engine_view(torch, name, p.detach(), "the weights") for name, p in self._params]
        stats = self.sync.sync(views, weights)
        self.last_stats = stats
        return stats

    def synchronize(self) -> Dict[str, Any]:
        """Horovod's name for :meth:`sync_gradients`; use with :meth:`skip_synchronize`."""
        return self.sync_gradients()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context ``step()`` does not synchronize (after an explicit :meth:`synchronize`)."""
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Synchronize the gradients (:meth:`sync_gradients`), then run the wrapped optimizer's step.

        A ``closure`` is evaluated once, before the synchronization (it must
        recompute the loss and the gradients); its loss is returned.
        Optimizers that evaluate the closure several times per step (LBFGS)
        are not supported.
        """
        loss = None
        if closure is not None:
            torch = _import_torch()
            try:
                with torch.enable_grad():
                    loss = closure()
            except Exception as e:  # noqa: BLE001
                if self._skip_sync:
                    raise
                # The peers are about to synchronize: fail this step on
                # every rank, then raise the closure's own error here.
                try:
                    self.sync.fail_step(f"the closure raised {type(e).__name__}: {e}")
                except Exception as collective:  # noqa: BLE001
                    raise e from collective
                raise
        if not self._skip_sync:
            self.sync_gradients()
        self.optimizer.step()
        return loss

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        """The wrapped optimizer's ``zero_grad``.

        With overlap, an error (``RuntimeError``, on this rank) while a bucket
        is in flight or a gradient was counted since the last step: zeroing
        would race with the communication. Call :meth:`step` or
        :meth:`synchronize` first."""
        if self.overlap and self.sync.in_flight():
            raise RuntimeError(
                "gradsync: zero_grad() was called after backward() but before step() or "
                "synchronize(): gradients are being synchronized in the background"
            )
        self.optimizer.zero_grad(*args, **kwargs)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's ``state_dict`` (gradsync's own state: ``sync.save_snapshot``)."""
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """The wrapped optimizer's ``load_state_dict``."""
        self.optimizer.load_state_dict(state_dict)

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (the same list: changing an ``lr`` here changes it there)."""
        return self.optimizer.param_groups

    def close(self) -> None:
        """Free the gradsync engine now if this wrapper created it."""
        if self._owns_sync:
            self.sync.close()

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: delegate to the wrapped optimizer.
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, {len(self._params)} parameters)"


class GradSyncHookState:
    """The state of :func:`gradsync_hook`, DDP's comm hook (in the shape of ``PowerSGDState``).

    ::

        ddp = torch.nn.parallel.DistributedDataParallel(model)      # gloo on CPU
        state = gradsync.torch.GradSyncHookState(model.named_parameters(), strategy="auto", profile=None)
        ddp.register_comm_hook(state, gradsync.torch.gradsync_hook)

    ``GradSyncHookState(named_parameters, strategy="auto", profile=None,
    sync=None, overlap=True, bucket_cap_mb=None, **gradsync_options)`` is
    collective over ``MPI.COMM_WORLD`` (or ``sync``'s communicator): every
    rank must build it with the same parameters in the same order. Arguments
    as for :class:`DistributedOptimizer`: the parameters that require grad
    are registered with gradsync (``profile`` is a ``gradsync calibrate``
    profile for ``strategy="auto"``), with ``momentum=0.0`` unless given.

    How a step runs: DDP calls the hook once per bucket, in bucket order,
    as the bucket's gradients become ready; the hook returns a
    ``torch.futures.Future`` at once. With ``overlap=True`` (the default)
    the parameters are cut into gradsync's own buckets of up to
    ``bucket_cap_mb`` MiB (reverse registration order; ``None``: chosen by
    the step model after the first step, as for :class:`DistributedOptimizer`;
    then fixed for the run; the parts of one engine's step); a gradsync bucket is submitted as soon as
    DDP has handed all its gradients (compression on the autograd thread,
    its collectives on the engine's progress thread), so the communication
    overlaps the rest of backward, and every DDP bucket's future completes,
    on the state's thread, when the step is done (see
    :class:`gradsync._overlap.HookSchedule`; the same fall-backs as the
    optimizer's overlap, plus half-precision gradients). Without overlap the
    engine runs the whole step when the last bucket arrives. Either way each
    gradient is replaced in place by the ranks' average (dense layers) or
    by the averaged compressed update (sparse layers, with their residuals
    kept by the engine), and the result is the whole-step engine's
    (:meth:`gradsync.GradSync.sync` on the same gradients), bit for bit.
    Parameters are found by identity in each bucket, so DDP's bucket
    rebuild after the first iteration changes nothing; a parameter that got
    no gradient (``find_unused_parameters=True``) arrives as zeros, as DDP
    fills it; under ``no_sync()`` DDP calls no hook and the gradients
    accumulate locally, the next synchronized backward hands the sum.
    CPU tensors of ``float32``, ``float16`` or ``bfloat16``; CUDA tensors
    go through the engine's device path (a gradsync built with the cargo
    feature ``cuda``; otherwise the step fails on every rank naming it).
    Whatever fails on one rank (a parameter missing from the buckets, a
    bad dtype, the engine's own errors) fails the step on every rank: each
    bucket's future holds the error and DDP raises it from ``backward()``.

    Momentum belongs to the torch optimizer here: DDP hands the averaged
    gradients to it, and it applies its momentum (and weight decay, Adam's
    moments) afterwards. RedSync's momentum *correction* (momentum
    accumulated before compression, which keeps RGC at 0.1 % density close
    to dense) needs the momentum inside gradsync: give the state
    ``momentum=0.9`` and use the optimizer without momentum
    (``torch.optim.SGD(params, lr)``); the hook's gradients are then update
    directions. ``weight_decay`` is refused here (it needs the weights): use
    the optimizer's; so is ``delay > 1`` (it writes the weights back): use
    :class:`DistributedOptimizer`.

    Attributes: ``sync`` (the engine), ``last_stats`` (the last step's
    stats), ``steps`` (synchronized steps so far), ``buckets`` (DDP's
    buckets in the last step).
    """

    def __init__(
        self,
        named_parameters: Iterable[Tuple[str, Any]],
        strategy: Strategy = "auto",
        profile: Optional[Any] = None,
        sync: Optional[Any] = None,
        overlap: bool = True,
        bucket_cap_mb: Optional[float] = None,
        **gradsync_options: Any,
    ) -> None:
        import concurrent.futures
        import threading

        torch = _import_torch()
        setup_error: Optional[BaseException] = None
        if gradsync_options.get("weight_decay"):
            setup_error = ValueError(
                "GradSyncHookState: weight_decay needs the weights, which a DDP hook does not "
                "see: give it to the torch optimizer instead"
            )
        elif _needs_weights(gradsync_options):
            setup_error = ValueError(
                "GradSyncHookState: delay > 1 writes the weights back at each communicating "
                "step, which a DDP hook cannot do: use gradsync.torch.DistributedOptimizer"
            )
        opts = dict(gradsync_options)
        if profile is not None:
            opts["profile"] = profile
        if setup_error is None and not (
            bucket_cap_mb is None or (isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0)
        ):
            setup_error = ValueError(f"bucket_cap_mb must be None or a positive number, not {bucket_cap_mb!r}")
        cap = None if bucket_cap_mb is None else float(bucket_cap_mb)
        bucketing = (cap, 1, False) if overlap and sync is None and setup_error is None else None
        self.sync, params, self._owns_sync = _engine_for(
            torch, named_parameters, sync, strategy, opts, None, setup_error, bucketing
        )
        self.overlap = not hasattr(self.sync, "register")  # the bucketed step
        if self.overlap:
            from gradsync import _overlap

            self._schedule = _overlap.HookSchedule(self.sync)
        self._params = params
        self._slot = {id(p): i for i, (_, p) in enumerate(params)}
        # A parameter whose Python object DDP hands back anew: its memory.
        self._slot_by_ptr = {p.data_ptr(): i for i, (_, p) in enumerate(params)}
        self._pending: List[Tuple[Any, Any, List[Tuple[int, int, int]], Optional[str]]] = []
        self._lock = threading.Lock()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="gradsync-hook")
        self.last_stats: Optional[Dict[str, Any]] = None
        self.steps = 0
        self.buckets = 0

    def _add(self, bucket: Any) -> Any:
        """Take ``bucket`` (autograd thread); its future, not yet completed."""
        buf, fut, slots, error = self._parse(bucket)
        last = bucket.is_last()
        if self.overlap:
            if self._schedule.add(buf, fut, slots, error, last):
                self._worker.submit(self._schedule.finish, self)
            return fut
        with self._lock:
            self._pending.append((buf, fut, slots, error))
        if last:
            self._worker.submit(self._step)
        return fut

    def _parse(self, bucket: Any) -> Tuple[Any, Any, List[Tuple[int, int, int]], Optional[str]]:
        """``bucket``'s buffer, a new future, its parameters' ``(index,
        offset, elements)`` and what is wrong with it (``None``)."""
        torch = _import_torch()
        buf = bucket.buffer()
        fut = torch.futures.Future(devices=[buf.device]) if buf.device.type == "cuda" else torch.futures.Future()
        slots: List[Tuple[int, int, int]] = []
        error = None
        offset = 0
        for p in bucket.parameters():
            n = int(p.numel())
            if n == 0:
                continue  # not registered (nothing to synchronize); no room in the buffer
            i = self._slot.get(id(p))
            if i is None:
                i = self._slot_by_ptr.get(p.data_ptr()) if n else None
            if i is None:
                error = error or (
                    f"bucket {bucket.index()} holds a parameter of shape {tuple(p.shape)} that "
                    "was not given to GradSyncHookState (pass model.named_parameters() of the "
                    "module DDP wraps)"
                )
            else:
                slots.append((i, offset, n))
            offset += n
        if error is None and offset != buf.numel():
            error = f"bucket {bucket.index()}: {buf.numel()} elements for parameters of {offset}"
        return buf, fut, slots, error

    def _step(self) -> None:
        """Run the step of the buckets kept so far (on the state's thread)."""
        with self._lock:
            pending, self._pending = self._pending, []
        try:
            self._run(pending)
        except BaseException as e:  # noqa: BLE001 - never leave DDP waiting on a future
            for _, fut, _, _ in pending:
                if not fut.done():
                    fut.set_exception(e)

    def _run(self, pending: List[Tuple[Any, Any, List[Tuple[int, int, int]], Optional[str]]]) -> None:
        views: List[Any] = [None] * len(self._params)
        error = next((e for _, _, _, e in pending if e is not None), None)
        for buf, _, slots, _ in pending:
            flat = buf.view(-1)
            for i, off, n in slots:
                if views[i] is not None and error is None:
                    error = f"parameter {self._params[i][0]!r} is in two buckets"
                views[i] = flat[off : off + n]
        if error is None:
            absent = [self._params[i][0] for i, v in enumerate(views) if v is None]
            if absent:
                error = (
                    f"{len(absent)} parameter(s) got no bucket this step ({absent[:4]}): DDP "
                    "synchronizes only parameters that require grad, as registered"
                )
        if error is None:
            dtypes = {str(v.dtype) for v in views}
            bad = dtypes - {"torch.float32", "torch.float16", "torch.bfloat16"}
            if bad:
                error = f"gradients of dtype {sorted(bad)}: gradsync takes float32, float16 and bfloat16"
        try:
            if error is not None:
                self.sync.fail_step(f"gradsync_hook: {error}")  # raises on every rank
            stats = self.sync.sync(views)
        except BaseException as e:  # noqa: BLE001 - handed to DDP through the futures
            for _, fut, _, _ in pending:
                fut.set_exception(e)
            return
        self.last_stats = stats
        self.buckets = len(pending)
        self.steps += 1
        for buf, fut, _, _ in pending:
            fut.set_result(buf)

    def close(self) -> None:
        """Stop the state's thread and free the engine if the state created it."""
        self._worker.shutdown(wait=True)
        if self._owns_sync:
            self.sync.close()

    def __repr__(self) -> str:
        return f"GradSyncHookState({len(self._params)} parameters, {self.steps} steps)"


def gradsync_hook(state, bucket):  # type: ignore[no-untyped-def]
    """DDP comm hook: ``ddp_model.register_comm_hook(state, gradsync_hook)``.

    (No annotations: DDP refuses a hook whose ``bucket`` is annotated with
    anything but ``dist.GradBucket``, and this module imports without torch.)

    Returns at once a ``torch.futures.Future`` that completes with the
    bucket's averaged gradients when gradsync has synchronized the step
    (see :class:`GradSyncHookState`). Never blocks: the step runs on the
    state's thread once the step's last bucket has arrived.
    """
    return state._add(bucket)


def _bcast_buffer(torch: Any, name: str, t: Any) -> Any:
    """``(tensor, contiguous buffer, its bytes as a numpy view)`` for one
    tensor of :func:`broadcast_parameters` (``None`` when it is empty), or
    an error naming it: a sparse tensor, a view whose elements share memory
    (an ``expand``), or one whose memory is not its value (a negative or
    conjugate view)."""
    if t.layout != torch.strided:
        raise TypeError(f"{name!r} is a {t.layout} tensor: broadcast_parameters takes dense tensors")
    if t.numel() == 0:
        return None
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name!r} is an expanded view (stride 0): its elements share memory and cannot be written")
    if t.is_neg() or t.is_conj():
        raise ValueError(f"{name!r} is a negative or conjugate view: resolve it first (t.resolve_neg(), t.resolve_conj())")
    data = t.detach()
    buf = data if data.is_contiguous() else data.contiguous()
    raw = buf.reshape(-1).view(torch.uint8).numpy()  # bytes of the tensor's memory, shared
    return data, buf, raw


def broadcast_parameters(
    named_parameters: Union[Iterable[Tuple[str, Any]], Mapping[str, Any]],
    root: int = 0,
    comm: Optional[Any] = None,
) -> None:
    """Overwrite every rank's tensors, in place, with those of rank ``root`` (collective).

    ``named_parameters``: ``model.named_parameters()`` or
    ``model.state_dict()`` (which also covers buffers such as BatchNorm
    statistics). ``comm``: an mpi4py communicator, ``MPI.COMM_WORLD`` by
    default. Each tensor is broadcast with ``comm.Bcast`` on a numpy view of
    its memory (any dtype, as bytes). The names, shapes and dtypes are
    compared with ``root``'s first: a mismatch, or a tensor that is not on the
    CPU, raises ``ValueError``/``TypeError`` on every rank instead of hanging.
    """
    torch = _import_torch()
    from mpi4py import MPI

    if comm is None:
        comm = MPI.COMM_WORLD
    _call_kind(comm, _BROADCAST)
    items = list(named_parameters.items() if isinstance(named_parameters, Mapping) else named_parameters)
    table = []
    prepared: List[Any] = []
    local_error: Optional[BaseException] = None
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            local_error = local_error or TypeError(f"{name!r} is a {type(t).__name__}, not a torch.Tensor")
            table.append((name, None, None))
            continue
        if t.device.type != "cpu":
            local_error = local_error or TypeError(
                f"{name!r} is on {t.device}: broadcast_parameters takes CPU tensors only "
                "(broadcast before moving the model to the GPU)"
            )
        table.append((name, tuple(t.shape), str(t.dtype)))
        # Everything that can fail per tensor fails here, before the
        # agreement: after it, a tensor that cannot take the bytes would
        # leave this rank's later tensors unbroadcast while its peers
        # return (replicas that differ without an error).
        try:
            prepared.append(_bcast_buffer(torch, name, t))
        except Exception as e:  # noqa: BLE001
            local_error = local_error or e
            prepared.append(None)
    root_table = comm.bcast(table, root=root)
    mine: Optional[BaseException] = local_error
    if mine is None and table != root_table:
        diff = next(
            (f"{a} here, {b} on rank {root}" for a, b in zip(table, root_table) if a != b),
            f"{len(table)} tensors here, {len(root_table)} on rank {root}",
        )
        mine = ValueError(f"broadcast_parameters: the tensors differ from rank {root}'s: {diff}")
    # Every rank learns which ranks failed and why (one small allgather),
    # so that a peer's error names the rank and its reason.
    errors = comm.allgather(None if mine is None else f"{type(mine).__name__}: {mine}")
    failed = [r for r, e in enumerate(errors) if e is not None]
    if failed:
        if mine is not None:
            raise mine
        first = failed[0]
        others = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        raise ValueError(f"broadcast_parameters: rank {first} failed{others}: {errors[first]}")
    for entry in prepared:
        if entry is None:
            continue
        data, buf, raw = entry
        comm.Bcast(raw, root=root)
        if buf is not data:
            data.copy_(buf)
