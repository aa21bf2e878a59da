"""CUDA clock: ``torch.cuda.Event`` stamps, resolved with one synchronize per step.

NOT exercised by CI (the CI machines have no GPU); its arithmetic is covered by unit
tests that pass fake events (tests/tracer/capture/test_clock.py says so).

How it maps GPU time onto the host clock: at construction it synchronizes, records an
*anchor* event on an idle stream and reads the host clock right after the event has
completed. A stamp's host time is then ``anchor_host_us + anchor.elapsed_time(ev)``.

Where stamps are recorded (see ddp/step_hooks.py and ddp/comm_hook.py):
- compute-side stamps (forward, gradient ready, bucket launch, optimizer) on the
  current stream of the autograd/main thread, i.e. the compute stream;
- a bucket's completion inside the all-reduce future's ``then`` callback, whose
  current stream waits for the NCCL work, so the event completes when NCCL does.
  With the compiled capture the wrapper records its own events (ddp/compiled.py) and hands
  them over as host µs already: those pass through ``resolve`` as they are.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence


class CudaEventClock:
    kind = "cuda-event"
    # Resolve a step's events one step later: by then they have completed, so the
    # one synchronize per step almost never stalls the CPU's run-ahead.
    lag_steps = 1
    resolves = True

    def __init__(
        self,
        host_clock: Any,  # the host clock (clock.CpuClock): its host_us(); clock.make_clock builds this one
        event_factory: Callable[[], Any] | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        import torch

        self._host = host_clock
        self._new_event = event_factory or (lambda: torch.cuda.Event(enable_timing=True))
        self._synchronize = synchronize or torch.cuda.synchronize
        self.syncs = 0  # how many times resolve() blocked; tests check it is one per call
        self._synchronize()  # CPU-GPU sync: once, at start, to pin the anchor
        self._anchor = self._new_event()
        self._anchor.record()
        self._anchor.synchronize()  # CPU-GPU sync: the anchor has completed...
        self._anchor_host_us = self._host.host_us()  # ...so "now" is its host time

    def host_us(self) -> float:
        return self._host.host_us()

    def stamp(self) -> Any:
        ev = self._new_event()
        ev.record()  # on the current stream; no sync
        return ev

    def resolve(self, stamps: Sequence[Any]) -> list[float | None]:
        if any(s is not None and not isinstance(s, (int, float)) for s in stamps):
            self._synchronize()  # CPU-GPU sync: the single one for this batch of stamps
            self.syncs += 1
        # elapsed_time is in milliseconds
        return [
            None if ev is None else float(ev) if isinstance(ev, (int, float))
            else round(self._anchor_host_us + self._anchor.elapsed_time(ev) * 1000.0, 3)  # ns resolution
            for ev in stamps
        ]
