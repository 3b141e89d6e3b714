"""Overlap for :class:`gradsync.torch.DistributedOptimizer`: a step cut into buckets.

Horovod's shape: the registered parameters are cut into buckets (in reverse
registration order, the order in which backward produces their gradients,
each bucket up to ``bucket_cap_mb``); each bucket has its own
:class:`gradsync.GradSync` engine (its own duplicated communicator and
progress thread). A hook on every parameter
(``Tensor.register_post_accumulate_grad_hook``) counts its gradient's
accumulations; when every parameter of a bucket has been accumulated
``backward_passes_per_step`` times, the bucket's engine starts
(:meth:`gradsync.GradSync.start`: compression on the calling thread, the
collectives on its progress thread) while backward goes on with the earlier
layers. :meth:`BucketedSync.finish` starts what is missing (parameters that
got no gradient: zeros) and waits for every bucket in order.

Each layer's result equals the whole-step engine's bit for bit where the
engine's per-layer math does not depend on the other layers of its step:
dense layers averaged by Rabenseifner's allreduce (each element's sum is the
same butterfly of the ranks' values, wherever it sits in the fused buffer),
sparse layers exchanged by the fused allgatherv (each layer's units decoded
and summed in rank order), per-layer momentum, residuals, warm-up and density
schedules; ``auto``'s choices are the whole table's plan (made on a
whole-table engine, read back with :meth:`gradsync.GradSync.strategies` and
registered on the buckets' engines). Options whose result depends on the
whole step or on the fused layout are refused for overlap (the optimizer or
hook falls back to the whole step, rank 0 warning why): local gradient
clipping (the global norm), weight decay (needs the weights), ``delay > 1``,
an ``allreduce`` other than Rabenseifner's, a ``sparse_exchange`` other than
the allgatherv; so are half-precision or CUDA gradients and an MPI below
``MPI_THREAD_MULTIPLE`` (the buckets' progress threads call MPI at once).

The last bucket (the first layers, whose gradients come last) is started by
the step (the optimizer's ``step()``, the hook's last DDP bucket), never by a
gradient hook: a failure a rank finds after backward (a closure that raises,
a DDP bucket that does not match) still fails that bucket on every rank, so
no rank applies a step its peers refused.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import gradsync


def overlap_refusal(torch: Any, params: List[Tuple[str, Any]], options: Dict[str, Any]) -> Optional[str]:
    """Why this rank cannot overlap (``None`` when it can)."""
    from mpi4py import MPI

    if MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        return "MPI was initialized below MPI_THREAD_MULTIPLE (each bucket's progress thread calls MPI)"
    if options.get("clip_norm"):
        return "clip_norm clips by the norm of the whole step's gradient"
    if options.get("weight_decay"):
        return "weight_decay needs the weights (give it to the torch optimizer)"
    if int(options.get("delay", 1) or 1) != 1:
        return "delay > 1 (communication delay) runs on the whole step"
    for key, exact in (("allreduce", "rabenseifner"), ("sparse_exchange", "allgather")):
        if options.get(key, exact) != exact:
            return (
                f"{key} {options[key]!r}: its rounding depends on where a layer sits in the "
                f"step's fused buffers (overlap keeps the whole step's results with {exact!r})"
            )
    for name, p in params:
        if p.dtype != torch.float32 or p.device.type != "cpu":
            return f"parameter {name!r} is {p.dtype} on {p.device} (overlap takes float32 CPU gradients)"
    return None


def cut_buckets(params: List[Tuple[str, Any]], cap_bytes: int) -> List[List[int]]:
    """Indices of ``params`` by bucket: reverse registration order, each
    bucket up to ``cap_bytes`` of float32 gradients (a larger parameter alone)."""
    buckets: List[List[int]] = []
    cur: List[int] = []
    size = 0
    for i in reversed(range(len(params))):
        nbytes = 4 * int(params[i][1].numel())
        if cur and size + nbytes > cap_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        buckets.append(cur)
    return buckets


class BucketedSync:
    """The engines of one bucketed step, and their hooks' bookkeeping.

    Looks like a :class:`gradsync.GradSync` where :class:`DistributedOptimizer`
    uses one (``layers()``, ``step``, ``last_stats()``, ``fail_step``,
    ``save_snapshot``/``load_snapshot`` with one file per bucket,
    ``close()``), plus ``buckets`` (parameter indices per bucket).
    """

    def __init__(self, torch: Any, engines: List[Any], buckets: List[List[int]],
                 params: List[Tuple[str, Any]], passes: int, param_hooks: bool = True) -> None:
        self._torch = torch
        self.engines = engines
        self.buckets = buckets
        self._params = params
        self._passes = passes
        self._bucket_of = {i: b for b, ids in enumerate(buckets) for i in ids}
        self._counts = [0] * len(params)
        self._ready = [0] * len(buckets)
        self._started = [False] * len(buckets)
        self._errors: List[Optional[BaseException]] = [None] * len(buckets)
        self._last: Dict[str, Any] = {}
        self._handles = [
            p.register_post_accumulate_grad_hook(self._hook(i)) for i, (_, p) in enumerate(params)
        ] if param_hooks else []

    # -- the hooks -------------------------------------------------------
    def _hook(self, i: int) -> Any:
        def hook(_p: Any) -> None:
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
                # The last bucket (the first layers) waits for step(): a
                # failure this rank finds after backward (a closure that
                # raises) still fails it on every rank.
                if self._ready[b] == len(self.buckets[b]) and b != len(self.buckets) - 1:
                    self._start(b)

        return hook

    def _views(self, b: int) -> List[Any]:
        from gradsync.torch import _engine_view

        torch = self._torch
        views = []
        for i in self.buckets[b]:
            name, p = self._params[i]
            if p.grad is None:
                p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
            elif p.grad.layout == torch.strided and not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()  # as the whole step does; in place from here on
            views.append(_engine_view(torch, name, p.grad, "the gradient"))
        return views

    def _start(self, b: int) -> None:
        """Start bucket ``b``; its error (every rank's, the engine fails the
        step alike) is kept for :meth:`finish`, never raised here (in a hook
        it would escape ``backward()`` on this rank only)."""
        self._started[b] = True
        try:
            views = self._views(b)
        except Exception as e:  # noqa: BLE001 - every rank fails this bucket
            try:
                self.engines[b].fail_step(f"{type(e).__name__}: {e}")
            except Exception as collective:  # noqa: BLE001
                self._errors[b] = type(e)(f"{e} (raised on every rank: {collective})")
            return
        try:
            self.engines[b].start(views)
        except Exception as e:  # noqa: BLE001 - the step failed on every rank
            self._errors[b] = e

    # -- the step ---------------------------------------------------------
    def in_flight(self) -> bool:
        """Whether a bucket was started, or a gradient counted, since the last step."""
        return any(self._started) or any(self._counts)

    def finish(self) -> Dict[str, Any]:
        """Start every bucket not started yet (in order), then wait for all in order."""
        for b in range(len(self.buckets)):
            if not self._started[b]:
                self._start(b)
        first: Optional[BaseException] = None
        stats: List[Any] = []
        for b in range(len(self.buckets)):
            if self._errors[b] is not None:
                first = first or self._errors[b]
                continue
            try:
                views = self._views(b)
            except Exception as e:  # noqa: BLE001 - this rank's output arrays
                # The bucket's step stays pending in its engine: its next
                # start finishes it into scratch (with a RuntimeWarning), so
                # this rank stays in step with its peers.
                first = first or e
                continue
            try:
                stats.append(self.engines[b].wait(views))
            except Exception as e:  # noqa: BLE001 - raised after every bucket is done
                first = first or e
        self._counts = [0] * len(self._params)
        self._ready = [0] * len(self.buckets)
        self._started = [False] * len(self.buckets)
        self._errors = [None] * len(self.buckets)
        if first is not None:
            raise first
        self._last = self._merge(stats)
        return self._last

    def _merge(self, stats: List[Dict[str, Any]]) -> Dict[str, Any]:
        by_layer: Dict[int, Any] = {}
        for b, s in enumerate(stats):
            for i, layer in zip(self.buckets[b], (s or {}).get("layers", [])):
                by_layer[i] = layer
        out = dict(stats[0]) if stats else {}
        out["layers"] = [by_layer[i] for i in sorted(by_layer)]
        out["buckets"] = stats
        return out

    def fail_step(self, reason: Any) -> None:
        """Fail this step on every rank (every bucket), then raise ``gradsync.Error``."""
        for b in range(len(self.buckets)):
            if not self._started[b]:
                self._started[b] = True
                try:
                    self.engines[b].fail_step(reason)
                except Exception as e:  # noqa: BLE001
                    self._errors[b] = e
        self.finish()
        raise gradsync.Error(f"the step failed on this rank: {reason}")

    # -- the GradSync look-alike ---------------------------------------------
    def layers(self) -> list:
        """The registered layers, in registration order."""
        rows: Dict[int, Any] = {}
        for b, e in enumerate(self.engines):
            for i, row in zip(self.buckets[b], e.layers()):
                rows[i] = row
        return [rows[i] for i in sorted(rows)]

    @property
    def step(self) -> int:
        return self.engines[0].step if self.engines else 0

    @property
    def rank(self) -> int:
        return self.engines[0].rank

    @property
    def size(self) -> int:
        return self.engines[0].size

    def last_stats(self) -> Dict[str, Any]:
        return self._last

    def save_snapshot(self, path: Any) -> None:
        """Each bucket's engine state to ``f"{path}.bucket{b}"``."""
        for b, e in enumerate(self.engines):
            e.save_snapshot(f"{path}.bucket{b}")

    def load_snapshot(self, path: Any) -> None:
        """Restore what :meth:`save_snapshot` wrote (collective, bucket after bucket)."""
        for b, e in enumerate(self.engines):
            e.load_snapshot(f"{path}.bucket{b}")

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        for e in self.engines:
            e.close()


class HookSchedule:
    """The DDP comm hook's overlap (:class:`gradsync.torch.GradSyncHookState`).

    The registered parameters are cut into gradsync's own buckets (as for the
    optimizer), fixed for the run, so that DDP's bucket rebuild changes no
    engine's table. As each DDP bucket arrives (:meth:`add`, on the autograd
    thread), its gradients are noted; a gradsync bucket whose gradients have
    all arrived starts at once (compression here, its collectives on its
    progress thread). The state's worker thread waits, for each DDP bucket in
    order, for the gradsync buckets holding its parameters (their results are
    written into DDP's bucket buffers) and then completes that bucket's
    future; the step's last DDP bucket starts whatever has not started
    (a parameter that never arrived fails its gradsync bucket on every rank)
    and its future waits for every gradsync bucket, carrying the step's first
    error.
    """

    def __init__(self, bucketed: BucketedSync) -> None:
        import threading

        self.bs = bucketed
        self._threading = threading
        self._reset()

    def _reset(self) -> None:
        n, nb = len(self.bs._params), len(self.bs.buckets)
        self.views: List[Any] = [None] * n
        self.ready = [0] * nb
        self.started = [self._threading.Event() for _ in range(nb)]
        self.waited = [False] * nb
        self.errors: List[Optional[BaseException]] = [None] * nb
        self.stats: List[Any] = [None] * nb
        self.problem: Optional[str] = None
        self.ddp_buckets = 0

    def add(self, buf: Any, slots: List[Tuple[int, int, int]], error: Optional[str], last: bool) -> List[int]:
        """Note one DDP bucket (autograd thread); start the gradsync buckets it
        completes. Returns the gradsync buckets its future waits for."""
        if error is not None and self.problem is None:
            self.problem = error
        self.ddp_buckets += 1
        flat = buf.view(-1)
        touched = set()
        for i, off, n in slots:
            b = self.bs._bucket_of[i]
            touched.add(b)
            if self.views[i] is None:
                self.ready[b] += 1
            self.views[i] = flat[off : off + n]
            # The last gradsync bucket waits for the step's last DDP bucket:
            # a problem found in any DDP bucket still fails it on every rank.
            held = b == len(self.bs.buckets) - 1 and not last
            if self.ready[b] == len(self.bs.buckets[b]) and not self.started[b].is_set() and not held:
                self._start(b)
        if last:
            for b in range(len(self.bs.buckets)):
                if not self.started[b].is_set():
                    self._start(b)
            return list(range(len(self.bs.buckets)))
        return sorted(touched)

    def _start(self, b: int) -> None:
        views = [self.views[i] for i in self.bs.buckets[b]]
        absent = [self.bs._params[i][0] for i, v in zip(self.bs.buckets[b], views) if v is None]
        why = self.problem
        if why is None and absent:
            why = (
                f"{len(absent)} parameter(s) got no DDP bucket this step ({absent[:4]}): DDP "
                "synchronizes only parameters that require grad, as registered"
            )
        try:
            if why is not None:
                self.bs.engines[b].fail_step(f"gradsync_hook: {why}")  # raises on every rank
            else:
                self.bs.engines[b].start(views)
        except Exception as e:  # noqa: BLE001 - reaches the futures
            self.errors[b] = e
        finally:
            self.started[b].set()

    def finish(self, fut: Any, buf: Any, wait_for: List[int], last: bool, state: Any) -> None:
        """Complete ``fut`` (worker thread) once the gradsync buckets
        ``wait_for`` are done; the last DDP bucket's call ends the step."""
        try:
            for b in wait_for:
                self.started[b].wait()
                if self.waited[b]:
                    continue
                self.waited[b] = True
                if self.errors[b] is None:
                    try:
                        self.stats[b] = self.bs.engines[b].wait([self.views[i] for i in self.bs.buckets[b]])
                    except Exception as e:  # noqa: BLE001
                        self.errors[b] = e
            error = next((self.errors[b] for b in wait_for if self.errors[b] is not None), None)
            if last:
                if error is None:
                    self.bs._last = self.bs._merge(self.stats)
                    state.last_stats = self.bs._last
                    state.steps += 1
                    state.buckets = self.ddp_buckets
                self._reset()
        except BaseException as e:  # noqa: BLE001 - never leave DDP waiting
            error = e
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(buf)
