"""The sharded step state machine: what each step of an FSDP2 rank did, per unit.

The hooks (``fsdp_hooks.py``) call ``enter``/``leave`` around each unit's forward and
backward, ``comm_start``/``comm_end`` around each collective and ``wait_start``/
``wait_end`` around each wait for an all-gather. A stack of what runs now cuts the
training thread's time into segments, each one the innermost unit's compute (a unit's
forward holds its children's: the children's time is theirs) or a collective or a wait.
A step starts at the root's training forward and ends when the optimizer step returns;
an all-gather the script issues between steps (its own ``unshard()`` before forward, as
PyTorch's FSDP2 example does every step) is held and made the next training step's: the
step starts at it. One issued inside a forward outside the steps (an evaluation's) is not.

The phase comes from autograd, not from which hook ran last: whatever runs while
autograd's engine executes a backward (``in_backward``) is backward, wherever the script
calls it: a loss that runs its own ``backward()`` per chunk inside its call (torchtitan's
chunked loss), a forward recomputed by activation checkpointing. A unit whose pre-forward
runs several times before its one post-forward (a group of modules, ``fully_shard([norm,
head])``, its head called per chunk) is on the stack once; the root's backward sits at
the bottom of the stack even when its pre-backward runs after a child's (its output is a
child's: a body's hidden states whose backward the script starts itself).

Times are clock stamps (``clock.py``): µs on CPU; on CUDA, events resolved in one batch
when the step closes. Closed steps go to ``emit`` in batches: a step's events cost ~250 µs
to make and encode right after it (its tensors have flushed the caches), ~40 % less each
in a batch (benchmarks/deepspeed.py). Every rank emits in the same step: after every
``HOLD_STEPS``-th step, and at the first step closed in each ``HOLD_S`` of rank 0's clock
(``offset_us``: this rank's offset to it; steps longer than ``HOLD_S / HOLD_STEPS``). A
rank's emit holds up every other rank at their next collective, so ranks that emitted in
different steps (as a batch every ``HOLD_S`` of each rank's own time did) each paid every
other's too: measured here on a 2-rank DeepSpeed run (16 ms steps), an emit took 1.8 ms
on the training thread and its step 3.4 ms longer than the others. A rank that stops
closing steps (a hang, a long evaluation) for ``STALL_S`` has them written by the live
file's thread (``flush_held``), so a run killed later keeps every step that finished.
Runs on the training thread; the autograd thread is the same one on CPU (on CUDA,
autograd's device thread calls the backward hooks: the stack is per pass, and a
backward hook never runs while a forward does).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ddpscope.tracer.capture.clock import Clock, period_of, steps_to_keep
from ddpscope.tracer.capture.sharded.step_times import cut_holes, resolve_steps

FORWARD, BACKWARD = "forward", "backward"
ROOT = 0  # the root unit's index (units.find_units lists it first)


@dataclass(slots=True)
class Coll:
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce"
    unit: int
    phase: str  # the pass it ran in: forward / backward
    nbytes: int  # the collective's message: all-gather output, reduce-scatter input
    start: Any
    end: Any = None
    prefetch: bool = False  # issued by another unit ahead of its use
    # CUDA: (start, end) stamps on the collective's own stream (its end: after the stream
    # waited for the work, or in the Work's future callback); they time the collective,
    # while start/end (the compute stream's) cut compute
    device: list[Any] | None = None
    extra: dict | None = None  # more args for its event (DeepSpeed: what issued it, the bucket)


@dataclass(slots=True)
class Pass:
    forward: list[Any]
    reduce_grads: bool = True  # set_requires_gradient_sync(False): accumulation without reduction
    backward_start: Any = None
    backward_end: Any = None


@dataclass(slots=True)
class ShardedStep:
    step: int
    start: Any
    passes: list[Pass] = field(default_factory=list)
    segments: list[tuple[int, str, Any, Any]] = field(default_factory=list)  # (unit, phase, start, end)
    waits: list[tuple[int, str, Any, Any]] = field(default_factory=list)
    colls: list[Coll] = field(default_factory=list)
    optimizer: list[Any] | None = None
    end: Any = None
    memory: list[dict] = field(default_factory=list)  # samples: {"ts", "unit", "phase", "at", bytes...}
    measure: bool = False
    incomplete: bool = False
    # (start, end): the training thread inside a collective or a wait recorded whole after it
    # returned (``comm_timed``, ``wait_timed``); cut out of the compute segments when emitted
    holes: list[tuple[Any, Any]] = field(default_factory=list)
    raw: list[tuple] = field(default_factory=list)  # a tap's bare records: made ``colls`` by ``expand``


HOLD_STEPS = 16  # closed steps are emitted together after every 16th step: the same step on every rank
HOLD_S = 1.0  # ... and at the first step closed in each second of rank 0's clock (long steps)
STALL_S = 1.0  # no step closed for this long (seconds): the live file's thread emits what is held


class ShardedRecorder:
    """Collects steps; hands each closed step to ``emit(step)`` once its stamps are µs."""

    def __init__(self, *, clock: Clock, emit: Callable[[ShardedStep], None],
                 sample: Callable[[], dict] | None = None, measure_step: Callable[[int], bool] = lambda s: True,
                 on_close: Callable[[ShardedStep], None] | None = None,
                 in_backward: Callable[[], bool] = lambda: False, offset_us: float = 0.0) -> None:
        """``offset_us``: add it to this rank's host clock (µs) for rank 0's (``offsets.py``)."""
        self.clock = clock
        self.offset_us = offset_us
        self.in_backward = in_backward  # autograd's engine runs a backward on this thread now
        self.emit = emit
        self.sample = sample  # bytes by category now (the memory meter), on measured steps
        self.measure_step = measure_step
        self.on_close = on_close
        self.expand: Callable[[ShardedStep], None] | None = None  # a step's raw into colls, when emitted
        self.optimizer = None  # found at its first step (hooks._attach_optimizer_finder)
        self.current: ShardedStep | None = None
        self.next_step = 0
        self.steps_written = 0
        self._stack: list[tuple[int, str] | None] = []  # None: inside a collective or a wait
        self._open: tuple[int, str, Any] | None = None  # the segment running since
        self.where: tuple[int, str, str | None] = (-1, "", None)  # (unit, phase, collective) for the live file
        self._lag: list[ShardedStep] = []  # closed, not yet emitted (held, or CUDA's events not yet done)
        self._lag_lock = threading.Lock()  # the live file's thread may emit what is held (flush_held)
        # between steps: the script's own all-gathers and their waits, for the next training step
        self._early: list[Coll] = []
        self._early_waits: list[tuple[int, str, Any, Any]] = []
        self._outside = 0  # units whose forward runs outside a step (an evaluation's), entered and not left
        self._last_close = time.monotonic()
        self._beat = self._beat_now()  # the HOLD_S period of rank 0's clock of the last batch

    # -- passes ---------------------------------------------------------------------
    def on_forward_start(self, reduce_grads: bool = True) -> None:
        now = self.clock.stamp()
        cur = self.current
        if cur is None:
            early, waits = self._early, self._early_waits
            cur = self.current = ShardedStep(step=self.next_step, start=early[0].start if early else now,
                                             measure=self.measure_step(self.next_step), colls=early, waits=waits)
            self.next_step += 1
            self._early, self._early_waits, self._outside = [], [], 0
        elif cur.optimizer is not None and cur.optimizer[1] is None:
            cur.optimizer = None  # a forward inside optimizer.step(closure): not the update
        cur.passes.append(Pass(forward=[now, None], reduce_grads=reduce_grads))
        self._stack.clear()
        self._open = None

    def on_forward_end(self) -> None:
        cur = self.current
        if cur is not None and cur.passes:
            cur.passes[-1].forward[1] = self.clock.stamp()

    def on_backward_start(self) -> None:
        cur = self.current
        if cur is not None and cur.passes and cur.passes[-1].backward_start is None:
            cur.passes[-1].backward_start = self.clock.stamp()

    def on_backward_call(self, entering: bool) -> None:
        """The script's call of autograd's backward begins (``entering``) or returns: a
        cut. What runs inside it is backward, though autograd's engine starts only after
        this; a backward the script calls inside its forward (a chunked loss) has no unit
        hook at its start to cut there."""
        if self.current is None:
            return
        now = self.clock.stamp()
        self._cut(now)
        if entering and self._stack and self._stack[-1] is not None:
            self._open = (self._stack[-1][0], BACKWARD, now)
        else:
            self._resume(now)

    def on_backward_end(self) -> None:
        cur = self.current
        if cur is not None and cur.passes:
            now = self.clock.stamp()
            self._cut(now)
            self._stack.clear()
            self._open = None
            cur.passes[-1].backward_end = now

    # -- units, collectives, waits ----------------------------------------------------
    def enter(self, unit: int, phase: str) -> None:
        if self.current is None:  # a forward outside the steps: what was held is its own
            self._outside += 1
            self._early.clear()
            self._early_waits.clear()
            return
        now = self.clock.stamp()
        self._cut(now)
        if unit == ROOT and phase == BACKWARD:
            self._stack.insert(0, (unit, phase))  # it encloses every other unit's backward
        elif self._top() != (unit, phase):  # a group's pre-forward runs once per module called
            self._stack.append((unit, phase))
        self._resume(now)
        self.where = (unit, phase, None)
        if phase == BACKWARD:
            self.on_backward_start()
        self._sample(unit, phase, "start")

    def leave(self, unit: int, phase: str) -> None:
        if self.current is None:
            self._outside = max(0, self._outside - 1)
            self._early.clear()  # issued inside that forward
            self._early_waits.clear()
            return
        self._sample(unit, phase, "end")
        now = self.clock.stamp()
        self._cut(now)
        # its own entry, wherever it is; a unit's post-backward also ends a forward of it
        # left open (a group's module called again on its own, with no post-forward)
        for entry in ((unit, phase), (unit, FORWARD)) if phase == BACKWARD else ((unit, phase),):
            if entry in self._stack:
                del self._stack[len(self._stack) - 1 - self._stack[::-1].index(entry)]
                break
        self._resume(now)
        top = self._top()
        self.where = (top[0], top[1], None) if top else (-1, "", None)

    def comm_start(self, kind: str, unit: int, nbytes: int, prefetch: bool, phase: str | None = None,
                   extra: dict | None = None) -> Coll | None:
        """A collective the training thread runs now (compute pauses until ``comm_end``).
        Between steps, an all-gather outside any forward is held for the next step."""
        cur = self.current
        if cur is None:
            if kind != "all_gather" or self._outside:
                return None
            rec = Coll(kind=kind, unit=unit, phase=FORWARD, nbytes=nbytes, start=self.clock.stamp(), extra=extra,
                       device=[self.clock.stamp_current(), None] if self.clock.resolves else None)
            self._early.append(rec)
            return rec
        now = self.pause()
        rec = Coll(kind=kind, unit=unit, phase=phase or self.phase_of(cur), nbytes=nbytes, start=now, prefetch=prefetch,
                   extra=extra, device=[self.clock.stamp_current(), None] if self.clock.resolves else None)
        cur.colls.append(rec)
        self.where = (unit, rec.phase, kind)
        return rec

    def comm_timed(self, step: ShardedStep, kind: str, unit: int, nbytes: int, prefetch: bool, phase: str | None,
                   extra: dict | None, start: Any, end: Any) -> None:
        """A synchronous collective of ``step`` that ran from ``start`` to ``end`` (host clocks:
        DeepSpeed's tap): the record ``comm_start`` + ``comm_end`` make, its time left out of
        compute when the step is emitted, without cutting and resuming the stack."""
        step.colls.append(Coll(kind, unit, phase or self.phase_of(step), nbytes, start, end, prefetch, None, extra))
        step.holes.append((start, end))

    def wait_timed(self, step: ShardedStep, unit: int, start: Any, end: Any) -> None:
        """A wait for an all-gather of ``step`` from ``start`` to ``end``, recorded whole after
        it (as ``wait_start`` + ``wait_end``; its time leaves compute when emitted)."""
        top = self._top()
        step.waits.append((unit, BACKWARD if self.in_backward() else top[1] if top else FORWARD, start, end))
        step.holes.append((start, end))

    def comm_async(self, kind: str, unit: int, nbytes: int, prefetch: bool, phase: str | None = None,
                   extra: dict | None = None) -> Coll | None:
        """A collective launched now that runs beside compute (gloo's own threads): its
        ``end`` is stamped by whoever sees it done (its future); compute goes on."""
        cur = self.current
        if cur is None:
            return None
        rec = Coll(kind=kind, unit=unit, phase=phase or self.phase_of(cur), nbytes=nbytes, start=self.clock.stamp(),
                   prefetch=prefetch, extra=extra)
        cur.colls.append(rec)
        return rec

    def phase_of(self, cur: ShardedStep) -> str:
        """The pass a collective issued now in step ``cur`` runs in: autograd's backward, else the
        innermost unit's pass, else the step's latest pass."""
        top = self._top()
        return BACKWARD if self.in_backward() else top[1] if top else \
            (BACKWARD if cur.passes and cur.passes[-1].backward_start is not None else FORWARD)

    def comm_end(self, rec: Coll | None, work: Any = None) -> None:
        """The collective's call returned (``work``: what it returned, a ``Work`` when async)."""
        if rec is None:
            return
        if self.current is None:  # between steps: one held for the next step (else dropped meanwhile)
            if any(r is rec for r in self._early):
                rec.end = self.clock.stamp()
                if rec.device is not None:
                    self._device_end(rec, work)
            return
        rec.end = self.unpause()
        if rec.device is not None:
            self._device_end(rec, work)

    def pause(self) -> Any:
        """The training thread leaves compute for a collective or a wait: the running
        segment is cut until ``unpause``. Returns the stamp (in a step only)."""
        now = self.clock.stamp()
        self._cut(now)
        self._stack.append(None)
        return now

    def unpause(self) -> Any:
        """Compute runs again after ``pause``; returns the stamp."""
        now = self.clock.stamp()
        self._pop_marker()
        self._resume(now)
        top = self._top()
        self.where = (top[0], top[1], None) if top else (-1, "", None)
        return now

    def _device_end(self, rec: Coll, work: Any) -> None:
        """CUDA: the collective's end on a stream that waits for it: the current one after a
        synchronous call (it waits for NCCL's), else the Work's future's callback stream."""
        future = getattr(work, "get_future", None)
        if future is None:
            rec.device[1] = self.clock.stamp_current()
            return

        def done(_):
            rec.device[1] = self.clock.stamp_current()

        try:
            future().then(done)
        except RuntimeError:  # a Work without a future: the end is not known on the device
            pass

    def wait_start(self, unit: int) -> Any:
        if self.current is None:  # between steps: the wait for an all-gather held for the next step
            return (unit, FORWARD, self.clock.stamp()) if any(r.unit == unit for r in self._early) else None
        now = self.pause()
        top = self._top()
        return (unit, BACKWARD if self.in_backward() else top[1] if top else FORWARD, now)

    def wait_end(self, token: Any) -> None:
        if token is None:
            return
        if self.current is None:
            if any(r.unit == token[0] for r in self._early):
                self._early_waits.append((*token, self.clock.stamp()))
            return
        unit, phase, start = token
        self.current.waits.append((unit, phase, start, self.unpause()))

    def on_optimizer_start(self) -> None:
        if self.current is not None:
            self.current.optimizer = [self.clock.stamp(), None]

    def on_optimizer_end(self) -> None:
        cur = self.current
        if cur is None:
            return
        now = self.clock.stamp()
        if cur.optimizer is None:
            cur.optimizer = [now, None]
        cur.optimizer[1] = now
        if cur.measure and self.sample is not None:  # the optimizer state appears at the first step
            cur.memory.append({"ts": now, "unit": -1, "phase": "optimizer", "at": "end", **self.sample()})
        self._close(now)

    def finish(self, aborted: bool) -> None:
        """Close the open step (``incomplete`` if aborted in it) and write everything."""
        cur = self.current
        if cur is not None:
            if not cur.passes or cur.passes[-1].backward_end is None and not aborted:
                if not cur.colls and not cur.segments:
                    self.current = None  # a lone evaluation forward is not a step
            if self.current is not None:
                cur.incomplete = True
                self._close(self.clock.stamp())
        self._flush(keep=0)

    # -- internals ------------------------------------------------------------------
    def _top(self) -> tuple[int, str] | None:
        for s in reversed(self._stack):  # a loop, not next(genexpr): called ~90 times a step
            if s is not None:
                return s
        return None

    def _cut(self, now: Any) -> None:
        """The segment running until now is closed (a segment of zero length is dropped)."""
        if self._open is not None and self.current is not None:
            unit, phase, start = self._open
            self.current.segments.append((unit, phase, start, now))
        self._open = None

    def _resume(self, now: Any) -> None:
        """Compute of the innermost unit runs again, unless a collective or wait is open."""
        if self._stack and self._stack[-1] is not None:
            unit, phase = self._stack[-1]
            self._open = (unit, BACKWARD if phase == FORWARD and self.in_backward() else phase, now)

    def _pop_marker(self) -> None:
        stack = self._stack
        if stack and stack[-1] is None:  # the usual case: the collective or wait just opened
            stack.pop()
            return
        for k in range(len(stack) - 2, -1, -1):
            if stack[k] is None:
                del stack[k]
                return

    def _sample(self, unit: int, phase: str, at: str) -> None:
        cur = self.current
        if cur is not None and cur.measure and self.sample is not None:
            cur.memory.append({"ts": self.clock.stamp(), "unit": unit, "phase": phase, "at": at, **self.sample()})

    def _close(self, now: Any) -> None:
        cur = self.current
        self.current = None
        self._cut(now)
        self._stack.clear()
        self._open = None
        cur.end = now
        with self._lag_lock:
            self._lag.append(cur)
        self._last_close = time.monotonic()
        if (cur.step + 1) % HOLD_STEPS == 0 or self._beat_now() != self._beat:  # the same step on every rank
            self._flush()
        if self.on_close is not None:
            self.on_close(cur)

    def _beat_now(self) -> int:
        """The ``HOLD_S`` period of rank 0's clock it is now."""
        return period_of(self.clock.host_us(), self.offset_us, HOLD_S * 1e6)

    def flush_held(self) -> None:
        """Emit what is held when no step has closed for ``STALL_S`` (a hang, a long
        evaluation): the live file's thread calls it. Never while steps keep closing: an
        encode on another thread takes the GIL from the step being traced."""
        if self._lag and time.monotonic() - self._last_close >= STALL_S:
            self._flush()

    def _flush(self, keep: int | None = None) -> None:
        """Emit every closed step but the newest ``keep`` (None: those whose device work
        has not completed, ``clock.steps_to_keep``), oldest first."""
        with self._lag_lock:
            count = len(self._lag) - (steps_to_keep(self.clock, [s.end for s in self._lag]) if keep is None else keep)
            if count <= 0:
                return
            ready, self._lag = self._lag[:count], self._lag[count:]
            self._beat = self._beat_now()
            if self.clock.resolves:  # CUDA: every stamp of these steps in one batch (completed: no sync)
                resolve_steps(ready, self.clock.resolve)
            for s in ready:
                if self.expand is not None:
                    self.expand(s)
                if s.holes:
                    s.segments = cut_holes(s.segments, s.holes)
                self.steps_written += 1
                self.emit(s)

