"""The step state machine: what happened in each training step, turned into trace events.

Hooks (``step_hooks.py``, ``comm_hook.py``, ``param_sync.py``) call the ``on_*`` methods while training runs; they only take a
clock stamp and append to the open step. When a step closes, its stamps are resolved
to µs (on CPU they are µs already; on CUDA ``Clock.resolve`` in one batch once the
step's end event has completed, or when ``clock.lag_steps`` steps wait) and its Chrome trace events go to the writer.

Thread notes: forward/optimizer hooks run on the training thread, gradient hooks on
the autograd thread (the same one on CPU), bucket completions on the process group's
threads; a completion only assigns ``BucketRecord.done``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from ddpscope.tracer.capture.clock import Clock, steps_to_keep
from ddpscope.tracer.capture.ddp.events import StepEvents
from ddpscope.tracer.capture.ddp.records import BucketRecord, OwnCollective, ParamSync, PassRecord, StepRecord
from ddpscope.tracer.capture.memory import MeasuredSteps, MemoryMeter
from ddpscope.tracer.options import GRAD_MARKS_FIRST_STEPS


class StepRecorder:
    """Collects steps; hands their Chrome trace events on with ``emit(events, layouts_or_None)``."""

    def __init__(
        self,
        *,
        clock: Clock,
        rank: int,
        param_names: list[str],
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        step_boundary: str,
        emit: Callable[[Iterator[dict], list[dict] | None], None],
        nccl_kernel_timing: bool = False,
        on_close: Callable[[StepRecord], None] | None = None,
        memory_interval_s: float = 1.0,
        offset_us: float = 0.0,
        grad_marks_every: int = 1,
        frozen_params: tuple[torch.nn.Parameter, ...] | list[torch.nn.Parameter] = (),
    ) -> None:
        """``offset_us``: add it to this rank's host clock (µs) for rank 0's (``offsets.py``);
        ``grad_marks_every``: see ``_marks``; ``frozen_params``: the model's parameters that
        do not train, counted in its memory (``MemoryMeter``)."""
        self.clock = clock
        self.rank = rank
        self.param_names = param_names
        self.params = params
        self.param_index = {id(p): i for i, p in enumerate(params)}
        self.optimizer = optimizer
        self.explicit = step_boundary == "explicit"
        self.emit = emit
        self.nccl_kernel_timing = nccl_kernel_timing
        self.current: StepRecord | None = None
        self.next_step = 0
        self.pending: list[StepRecord] = []  # closed, not yet resolved
        self.layouts: list[dict] = []  # {"from_step": s, "buckets": [[param idx...], ...]}
        self.param_nbytes = [p.numel() * p.element_size() for p in params]
        self._bucket_params: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self._layout_key: tuple | None = None  # the last step's buckets' params (see _layout_of)
        self._layout: tuple[list[list[int]], int] = ([], 0)
        self.device = params[0].device if params else torch.device("cpu")
        self.steps_written = 0
        self.on_close = on_close  # after a step closed (training thread); may raise to stop
        # the compiled capture (compiled.CompiledBuckets): it times the all-reduces, taken
        # into the step after DDP waited for them; None: the Python hook calls on_bucket_launch
        self.bucket_source = None
        self._synced_pass: int | None = None  # a syncing backward whose all-reduces are not taken yet
        self.step_events = StepEvents(rank, param_names)
        self.memory = MemoryMeter(params, frozen_params)
        self.measure = self.memory  # at close of a measured step (benchmarks/overhead.py times it apart)
        self._measured = MeasuredSteps(clock, memory_interval_s, offset_us)
        self.grad_marks_every = grad_marks_every
        self._last_grad: int | None = None  # the gradient ready last in the latest marked step
        self.backward_began: Callable[[], None] | None = None  # a backward starts (backward_encoder.py)

    # -- hooks ------------------------------------------------------------------
    def on_forward_start(self, sync: bool = True) -> None:
        """A training forward begins: a new pass of the open step (a new step if none)."""
        now = self.clock.stamp()
        cur = self.current
        if cur is not None and not self.explicit and self.optimizer is None and _synced(cur):
            # auto mode without an optimizer: a forward after a syncing backward ends the
            # step (forwards under no_sync() are further micro-batches of the same step)
            self._close(now)
            cur = None
        if cur is None:
            cur = self.current = StepRecord(step=self.next_step, start=now, measure_memory=self._measure_memory_now())
            self._marks(cur)
            self.next_step += 1
        elif cur.optimizer is not None and cur.optimizer[1] is None:
            cur.optimizer = None  # a forward inside optimizer.step(closure): not the update
        cur.passes.append(PassRecord(sync=sync, forward=[now, None]))

    def _measure_memory_now(self) -> bool:
        """Whether the step starting now has its memory measured: the first steps (DDP's
        warm-up, the optimizer's state appearing), then one each ``memory_interval_s``,
        the same step on every rank (``MeasuredSteps``): it costs ~0.1 ms on the cold caches
        a step leaves, and a DDP rank's memory barely moves from one step to the next."""
        if not self._measured(self.next_step):
            return False
        self.memory.start_step()  # CUDA: the allocator's peak now, to tell whether the step sets a new one
        return True

    def _marks(self, cur: StepRecord) -> None:
        """Whether the step beginning now marks every gradient: the first
        ``GRAD_MARKS_FIRST_STEPS``, then every ``grad_marks_every``-th (the same steps on every
        rank). One that does not stamps only the gradient ready last in the latest marked step,
        where its backward's compute ends (every gradient stamped while that is unknown)."""
        n = self.grad_marks_every
        cur.grad_marks = n <= 1 or cur.step < GRAD_MARKS_FIRST_STEPS or cur.step % n == 0
        cur.only_grad = None if cur.grad_marks else self._last_grad
        if self.bucket_source is not None and n > 1:
            self.bucket_source.stamp_only(cur.only_grad)  # C++ hooks: no stamp, no event for the others

    def on_forward_end(self, warmup: bool) -> None:
        cur = self.current
        if cur is not None and cur.passes:
            cur.passes[-1].forward[1] = self.clock.stamp()
            cur.warmup = cur.warmup or warmup

    def on_output_grad(self, step: StepRecord, k: int) -> None:
        """The first gradient w.r.t. pass ``k``'s output: its backward has begun."""
        cur = self.current
        if step is not cur:  # a step closed since that forward
            return
        cur.active = k
        p = cur.passes[k]
        if p.backward_start is None:
            p.backward_start = self.clock.stamp()
            if self.backward_began is not None:
                self.backward_began()
        if self._synced_pass is not None:  # another syncing backward before: its all-reduces first
            self._take_buckets(cur)
        if self.bucket_source is not None and not cur.first_grad_seen:
            # compiled capture: no Python hook per gradient, so the end-of-backward
            # callbacks are queued here (the engine is running this backward)
            cur.first_grad_seen = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def on_grad_ready(self, index: int) -> None:
        cur = self.current
        if cur is None or not cur.passes:
            return
        if not cur.first_grad_seen:
            cur.first_grad_seen = True
            # Runs when the autograd engine finishes this backward, *before* DDP's own
            # end-of-backward callback (queued later), which waits for all buckets.
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        if cur.only_grad is None or index == cur.only_grad:  # a step without marks: one stamp (_marks)
            cur.grads.append((index, self.clock.stamp(), active_index(cur)))

    def _active_pass(self) -> PassRecord | None:
        cur = self.current
        return cur.passes[active_index(cur)] if cur is not None and cur.passes else None

    def _on_backward_end(self) -> None:
        p = self._active_pass()
        if p is not None:
            p.backward_end = self.clock.stamp()
            if self.bucket_source is not None:
                self.bucket_source.take_ready(self.current, active_index(self.current))
            self.current.first_grad_seen = False  # the next backward (accumulation) queues again
            # Callbacks queued while callbacks run go to the back of the queue: this one
            # runs after DDP's finalize (wait for every bucket, write the averaged grads).
            torch.autograd.Variable._execution_engine.queue_callback(self._on_grads_synced)

    def _on_grads_synced(self) -> None:
        p = self._active_pass()
        if p is not None:
            p.sync_end = self.clock.stamp()
            if self.bucket_source is not None and p.sync:
                # Its all-reduces are taken later (next backward, or the step's close): DDP's
                # wait can return before a collective's completion callbacks have run, and
                # waiting for them here cost up to ~1 ms a step (demo MLP, one 25 MiB bucket).
                self._synced_pass = active_index(self.current)
        if self.current is not None:
            self.current.active = None

    def _take_buckets(self, step: StepRecord) -> None:
        """The compiled capture's all-reduces not taken yet, into ``step`` (those of the
        last syncing pass, else of whatever launched them)."""
        source, k = self.bucket_source, self._synced_pass
        self._synced_pass = None
        if source is not None:
            source.take(step, active_index(step) if k is None else k)

    def on_bucket_launch(self, index: int, buffer: torch.Tensor, bucket) -> BucketRecord | None:
        cur = self.current
        if cur is None:
            return None
        now = self.clock.stamp()
        # A bucket's parameters change only when DDP rebuilds its buckets, which gives it
        # new buffers: look them up once per buffer, not on every step.
        key = (index, buffer.data_ptr(), buffer.numel())
        params = self._bucket_params.get(key)
        if params is None:
            params = self._bucket_params[key] = tuple(self.param_index.get(id(p), -1) for p in bucket.parameters())
        rec = BucketRecord(index=index, nbytes=buffer.numel() * buffer.element_size(), params=params, launch=now)
        cur.buckets.append(rec)
        cur.buffers[index] = buffer
        return rec

    def on_own_start(self, name: str, nbytes: int, **_) -> OwnCollective | None:
        """One of DDP's own collectives begins (its buffer broadcast), or one the script
        issued (``collective_timer``'s protocol): on the open step's own lane, never a bucket."""
        cur = self.current
        if cur is None:
            return None
        rec = OwnCollective(name, nbytes, self.clock.stamp())
        cur.own.append(rec)
        return rec

    def on_own_end(self, rec: OwnCollective) -> None:
        rec.done = self.clock.stamp()

    def on_own_return(self, rec: OwnCollective, done: bool, launch_only: bool = False, **_) -> None:
        if done:
            rec.launch_only = launch_only
            self.on_own_end(rec)

    def on_own_wait(self, rec: OwnCollective, entering: bool) -> None:
        """DDP's compute is not cut per module: a wait changes nothing recorded."""

    def on_optimizer_start(self) -> None:
        if self.current is not None:
            self.current.optimizer = [self.clock.stamp(), None]

    def on_optimizer_end(self) -> None:
        cur = self.current
        if cur is None:
            return
        now = self.clock.stamp()
        if cur.optimizer is None:
            # optimizer.step(closure) ran forward and backward inside it (Lightning): the
            # update itself starts when the closure's backward is done
            last = cur.passes[-1] if cur.passes else None
            start = last and (last.sync_end or last.backward_end)
            cur.optimizer = [start if start is not None else now, None]
        cur.optimizer[1] = now
        if not self.explicit:
            self._close(now)

    def on_param_sync_start(self, nbytes: int, own_bytes: int, broadcasts: int) -> ParamSync | None:
        if self.current is None:
            return None
        rec = self.current.param_sync = ParamSync(self.clock.stamp(), nbytes, own_bytes, broadcasts)
        return rec

    def on_param_sync_end(self, rec: ParamSync | None) -> None:
        if rec is not None:
            rec.end = self.clock.stamp()

    def mark_step(self) -> None:
        """Explicit step boundary: the open step ends now."""
        if self.current is not None:
            self._close(self.clock.stamp())

    def finish(self, aborted: bool) -> None:
        """Close the open step (``incomplete`` if aborted mid-step) and resolve everything."""
        cur = self.current
        if cur is not None and self.bucket_source is not None:
            self._take_buckets(cur)  # its all-reduces, their device times too: is it finished?
            self.bucket_source.settle([cur])
        if cur is not None:
            if aborted or not self._looks_finished(cur):
                cur.incomplete = True
            if cur.incomplete and not cur.grads and not cur.buckets and not aborted:
                self.current = None  # a lone forward (e.g. evaluation) is not a step
            else:
                self._close(self.clock.stamp())
        self._resolve(len(self.pending))
        self.memory.close()

    # -- internals ----------------------------------------------------------------
    def _looks_finished(self, cur: StepRecord) -> bool:
        return bool(cur.buckets) and all(b.done is not None for b in cur.buckets)

    def _close(self, now: Any) -> None:
        cur = self.current
        self.current = None
        cur.end = now
        self._take_buckets(cur)
        if self.grad_marks_every > 1 and cur.grad_marks and cur.grads:  # in stamp order: the syncing pass's last is where compute ends
            k = max((i for i, p in enumerate(cur.passes) if p.sync), default=len(cur.passes) - 1)
            self._last_grad = next((p for p, _, kk in reversed(cur.grads) if kk == k), cur.grads[-1][0])
        if cur.measure_memory:
            self._measure(cur)
        self.pending.append(cur)
        self._resolve(len(self.pending) - steps_to_keep(self.clock, [s.end for s in self.pending]))
        if self.on_close is not None:
            self.on_close(cur)

    def _measure(self, cur: StepRecord) -> None:
        source = self.bucket_source
        cur.memory = self.measure(self.optimizer, cur.buffers.values())
        if source is not None and cur.buckets:  # no buffers seen: DDP's buckets are extra unless grads view them
            # their parameters' bytes, not the all-reduces' (a built-in FP16 hook sends half)
            cur.memory["bucket_buffers_bytes"] = 0 if source.ddp.gradient_as_bucket_view else \
                self._layout_of(cur)[1]

    def _resolve(self, count: int) -> None:
        if count <= 0:
            return
        ready, self.pending = self.pending[:count], self.pending[count:]
        # CUDA: the newest end done, so every event of these steps on the compute stream is
        # (one query, not one per event; not done: resolved anyway, each waited for if need be)
        known_done = self.clock.resolves and self.clock.done(ready[-1].end)
        if self.bucket_source is not None:  # device times of buckets still waiting for them
            self.bucket_source.settle(ready, known_done)
        if self.clock.resolves:  # stamps are device events: µs now, one batch (completed: no sync)
            _resolve_in_place(ready, lambda stamps: self.clock.resolve(stamps, known_done))
        nccl = [[self._nccl_us(b) for b in s.buckets] for s in ready] if self.nccl_kernel_timing else None
        layout_changed = False
        for s in ready:
            s.buffers = {}
            layout = self._layout_of(s)[0]
            if layout and (not self.layouts or self.layouts[-1]["buckets"] != layout):
                self.layouts.append({"from_step": s.step, "buckets": layout})
                layout_changed = True
        self.steps_written += len(ready)
        # one hand-over a step: the writer takes a hand-over whole or not at all, so a step
        # whose events fail to build (a bug of ours) loses only itself, never a finished step
        # resolved with it (a device behind by a few steps resolves them together)
        for n, s in enumerate(ready):
            last = n == len(ready) - 1
            self.emit(self.step_events.events([s], nccl[n:n + 1] if nccl else None),
                      self.layouts if layout_changed and last else None)

    def _layout_of(self, s: StepRecord) -> tuple[list[list[int]], int]:
        """The step's bucket layout (parameter indices per bucket, by bucket index) and its
        parameters' bytes. Kept for the last layout seen: the same bucket records' params
        tuples come back every step until DDP rebuilds its buckets."""
        key = tuple(b.params for b in s.buckets)
        if key != self._layout_key:
            layout = [list(p) for p in _layout(s.buckets)]
            self._layout_key, self._layout = key, (layout, sum(self.param_nbytes[i] for p in layout for i in p if i >= 0))
        return self._layout

    def _nccl_us(self, b: BucketRecord) -> float | None:
        # Work._get_duration(): NCCL kernel time in ms, with ProcessGroupNCCL's collectives
        # timing on (its own start/end CUDA events; read once the step's events completed,
        # so it never waits); the compiled capture read it already (kernel_us).
        if b.kernel_us is not None:
            return b.kernel_us
        try:
            return None if b.work is None else b.work._get_duration() * 1000.0  # ms -> µs
        except (RuntimeError, AttributeError):
            return None

def active_index(step: StepRecord) -> int:
    """The pass whose backward is running (the latest pass when no output gradient said)."""
    return len(step.passes) - 1 if step.active is None else step.active


def _synced(step: StepRecord) -> bool:
    """A syncing backward of ``step`` has finished (DDP reduced its gradients)."""
    return any(p.sync and p.backward_end is not None for p in step.passes)


def _resolve_in_place(steps: list[StepRecord], resolve: Callable[[list], list]) -> None:
    """Every stamp of ``steps`` turned into µs by one ``resolve`` call (no device sync).
    Gradients whose times are µs already (the compiled capture's, read from its ring by
    ``settle``: most of a step's stamps) are left as they are."""
    stamps: list[Any] = []
    stamped = []  # per step: its gradients hold stamps (the Python hooks' events), not µs
    for s in steps:
        stamps += [s.start, s.end]
        stamps += [s.optimizer[0], s.optimizer[1]] if s.optimizer else [None, None]
        stamps += [s.param_sync.start, s.param_sync.end] if s.param_sync else [None, None]
        for p in s.passes:
            stamps += [*p.forward, p.backward_start, p.backward_end, p.sync_end]
        stamped.append(any(type(t) is tuple for _, t, _ in s.grads))  # a device stamp is a tuple (clock.py)
        if stamped[-1]:
            stamps += [t for _, t, _ in s.grads]
        for b in (*s.buckets, *s.own):
            stamps += [b.launch, b.done]
    times = iter(resolve(stamps))
    for s, grads_stamped in zip(steps, stamped):
        s.start, s.end = next(times), next(times)
        opt = [next(times), next(times)]
        s.optimizer = opt if s.optimizer else None
        sync_start, sync_end = next(times), next(times)
        if s.param_sync:
            s.param_sync.start, s.param_sync.end = sync_start, sync_end
        for p in s.passes:
            p.forward = [next(times), next(times)]
            p.backward_start, p.backward_end, p.sync_end = next(times), next(times), next(times)
        if grads_stamped:
            s.grads = [(i, next(times), k) for i, _, k in s.grads]
        for b in (*s.buckets, *s.own):
            b.launch, b.done = next(times), next(times)


def _layout(buckets: list[BucketRecord]) -> list[tuple[int, ...]]:
    by_index = {b.index: b.params for b in buckets}
    return [by_index[i] for i in sorted(by_index)]
