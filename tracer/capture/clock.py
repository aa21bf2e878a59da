"""Where the tracer's timestamps come from.

A clock hands out *stamps* while training runs and turns them into microseconds on
this host's monotonic clock later, in one go per step (``resolve``). On CPU/gloo a
stamp already is a time; on CUDA a stamp is an event on a stream, resolved once it has completed, without
synchronising the device (see ``cuda_clock.py``, kept separate because CI cannot run it).

All times are microseconds (µs) as floats on the host's monotonic clock, the clock
that cross-rank offsets (``offsets.py``) are estimated on, at ns resolution: a whole
number of ns divided by 1000, so a time is written with 3 decimals at most and the
recorder need not round each one.
"""

from __future__ import annotations

import os
import time
from typing import Any, Protocol, Sequence

# Test-only: shifts this process's clock by this many milliseconds, so that a test
# on one machine can show that cross-rank alignment removes a real offset.
SKEW_ENV = "DDPSCOPE_TEST_CLOCK_SKEW_MS"


def host_skew_us() -> float:
    """The injected test skew in µs (0 unless ``DDPSCOPE_TEST_CLOCK_SKEW_MS`` is set)."""
    raw = os.environ.get(SKEW_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        return float(raw) * 1000.0
    except ValueError:
        raise ValueError(f"{SKEW_ENV} must be a number of milliseconds, got {raw!r}") from None


class Clock(Protocol):
    """The interface both clocks implement."""

    kind: str
    #: Closed steps that may wait for their stamps to complete before the oldest is
    #: resolved anyway (0: resolved at once; CUDA: a few, so that resolving never stalls
    #: the step that is still running). See ``steps_to_keep``.
    lag_steps: int
    #: Stamps are not times yet (events): ``resolve`` must turn them into µs. False: a
    #: stamp is its time in µs, and the recorder skips resolving.
    resolves: bool

    def stamp(self) -> Any:
        """Mark "now" on the current stream (CPU: the host clock)."""

    def host_us(self) -> float:
        """The host monotonic clock now, µs (with any test skew)."""

    def stamp_current(self) -> Any:
        """A stamp on the stream current now, even where ``stamp`` is pinned to another
        (CUDA: a collective's own stream; CPU: the host clock, as ``stamp``)."""

    def done(self, stamp: Any) -> bool:
        """The stamp's work has completed: resolving it will not block (never syncs)."""

    def resolve(self, stamps: Sequence[Any], known_done: bool = False) -> list[float | None]:
        """Turn stamps into host-clock µs (``None`` stays ``None``); never synchronises
        the device (CUDA: waits only for a stamp's own event that has not completed;
        ``known_done``: a later stamp on their stream has, so none is queried first)."""

    def facts(self) -> dict:
        """What a rank's metadata says of the clock at the end (CUDA: anchors, drift, waits)."""


class CpuClock:
    """Host monotonic clock (``time.perf_counter_ns``, CLOCK_MONOTONIC on Linux)."""

    kind = "cpu-monotonic"
    lag_steps = 0
    resolves = False

    def __init__(self) -> None:
        self.skew_ns = round(host_skew_us() * 1000.0)  # test-only; whole ns keep times at ns resolution

    def host_us(self) -> float:
        return (time.perf_counter_ns() + self.skew_ns) / 1000.0

    def stamp(self) -> float:
        return (time.perf_counter_ns() + self.skew_ns) / 1000.0

    stamp_current = stamp

    def done(self, stamp: Any) -> bool:
        return True

    def resolve(self, stamps: Sequence[Any], known_done: bool = False) -> list[float | None]:
        return [None if s is None else float(s) for s in stamps]

    def facts(self) -> dict:
        return {}


def period_of(host_us: float, offset_us: float, interval_us: float) -> int:
    """The period of ``interval_us`` of rank 0's clock that this rank's host time ``host_us``
    falls in (``offset_us``: this rank's offset to rank 0, ``offsets.py``): at one moment,
    the same on every rank. What every rank does once a period (write its steps, measure
    memory) it does in the same step: one rank's pause holds up the others at their next
    collective, so pauses in different steps would cost each rank all of them."""
    return int((host_us + offset_us) // interval_us)


def steps_to_keep(clock: Clock, ends: Sequence[Any]) -> int:
    """How many of the newest closed steps (``ends``: their end stamps, oldest first) wait:
    those from the oldest whose end has not completed on the device, at most
    ``clock.lag_steps`` (older ones are resolved anyway, blocking on their own events)."""
    if not clock.lag_steps:  # the host clock: every stamp is a time already
        return 0
    waiting = len(ends)
    for end in ends:
        if not clock.done(end):
            break
        waiting -= 1
    return min(waiting, clock.lag_steps)


def make_clock(device: Any) -> Clock:
    """The clock for a model on ``device`` (a ``torch.device`` or string): on CUDA, that
    device's events and streams, whichever device is current."""
    if str(device).startswith("cuda"):
        import torch

        from ddpscope.tracer.capture.cuda_clock import CudaEventClock

        return CudaEventClock(host_clock=CpuClock(), device=torch.device(device))
    return CpuClock()
