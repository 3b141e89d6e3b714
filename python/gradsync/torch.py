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

Gradients are ``float32``. CPU gradients are read and written in place
through numpy views that share the tensors' memory (no copy). CUDA gradients
go to the engine as they are, through DLPack (a gradsync built with the cargo
feature ``cuda``; otherwise the step fails on every rank naming the cause).
:func:`broadcast_parameters` takes CPU tensors only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import numpy as np

__all__ = ["DistributedOptimizer", "broadcast_parameters"]

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
    if t.dtype != torch.float32:
        raise ValueError(f"{what} of {name!r} is {t.dtype}: gradsync synchronizes torch.float32 only")
    if not t.is_contiguous():
        raise ValueError(f"{what} of {name!r} is not contiguous")
    if t.device.type == "cuda":
        return t
    arr = t.detach().numpy().reshape(-1)  # shares memory: a view, never a copy
    if t.numel() and arr.__array_interface__["data"][0] != t.data_ptr():
        raise RuntimeError(f"internal error: the numpy view of {what} of {name!r} does not share its memory")
    return arr


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


class DistributedOptimizer:
    """Wrap a PyTorch optimizer so that ``step()`` first synchronizes the gradients with gradsync.

    ``DistributedOptimizer(optimizer, named_parameters, sync=None,
    strategy="auto", **gradsync_options)``, collective over the engine's
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
    :class:`gradsync.GradSync` engine: ``sync.layers()``,
    ``sync.save_snapshot(path)`` for its residuals and momentum),
    ``last_stats`` (the last step's stats, or None).

    Errors: a gradient that is not a dense CPU ``float32`` tensor raises
    ``TypeError`` (CUDA, sparse) or ``ValueError`` (other dtypes) on its rank
    and ``gradsync.Error`` on the others, without hanging them.
    """

    def __init__(
        self,
        optimizer: Any,
        named_parameters: Iterable[Tuple[str, Any]],
        sync: Optional[Any] = None,
        strategy: Strategy = "auto",
        **gradsync_options: Any,
    ) -> None:
        torch = _import_torch()
        import gradsync

        try:
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
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
                for group in optimizer.param_groups
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
            self._owns_sync = True
        else:
            if gradsync_options and local_error is None:
                local_error = TypeError(
                    "give either sync (an engine of your own) or gradsync options "
                    f"({', '.join(sorted(gradsync_options))}), not both"
                )
            self._owns_sync = False

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
        if not existing:
            for name, p in params:
                try:
                    spec, mine = self._strategy(strategy, name, p), None
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

        self.optimizer = optimizer
        self.sync = sync
        self._params = params
        self._skip_sync = False
        self.last_stats: Optional[Dict[str, Any]] = None

    @staticmethod
    def _strategy(strategy: Strategy, name: str, p: Any) -> str:
        if isinstance(strategy, str):
            return strategy
        if isinstance(strategy, Mapping):
            return strategy.get(name, "auto")
        if callable(strategy):
            return strategy(name, p)
        raise TypeError(f"strategy must be a string, a mapping or a callable, not {type(strategy).__name__}")

    def sync_gradients(self) -> Dict[str, Any]:
        """Replace every registered parameter's ``.grad`` in place by its update direction.

        Collective. Parameters without a gradient get ``p.grad =
        torch.zeros_like(p)`` first, so every rank passes the same table; a
        non-contiguous gradient is replaced by a contiguous copy first.
        The gradients are handed to :meth:`gradsync.GradSync.sync` as numpy
        views sharing their memory (no copy). Returns the step's stats (also
        kept in ``last_stats``).
        """
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
        stats = self.sync.sync(views)
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
        """The wrapped optimizer's ``zero_grad``."""
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
                f"{name!r} is on {t.device}: gradsync.torch supports CPU tensors only for now "
                "(GPU tensors are a later issue)"
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
