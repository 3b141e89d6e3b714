"""Overlap for :class:`gradsync.torch.DistributedOptimizer` and :func:`gradsync.torch.gradsync_hook`.

Horovod's shape over the engine's step in buckets
(:meth:`gradsync.GradSync.submit_bucket`): the registered parameters are cut
into buckets (in reverse registration order, the order in which backward
produces their gradients, each bucket up to ``bucket_cap_mb``), fixed for
the run. A hook on every parameter (``Tensor.register_post_accumulate_grad_hook``)
counts its gradient's accumulations; when every parameter of a bucket has
been accumulated ``backward_passes_per_step`` times, the bucket is submitted
(compression on the calling thread, its collectives queued to the engine's
progress thread) while backward goes on with the earlier layers.
:meth:`BucketedSync.finish` submits what is missing (parameters that got no
gradient: zeros) and finishes the step (:meth:`gradsync.GradSync.finish_step`).

One engine, one layer table, one communicator: every per-step decision
(``auto``'s plan, warm-up, delay, the exchange) is the whole step's, and the
results equal the whole step's bit for bit (the engine's module docs say
why; where they could not, e.g. with ``clip_norm``, the engine runs the step
when its last bucket arrives). Overlap is refused (the optimizer or hook
falls back to the whole step, rank 0 warning why) only for half-precision or
CUDA gradients and an MPI below ``MPI_THREAD_SERIALIZED`` (the engine's
progress thread calls MPI).

The last bucket (the first layers, whose gradients come last) is submitted
by the step (the optimizer's ``step()``, the hook's last DDP bucket), never
by a gradient hook: a failure a rank finds after backward (a closure that
raises, a DDP bucket that does not match) still fails that bucket on every
rank, so no rank applies a step its peers refused.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

import gradsync
from gradsync import _gradsync


def overlap_refusal(torch: Any, params: List[Tuple[str, Any]], options: Dict[str, Any]) -> Optional[str]:
    """Why this rank cannot overlap (``None`` when it can)."""
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_SERIALIZED:
        return "MPI was initialized below MPI_THREAD_SERIALIZED (the engine's progress thread calls MPI)"
    for name, p in params:
        if p.dtype != torch.float32 or p.device.type != "cpu":
            return f"parameter {name!r} is {p.dtype} on {p.device} (overlap takes float32 CPU gradients)"
    return None


#: The first step's bucket cap when none is given (DDP's default, 25 MiB),
#: the cost model's (``gradsync::cost::FIRST_STEP_CAP_BYTES``).
DEFAULT_CAP = _gradsync.FIRST_STEP_CAP_BYTES
#: A cap no table reaches: the whole table as one bucket.
WHOLE = 2**62


def cut_buckets(params: List[Tuple[str, Any]], cap_bytes: int) -> List[List[int]]:
    """Indices of ``params`` by bucket: reverse registration order, each
    bucket up to ``cap_bytes`` of float32 gradients (a larger parameter
    alone), cut by the cost model (``gradsync::cost::cut_buckets``), as its
    bucket plans are priced."""
    return _gradsync.cut_buckets([int(p.numel()) for _, p in params], min(int(cap_bytes), 2**63 - 1))


class BucketedSync:
    """The engine of an overlapped step, and its hooks' bookkeeping.

    Looks like a :class:`gradsync.GradSync` where :class:`DistributedOptimizer`
    uses one (``layers()``, ``step``, ``last_stats()``, ``fail_step``,
    ``save_snapshot``/``load_snapshot``, ``close()``), plus ``engine`` (the
    :class:`gradsync.GradSync`) and ``buckets`` (parameter indices per bucket).
    """

    def __init__(self, torch: Any, engine: Any, cap_bytes: Optional[int],
                 params: List[Tuple[str, Any]], passes: int, param_hooks: bool = True,
                 weights: bool = False) -> None:
        self._torch = torch
        self.engine = engine
        self._params = params
        self._passes = passes
        self._weights = weights
        # No cap given: DDP's default for the first step, then the step
        # model's choice for the backward pass it measured (:meth:`tune`).
        self._tune = cap_bytes is None
        self.bucket_plan: Optional[Dict[str, Any]] = None
        self._t0: Optional[float] = None
        self._t1 = 0.0
        self._recut(DEFAULT_CAP if cap_bytes is None else cap_bytes)
        self._last: Dict[str, Any] = {}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in enumerate(params)
        ] if param_hooks else []

    def _recut(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self.buckets = cut_buckets(self._params, cap_bytes)
        self._bucket_of = {i: b for b, ids in enumerate(self.buckets) for i in ids}
        self._counts = [0] * len(self._params)
        self._ready = [0] * len(self.buckets)
        self._started = [False] * len(self.buckets)
        self._next = 0

    def note_gradient(self) -> None:
        """A gradient (or DDP bucket) arrived: the backward pass's span."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        self._t1 = now

    def tune(self) -> None:
        """After the first step: cut the buckets at the step model's cap for
        the backward pass measured (the ranks' longest, agreed by one
        allreduce; every rank then cuts alike). Without a profile the model
        cannot price, and DDP's 25 MiB stays (``bucket_plan`` says why)."""
        from mpi4py import MPI

        self._tune = False
        span = 0.0 if self._t0 is None else self._t1 - self._t0
        backward_s = self.engine._comm.allreduce(span, op=MPI.MAX)
        try:
            plan = self.engine.plan_buckets(backward_s)
        except gradsync.Error as e:  # alike on every rank (the same options)
            self.bucket_plan = {"cap_bytes": self.cap_bytes, "backward_s": backward_s, "error": str(e)}
            return
        self.bucket_plan = plan
        cap = plan["cap_bytes"]
        self._recut(WHOLE if cap is None else int(cap))

    # -- the hooks -------------------------------------------------------
    def _hook(self, i: int) -> Any:
        def hook(_p: Any) -> None:
            self.note_gradient()
            self._counts[i] += 1
            if self._counts[i] > self._passes:
                raise RuntimeError(
                    f"gradsync: the gradient of {self._params[i][0]!r} was computed "
                    f"{self._counts[i]} times before step() or synchronize() "
                    f"(backward_passes_per_step={self._passes})"
                )
            if self._counts[i] == self._passes:
                b = self._bucket_of[i]
                self._ready[b] += 1
                self._submit_ready()

        return hook

    def _submit_ready(self) -> None:
        """Submit the ready buckets in cut order, never the last (the first
        layers): ``step()`` submits it, so a failure this rank finds after
        backward (a closure that raises) still fails it on every rank. A
        bucket waits for the ones before it, so every rank submits the same
        sequence even where a parameter got no gradient on one rank only
        (its bucket then goes at ``step()``, and the later ones after it)."""
        b = self._next
        while b < len(self.buckets) - 1 and self._ready[b] == len(self.buckets[b]):
            self._start(b)
            b += 1

    def _views(self, ids: List[int]) -> List[Any]:
        from gradsync.torch import _engine_view

        torch = self._torch
        views = []
        for i in ids:
            name, p = self._params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif p.grad.layout == torch.strided and not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()  # as the whole step does; in place from here on
            views.append(_engine_view(torch, name, p.grad, "the gradient"))
        return views

    def _weight_views(self, ids: List[int]) -> Optional[List[Any]]:
        if not self._weights:
            return None
        from gradsync.torch import _engine_view

        return [_engine_view(self._torch, self._params[i][0], self._params[i][1].detach(), "the weights")
                for i in ids]

    def _start(self, b: int) -> None:
        """Submit bucket ``b`` (the next in cut order). A failure here is carried to every rank by
        the engine (the step fails alike at :meth:`finish`) and never raised
        here: in a hook it would escape ``backward()`` on this rank only."""
        self._started[b] = True
        self._next = b + 1
        ids = self.buckets[b]
        try:
            views, weights = self._views(ids), self._weight_views(ids)
        except Exception as e:  # noqa: BLE001 - every rank fails this step
            try:
                self.engine.fail_bucket(ids, f"{type(e).__name__}: {e}")
            except Exception:  # noqa: BLE001 - finish_step reports the step
                pass
            return
        try:
            self.engine.submit_bucket(ids, views, weights)
        except Exception:  # noqa: BLE001 - finish_step reports the step
            pass

    # -- the step ---------------------------------------------------------
    def in_flight(self) -> bool:
        """Whether a bucket was started, or a gradient counted, since the last step."""
        return any(self._started) or any(self._counts)

    def finish(self) -> Dict[str, Any]:
        """Submit every bucket not submitted yet (in order), then finish the step."""
        for b in range(len(self.buckets)):
            if not self._started[b]:
                self._start(b)
        self._counts = [0] * len(self._params)
        self._ready = [0] * len(self.buckets)
        self._started = [False] * len(self.buckets)
        self._next = 0
        # Every parameter's gradient, in registration order. One that
        # cannot be viewed was already carried by its bucket (the step
        # fails on every rank): scratch memory takes its place, so that
        # this rank finishes the step with its peers.
        views, local = [], None
        for i, (name, p) in enumerate(self._params):
            try:
                views.append(self._views([i])[0])
            except Exception as e:  # noqa: BLE001 - the step's error comes first
                local = local or e
                views.append(np.zeros(int(p.numel()), dtype=np.float32))
        self._t0, t0 = None, self._t0
        stats = self.engine.finish_step(views)
        if local is not None:
            raise local
        self._last = stats
        if self._tune:
            self._t0 = t0
            self.tune()
            self._t0 = None
        return self._last

    def fail_step(self, reason: Any) -> None:
        """Fail this step on every rank (every bucket not yet submitted), then raise ``gradsync.Error``."""
        for b in range(len(self.buckets)):
            if not self._started[b]:
                self._started[b] = True
                self.engine.fail_bucket(self.buckets[b], reason)
        self.finish()
        raise gradsync.Error(f"the step failed on this rank: {reason}")

    # -- the GradSync look-alike ---------------------------------------------
    def layers(self) -> list:
        """The registered layers, in registration order."""
        return self.engine.layers()

    @property
    def step(self) -> int:
        return self.engine.step

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def size(self) -> int:
        return self.engine.size

    def last_stats(self) -> Dict[str, Any]:
        return self._last

    def save_snapshot(self, path: Any) -> None:
        """The engine's state (:meth:`gradsync.GradSync.save_snapshot`)."""
        self.engine.save_snapshot(path)

    def load_snapshot(self, path: Any) -> None:
        """Restore what :meth:`save_snapshot` wrote (collective)."""
        self.engine.load_snapshot(path)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self.engine.close()


class HookSchedule:
    """The DDP comm hook's overlap (:class:`gradsync.torch.GradSyncHookState`).

    The registered parameters are cut into gradsync's own buckets (as for the
    optimizer), fixed for the run, so that DDP's bucket rebuild changes
    nothing. As each DDP bucket arrives (:meth:`add`, on the autograd thread),
    its gradients are noted; a gradsync bucket whose gradients have all
    arrived is submitted at once (compression here, its collectives on the
    engine's progress thread). The step's last DDP bucket submits whatever
    has not been (a parameter that never arrived fails its bucket on every
    rank); then the state's thread finishes the step, writing the results
    into DDP's bucket buffers, and completes every DDP bucket's future, each
    with the step's error if it failed.
    """

    def __init__(self, bucketed: BucketedSync) -> None:
        self.bs = bucketed
        self._reset()

    def _reset(self) -> None:
        n, nb = len(self.bs._params), len(self.bs.buckets)
        self.views: List[Any] = [None] * n
        self.ready = [0] * nb
        self.started = [False] * nb
        self.next = 0
        self.futures: List[Tuple[Any, Any]] = []
        self.problem: Optional[str] = None

    def add(self, buf: Any, fut: Any, slots: List[Tuple[int, int, int]], error: Optional[str], last: bool) -> bool:
        """Note one DDP bucket (autograd thread); submit the gradsync buckets
        it completes. True when the step is ready to be finished."""
        if error is not None and self.problem is None:
            self.problem = error
        self.bs.note_gradient()
        self.futures.append((fut, buf))
        flat = buf.view(-1)
        for i, off, n in slots:
            b = self.bs._bucket_of[i]
            if self.views[i] is None:
                self.ready[b] += 1
            elif self.problem is None:
                self.problem = f"parameter {self.bs._params[i][0]!r} is in two DDP buckets"
            self.views[i] = flat[off : off + n]
        # In cut order; the last gradsync bucket waits for the step's last
        # DDP bucket: a problem found in any DDP bucket still fails it on
        # every rank.
        b = self.next
        while b < len(self.bs.buckets) - 1 and self.ready[b] == len(self.bs.buckets[b]):
            self._start(b)
            b += 1
        if last:
            for b in range(self.next, len(self.bs.buckets)):
                self._start(b)
        return last

    def _start(self, b: int) -> None:
        self.started[b] = True
        self.next = b + 1
        ids = self.bs.buckets[b]
        views = [self.views[i] for i in ids]
        absent = [self.bs._params[i][0] for i, v in zip(ids, views) if v is None]
        why = self.problem
        if why is None and absent:
            why = (
                f"{len(absent)} parameter(s) got no DDP bucket this step ({absent[:4]}): DDP "
                "synchronizes only parameters that require grad, as registered"
            )
        try:
            if why is not None:
                self.bs.engine.fail_bucket(ids, f"gradsync_hook: {why}")
            else:
                self.bs.engine.submit_bucket(ids, views)
        except Exception:  # noqa: BLE001 - finish_step reports the step
            pass

    def finish(self, state: Any) -> None:
        """Finish the step (the state's thread) and complete every DDP future."""
        futures = self.futures
        error: Optional[BaseException] = None
        try:
            torch = self.bs._torch
            # Outputs for every layer; one that never arrived (the step
            # fails on every rank) gets scratch memory.
            out = [v if v is not None else torch.zeros(int(p.numel()))
                   for v, (_, p) in zip(self.views, self.bs._params)]
            from gradsync.torch import _engine_view

            arrays = []
            for v, (name, p) in zip(out, self.bs._params):
                try:
                    arrays.append(_engine_view(torch, name, v, "the gradient"))
                except Exception as e:  # noqa: BLE001 - finish the step all the same
                    error = error or e
                    arrays.append(np.zeros(int(p.numel()), dtype=np.float32))
            stats = self.bs.engine.finish_step(arrays)
            if self.bs._tune:
                self.bs.tune()
            self.bs._last = stats
            state.last_stats = stats
            state.steps += 1
            state.buckets = len(futures)
        except BaseException as e:  # noqa: BLE001 - never leave DDP waiting
            # The step's own error (every rank's) over this rank's view.
            error = e
        finally:
            self.bs._t0 = None
            self._reset()
        for fut, buf in futures:
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(buf)
