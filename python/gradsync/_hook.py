"""DDP's comm hook (:func:`gradsync_hook`) and its state
(:class:`GradSyncHookState`), exported by :mod:`gradsync.torch`."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

from gradsync._torch_common import Strategy, _engine_for, _import_torch, _needs_weights


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
    as for :class:`gradsync.torch.DistributedOptimizer`: the parameters that require grad
    are registered with gradsync (``profile`` is a ``gradsync calibrate``
    profile for ``strategy="auto"``), with ``momentum=0.0`` unless given.

    How a step runs: DDP calls the hook once per bucket, in bucket order,
    as the bucket's gradients become ready; the hook returns a
    ``torch.futures.Future`` at once. With ``overlap=True`` (the default)
    the parameters are cut into gradsync's own buckets of up to
    ``bucket_cap_mb`` MiB (reverse registration order; ``None``: chosen by
    the step model after the first step, as for :class:`gradsync.torch.DistributedOptimizer`;
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
    :class:`gradsync.torch.DistributedOptimizer`.

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
