"""Where this rank is now: a small file the launcher's hang watchdog reads.

A thread of its own writes ``RUN/live/rank-<r>.json`` (atomically) twice a second: the
step, the phase (forward, backward, waiting for the all-reduces, optimizer, between
steps), the buckets launched this step and those still in flight, the pid, the host and
the Unix time of writing. It reads the recorder's state without locks (a snapshot may be a
moment old; it is only read to say where a rank stopped). The thread keeps writing while
the training thread is stuck in Python; a stopped process (SIGSTOP) writes nothing, and
the file's time says since when.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from ddpscope.tracer import format as fmt
from ddpscope.tracer.writer import write_bytes_atomic

INTERVAL_S = 0.5


def ddp_position(recorder) -> dict:
    """The recorder's open step and phase, as JSON-able fields."""
    cur = recorder.current
    if cur is None:
        return {"step": recorder.next_step, "steps_done": recorder.next_step, "phase": "between steps",
                "buckets_launched": [], "buckets_in_flight": [], "activity": [recorder.next_step]}
    source = recorder.bucket_source
    if source is not None and not cur.buckets:  # compiled capture: the all-reduces are counted in C++
        n, done = source.progress()
        launched, in_flight = list(range(n)), list(range(done, n))  # gloo finishes them in order
    else:
        launched = [b.index for b in list(cur.buckets)]
        in_flight = [b.index for b in list(cur.buckets) if b.done is None]
    last = cur.passes[-1] if cur.passes else None
    if cur.optimizer is not None and cur.optimizer[1] is None:
        phase = "optimizer"
    elif last is None or last.forward[1] is None:
        phase = "forward"
    elif last.backward_start is None:
        phase = "after forward"
    elif last.backward_end is None:
        phase = "backward"
    elif last.sync_end is None and in_flight:
        phase = "waiting for the all-reduces"
    else:
        phase = "after backward"
    # anything the training thread records changes this: a rank whose activity stays the
    # same is not moving (evaluation forwards through DDP count as moving)
    activity = [cur.step, len(cur.passes), len(cur.grads), len(launched), len(launched) - len(in_flight),
                cur.optimizer is not None]
    return {"step": cur.step, "steps_done": cur.step, "phase": phase, "buckets_launched": launched,
            "buckets_in_flight": in_flight, "activity": activity}


class LiveFile:
    """Writes this rank's position until ``close(status)``; never raises into training."""

    def __init__(self, out_dir: Path | str, rank: int, recorder, interval_s: float = INTERVAL_S,
                 position: Callable[[], dict] | None = None, tick: Callable[[], None] | None = None) -> None:
        """``position``: where the rank is, as JSON-able fields (default: a DDP recorder's).
        ``tick``: called on this thread before each write (a recorder's ``flush_held``)."""
        self.path = Path(out_dir) / fmt.live_file(rank)
        self.rank = rank
        self.recorder = recorder
        self._position = position or (lambda: ddp_position(recorder))
        self._tick = tick
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._status = "running"
        self.host = socket.gethostname()  # the launcher signals only pids of its own host
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread = threading.Thread(target=self._loop, name="ddpscope-live", daemon=True)
        self._thread.start()

    def close(self, status: str) -> None:
        self._status = status
        self._stop.set()
        self._thread.join(timeout=5)
        self._write()

    def rewrite(self, status: str) -> None:
        """After ``close``: say another final status (the trace could not be finished)."""
        self._status = status
        self._write()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._tick is not None:
                try:
                    self._tick()
                except Exception as e:  # noqa: BLE001 - said once; the heartbeat goes on
                    print(f"ddpscope: rank {self.rank}: could not write the steps held ({type(e).__name__}: {e})",
                          file=sys.stderr, flush=True)
                    self._tick = None
            self._write()

    def _write(self) -> None:
        try:
            state = {"rank": self.rank, "pid": os.getpid(), "host": self.host, "time_unix": time.time(),
                     "status": self._status,
                     **self._position()}
            write_bytes_atomic(self.path, [json.dumps(state).encode()])
        except Exception:  # noqa: BLE001 - a heartbeat that cannot be written is not worth a training run
            pass
