"""Helpers shared by :mod:`gradsync.torch`'s optimizer wrapper and its DDP
comm hook: importing PyTorch, views of tensors for the engine, the
collective agreement of a helper's call, and the engine a wrapper builds
over the parameters."""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import numpy as np

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
