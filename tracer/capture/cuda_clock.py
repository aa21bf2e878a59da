"""CUDA clock: ``torch.cuda.Event`` stamps on the model's device, mapped onto the host clock
without ever synchronising the device.

NOT exercised by CI (the CI machines have no GPU). Its scheduling and arithmetic are
device-independent and tested with a stand-in for an event (tests/tracer/capture/test_clock.py
says so); tests/tracer/capture/test_cuda.py runs it where a GPU is.

**Anchors.** A GPU time becomes a host time through an *anchor*: an event recorded on a
stream of its own (idle, so the event completes at once) while the host clock brackets it:
``t0`` before the record, ``t1`` when ``query()`` first says done. The anchor's host time
is the midpoint, within ``(t1 - t0) / 2``; of ``ANCHOR_SAMPLES`` tries the tightest bracket
wins. A stamp's host time is ``anchor_host + elapsed(anchor, stamp) * rate``.

**Re-anchoring.** ``cudaEventElapsedTime`` returns float32 milliseconds: measured from one
anchor taken at attach, a stamp's rounding step grows to ~3.9 µs after a minute and ~250 µs
after an hour. A new anchor is taken every ``REANCHOR_S`` (between steps, when a step is
resolved), each stamp is measured from the last anchor before it was recorded (a few
seconds back: ≤ 0.25 µs of rounding), and the GPU-vs-host drift is taken out: ``rate``,
host µs per device µs, measured between the new anchor and the oldest one kept (up to
~2 minutes back), and only once that baseline is long against the two anchors' brackets
(``_rate``); until then the last rate (1 at first). A rate from two anchors seconds apart
is mostly the brackets' noise, not drift.

**Sharing.** The compiled capture (``native/timed_group.cpp``) times bucket all-reduces
with its own events; it registers as an *anchor sink*: at every try it records its own
event on the same idle stream just before ours, and the winning try's host time and the
rate are committed to both, so compute, gradient-ready and bucket lanes sit on one
anchor and one rate, never two. (Each side used to measure its own rate over its own
pair of anchors; the first pair differed, and a 2-rank job sharing one GPU then showed
gradients ready after the end of their backward. That this was the cause is read from
the code, not yet confirmed on a GPU.)

**No device-wide sync.** A step is resolved when its end stamp ``query()``s done (the
recorder asks ``done``); only when ``lag_steps`` steps are waiting is the oldest resolved
anyway, blocking on its own events (``Event.synchronize``), never on the device.

**Stamps in C++.** With the compiled capture on a device, stamps come from its ring of
preallocated events (``DeviceStamps``, ``use_stamps``): recorded in C++ on the model's
device's current stream, on the shared anchors, resolved in one call. A ``torch.cuda.Event``
per stamp (made, recorded and destroyed from Python) cost the training thread ~10 µs a stamp
with the GPU idle and several times that inside a launch-bound step. A stamp is then
``(None, slot)``; a full ring (slots not read yet) and a pinned stream fall back to events.

Where stamps are recorded (see ddp/step_hooks.py and ddp/comm_hook.py): compute-side
stamps on the current stream of the model's device on the thread that stamps (the
compute stream); a bucket's completion inside the all-reduce future's ``then`` callback,
whose current stream waits for the NCCL work. Host µs handed over by the compiled capture
pass through ``resolve`` as they are.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Protocol, Sequence


class AnchorSink(Protocol):
    """Another set of device events (the compiled capture's) that shares this clock's anchors."""

    def candidate(self, index: int, stream: Any) -> None:
        """Record anchor try ``index``'s event on ``stream`` (before the clock records its own)."""

    def commit(self, index: int, host_ns: int, rate: float) -> None:
        """Try ``index`` won: its event is the new anchor, at ``host_ns`` on the host clock;
        ``rate`` (host per device time) applies from the sink's last anchor on: one rate,
        decided here, for both sets of events."""


class CudaEventClock:
    kind = "cuda-event"
    #: Steps that may wait for their events; the oldest of more is resolved anyway (blocking
    #: on its own events only). A step is resolved sooner once its end event is done.
    lag_steps = 2
    resolves = True
    REANCHOR_S = 2.0  # float32 ms of up to 2 s after an anchor: a rounding step of ≤ 0.12 µs
    ANCHOR_SAMPLES = 5
    ANCHOR_SPIN_US = 2000.0  # an anchor try that takes longer is waited for (event sync) and loses
    ANCHORS_KEPT = 64  # stamps are resolved a few steps (anchors) after they were recorded
    MAX_DRIFT = 1e-3  # a rate further than this from 1 is not drift (a GPU clock is good to ~1e-5)
    RATE_BASELINE_S = 1.0  # the drift is measured over at least this long
    RATE_UNCERTAINTY = 2e-6  # and only where the anchors' brackets allow this relative error

    def __init__(
        self,
        host_clock: Any,  # clock.CpuClock: its host_us(); clock.make_clock builds this one
        device: Any = None,  # the model's torch.device; None: the current device
        *,
        event_factory: Callable[[], Any] | None = None,
        current_stream: Callable[[], Any] | None = None,
        idle_stream: Any = None,
    ) -> None:
        import torch

        self._host = host_clock
        self.device = device
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        # The model's device, not the current one: a script that never calls set_device has
        # its model on cuda:k while the current device is cuda:0.
        self._current = current_stream or (lambda: torch.cuda.current_stream(device))
        self._stream = self._current  # where stamp() records (pin_stream fixes it)
        self._pinned = False
        self._idle = idle_stream if idle_stream is not None else torch.cuda.Stream(device=device)
        self._blocked = 0  # events resolve() had to wait for (Event.synchronize)
        # the compiled capture's DeviceStamps: _ring resolves its slots (kept once given back);
        # _ring_current (None once given back) hands them to stamp_current, _ring_stamp (None
        # also when pinned) to stamp
        self._ring: Any = None
        self._ring_current: Any = None
        self._ring_stamp: Any = None
        self._sinks: list[AnchorSink] = []
        # (event, host µs, rate, bracket half-width µs) per anchor; anchor k is self._anchors[k - self._first]
        self._anchors: deque[list] = deque(maxlen=self.ANCHORS_KEPT)
        self._first = 0
        self._count = 0
        self._drift_from_us: float | None = None  # host µs of the first anchor whose rate was measured
        self.reanchor()

    # -- anchors --------------------------------------------------------------------
    def share_anchors(self, sink: AnchorSink) -> None:
        """``sink``'s events use this clock's anchors from now on (it takes one now)."""
        self._sinks.append(sink)
        self.reanchor()

    def reanchor(self) -> None:
        """A new anchor: the tightest of ``ANCHOR_SAMPLES`` bracketed tries on the idle stream."""
        best = None
        for i in range(self.ANCHOR_SAMPLES):
            for sink in self._sinks:
                sink.candidate(i, self._idle)
            ev = self._new_event()
            t0 = self._host.host_us()
            ev.record(self._idle)
            while not ev.query():  # the idle stream runs nothing else: microseconds
                if self._host.host_us() - t0 > self.ANCHOR_SPIN_US:
                    ev.synchronize()  # this event only (a GPU too busy to take it at once)
                    break
            t1 = self._host.host_us()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, i, ev, round((t0 + t1) / 2.0, 3))
        width, i, ev, host = best
        rate = self._rate(ev, host, width / 2.0)
        for sink in self._sinks:
            sink.commit(i, round(host * 1000.0), rate)
        if self._anchors:
            self._anchors[-1][2] = rate  # from the last anchor to this one
        if len(self._anchors) == self._anchors.maxlen:
            self._first += 1
        self._anchors.append([ev, host, rate, width / 2.0])
        self._count += 1

    def _rate(self, ev: Any, host: float, halfwidth: float) -> float:
        """Host µs per device µs from the last anchor on: measured against the oldest anchor
        kept (up to ``ANCHORS_KEPT`` x ``REANCHOR_S`` back) once that is ``RATE_BASELINE_S``
        back and both anchors' host times are known well enough (their brackets' half-widths
        over the baseline ≤ ``RATE_UNCERTAINTY``); else the last anchor's. Two anchors a few
        ms apart cannot tell drift (ppm) from the brackets' noise: a GPU that another
        process time-slices can widen a bracket to ~1 ms, and a rate from such a pair is off
        by 1e-3 or more, which over the seconds to the next anchor puts stamps ms off."""
        if not self._anchors:
            return 1.0
        last = self._anchors[-1][2]
        base_ev, base_host, _, base_hw = self._anchors[0]
        span_us = host - base_host
        if span_us < self.RATE_BASELINE_S * 1e6 or (base_hw + halfwidth) / span_us > self.RATE_UNCERTAINTY:
            return last
        device_us = base_ev.elapsed_time(ev) * 1000.0
        measured = span_us / device_us if device_us > 0 else 1.0
        if abs(measured - 1.0) > self.MAX_DRIFT:
            return last
        if self._drift_from_us is None:
            self._drift_from_us = host
        return measured

    def facts(self) -> dict:
        """What a rank's metadata says of this clock at the end: anchors taken; the device
        clock's drift against the host's (ppm, + when it runs fast; None: no baseline was
        long enough to tell) and the host µs from which stamps were read at a measured rate;
        events that had to be waited for (``blocked``); stamps from the compiled capture's ring."""
        rate = self._anchors[-1][2]
        return {"clock_anchors": self._count, "clock_blocked": self.blocked, "clock_ring_stamps": self.ring_stamps,
                "clock_drift_ppm": None if self._drift_from_us is None else round((1.0 / rate - 1.0) * 1e6, 3),
                "clock_drift_from_us": self._drift_from_us}

    @property
    def anchor_host_us(self) -> float:
        """The newest anchor's host time (µs)."""
        return self._anchors[-1][1]

    # -- stamps ---------------------------------------------------------------------
    def host_us(self) -> float:
        return self._host.host_us()

    def pin_stream(self, stream: Any) -> None:
        """``stamp()`` records on ``stream`` (the compute stream) whichever stream is current
        when a hook stamps: FSDP2 runs its collectives, and so our hooks around them, inside
        its own streams, which run ahead of compute. (The ring records on the current stream:
        pinned stamps are events.)"""
        self._stream = lambda: stream
        self._pinned = True
        self._ring_stamp = None

    def use_stamps(self, ring: Any) -> None:
        """Stamps from ``ring`` (``DeviceStamps``: ``stamp() -> slot`` on the device's current
        stream and this clock's anchors, ``query(slot)``, ``resolve(slots) -> host ns``, 0
        unknown) from now on; None: events again (its stamps taken so far still resolve)."""
        if ring is not None:
            self._ring = ring
        self._ring_current = ring
        self._ring_stamp = None if self._pinned else ring

    @property
    def blocked(self) -> int:
        """Events read before they completed, each waited for (that event, never the device):
        the clock's own, and with the compiled capture's rings every event read on their
        anchors (its stamps, the gradients', the buckets')."""
        return self._blocked + (self._ring.blocked if self._ring is not None else 0)

    @property
    def ring_stamps(self) -> int:
        """Stamps handed out by the ring so far (0: every stamp was an event)."""
        return self._ring.issued if self._ring is not None else 0

    def stamp(self) -> Any:
        ring = self._ring_stamp
        if ring is not None:
            slot = ring.stamp()  # C++: a preallocated event on the device's current stream
            if slot >= 0:
                return (None, slot)
        ev = self._new_event()
        ev.record(self._stream())  # the model's device's current (or pinned) stream; no sync
        return (ev, self._count - 1)  # measured from the newest anchor

    def stamp_current(self) -> Any:
        """A stamp on the stream current now (a collective's own stream, or a future's
        callback stream that waits for its work); no sync."""
        ring = self._ring_current
        if ring is not None:
            slot = ring.stamp()  # the ring records on the current stream, pinned or not
            if slot >= 0:
                return (None, slot)
        ev = self._new_event()
        ev.record(self._current())
        return (ev, self._count - 1)

    def done(self, stamp: Any) -> bool:
        """The stamp's work has completed (resolving it will not block); no sync."""
        if stamp is None or isinstance(stamp, (int, float)):
            return True
        ev, k = stamp
        return self._ring.query(k) if ev is None else ev.query()

    def resolve(self, stamps: Sequence[Any], known_done: bool = False) -> list[float | None]:
        """Host µs of each stamp (``None`` stays ``None``; host µs pass through). A stamp not
        done yet is waited for on its own event; the device is never synchronised.
        ``known_done``: a later stamp on their stream has completed (the ring then reads
        each slot without a query first: a driver call a stamp)."""
        slots = [s[1] for s in stamps if type(s) is tuple and s[0] is None]
        ring_ns = iter(self._ring.resolve(slots, known_done) if slots else ())  # one C++ call for the ring's
        out = [self._resolve_one(s, ring_ns) for s in stamps]
        if self._host.host_us() - self._anchors[-1][1] >= self.REANCHOR_S * 1e6:
            self.reanchor()  # between steps: the next stamps are measured from a fresh anchor
        return out

    def _resolve_one(self, stamp: Any, ring_ns: Any) -> float | None:
        if stamp is None:
            return None
        if isinstance(stamp, (int, float)):
            return float(stamp)
        ev, k = stamp
        if ev is None:  # a ring slot: host ns (the anchors' host times: skew included), 0 unknown
            ns = next(ring_ns)
            return ns / 1000.0 if ns else None
        if not ev.query():
            ev.synchronize()  # CPU-GPU sync on this one event: a step resolved before its end
            self._blocked += 1
        anchor, host, rate, _ = self._anchors[max(k - self._first, 0)]
        return round(host + anchor.elapsed_time(ev) * 1000.0 * rate, 3)  # ms -> µs, at ns resolution
