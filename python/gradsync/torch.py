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

__all__ = ["DistributedOptimizer", "GradSyncHookState", "broadcast_parameters", "gradsync_hook"]

from gradsync._hook import GradSyncHookState, gradsync_hook
from gradsync._torch_common import (
    _BROADCAST,
    Strategy,
    _import_torch,
    _engine_view,
    _call_kind,
    _engine_for,
    _needs_weights,
    _stateless,
    _strategy_of,
)


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
