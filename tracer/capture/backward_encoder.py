"""Finished steps' events built and encoded while the next backward runs, on a thread of
their own.

Building a step's Chrome trace events and encoding them (``ddp/events.py``, the writer's
msgspec encoder and summary fold) is the largest piece of the tracer's host time left on
a launch-bound model: 85 of 132 µs a step on the CPU benchmark model, ~210 of ~660 µs on
an H200 host (docs/cuda.md). Done between steps, on the training thread, it delays the
next step's launches by as much. Inside backward the training thread holds no GIL
(``run_backward`` releases it while the autograd engine runs, on CPU and CUDA alike), so
the same work done then, on another thread, overlaps the user's step instead of adding
to it: ``BackwardEncoder`` queues each hand-over (a lazy iterable of events: nothing is
built on the training thread) and works the queue when backward begins.

It needs a core of its own while backward runs. On a GPU, backward is the autograd
engine's device thread launching kernels while the training thread waits, and a host
usually has several cores a rank. Training on the CPU, the job's own threads (backward,
the intra-op pool, gloo's) take the cores: on the 2-core CI machine, the benchmark
model's backward got 111-169 µs slower beside the encoder, for 75-110 µs taken off
closing the step (a worker that burnt the same CPU without the GIL slowed it as much; one
that slept, not: the cores, not the GIL). Hence ``worth_it``: the device path, with cores
to spare. A Python piece of backward (a hook of the script's, DDP's ``_DDPSink``) waits
for the GIL while the encoder holds it, at most what encoding those steps takes (what it
cost between steps before); the DDP tracer uses it only with the compiled capture (no
Python hook of ours runs in backward after the first). Order is kept (one queue, one
worker at a time); a script with no backward (a queue not worked since the last
hand-over) has it worked at once. An error while building (ours) is raised on the
training thread at the next hand-over, where the tracer's hook guard stops tracing as it
does for any of its errors.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable

from ddpscope.tracer.writer import TraceWriter

#: cores a rank needs for the encoder to overlap backward: the waiting training thread's,
#: the device thread's that launches backward, the encoder's
CORES_PER_RANK = 3


def worth_it(device_type: str) -> bool:
    """Whether steps should be encoded beside backward on a rank timing ``device_type``:
    a device's (not the CPU's: there backward's threads take the cores) with at least
    ``CORES_PER_RANK`` cores for each rank of this node (``LOCAL_WORLD_SIZE``)."""
    if device_type == "cpu":
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return cores >= CORES_PER_RANK * local


class BackwardEncoder:
    """Hands ``writer`` finished events built on a thread of its own while backward runs.

    ``add`` (training thread) queues; ``backward_began`` (any thread) starts the work;
    ``drain`` works what is left on the caller's thread and ends the worker (call it before
    the writer's ``close``). Thread-safe; ``add`` after ``drain`` works on the caller's thread.
    """

    def __init__(self, writer: TraceWriter) -> None:
        self._writer = writer
        self._queue: list[Iterable] = []  # guarded by _cond
        self._go = False
        self._stopped = False
        self._error: BaseException | None = None
        self.beside_backward = 0  # hand-overs built and encoded on the worker
        self.between_steps = 0  # ... on the training thread (no backward came; the last ones)
        self._cond = threading.Condition()
        self._working = threading.Lock()  # one builder at a time: the events' builder keeps state
        self._thread = threading.Thread(target=self._loop, name="ddpscope-encoder", daemon=True)
        self._thread.start()

    def add(self, events: Iterable) -> None:
        """Queue finished events (lazy: built on the worker). Raises the worker's error, if
        building earlier events failed."""
        self._raise_error()
        with self._cond:
            if self._stopped:  # drained (closing): nothing runs backward any more
                stale, self._queue = self._queue, []
            else:
                # queued before and not worked since: no backward came (a script without one)
                if self._queue:
                    self._go = True
                    self._cond.notify()
                self._queue.append(events)
                return
        self._work([*stale, events])
        self.between_steps += len(stale) + 1

    def backward_began(self) -> None:
        """The training thread is inside backward (no GIL held by it): build and encode now."""
        if self._queue:  # read without the lock: a hand-over racing this one is worked at the next
            with self._cond:
                self._go = True
                self._cond.notify()

    def drain(self) -> None:
        """Build and encode what is queued, on this thread, after the worker's current batch;
        end the worker. Raises the worker's error (what was queued after it is dropped)."""
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join()
        self._raise_error()
        with self._cond:
            left, self._queue = self._queue, []
        try:  # said as the worker says it: which thread built the failing step is chance
            self._work(left)
        except Exception as e:
            raise _failed(e) from e
        self.between_steps += len(left)

    def facts(self) -> dict:
        """For the rank's metadata: hand-overs (a step or a few) encoded beside backward and
        between steps."""
        return {"encoded_beside_backward": self.beside_backward, "encoded_between_steps": self.between_steps}

    def _raise_error(self) -> None:
        if self._error is not None:
            raise _failed(self._error) from self._error

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._go or self._stopped):
                    self._cond.wait()
                if self._stopped:
                    return  # drain() works what is left, in order
                self._go = False
                items, self._queue = self._queue, []
            try:
                self._work(items)
                self.beside_backward += len(items)
            except BaseException as e:  # noqa: BLE001 - said on the training thread (add, drain)
                self._error = e
                with self._cond:
                    self._queue.clear()
                return

    def _work(self, items: list[Iterable]) -> None:
        with self._working:
            for events in items:
                self._writer.add(events)


def _failed(e: BaseException) -> RuntimeError:
    """The error a failure to build a step's events is raised as, on whichever thread built it."""
    return RuntimeError(f"building a step's events failed ({type(e).__name__}: {e})")
