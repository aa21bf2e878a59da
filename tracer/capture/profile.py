"""``torch.profiler`` beside the tracer, on the same steps (``ddpscope run --profile``).

The profiler starts when the tracer attaches and steps with it: ``ProfilerStep#k`` is the
tracer's step ``k``. Its schedule warms up on step 0 (the profiler's own start-up, and
DDP's bucket rebuild, skew that one) and records steps 1..``steps``, then saves. Each
rank writes ``RUN/profile/rank-<r>.pt.trace.json.gz`` (Kineto JSON; atomically: a file
there is whole). The profiler stamps on the Unix clock (Kineto's ``baseTimeNanoseconds`` +
``ts``); the tracer on the host's monotonic clock: the offset between the two, sampled at
start, goes into the rank's trace (``profile.unix_minus_host_us``) so the two traces can
be laid on one clock without fitting one to the other.

It never takes training down: anything that fails stops the profiler with one line on
stderr; the trace goes on.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from ddpscope.tracer import format as fmt

PROFILE_DIR = fmt.PROFILE_DIR


def profile_file(rank: int) -> str:
    return f"rank-{rank}.pt.trace.json.gz"


def unix_minus_host_us(host_us: Callable[[], float], rounds: int = 5) -> float:
    """Unix time minus the host clock (µs), from the tightest of ``rounds`` back-to-back reads."""
    best = None
    for _ in range(rounds):
        a = host_us()
        unix = time.time_ns() / 1e3
        b = host_us()
        if best is None or b - a < best[0]:
            best = (b - a, unix - (a + b) / 2)
    return best[1]


class StepProfiler:
    """The profiler of one rank, stepped by the tracer's closed steps."""

    def __init__(self, out_dir: Path | str, rank: int, steps: int, cuda: bool, host_us: Callable[[], float],
                 set_meta: Callable[..., None]) -> None:
        self.path = Path(out_dir) / PROFILE_DIR / profile_file(rank)
        self.steps = steps
        self.rank = rank
        self._set_meta = set_meta
        activities = [torch.profiler.ProfilerActivity.CPU]
        if cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # record_shapes: a gloo collective's bytes come from its input shapes; profile_memory:
        # the allocator's [memory] events, an instrument beside the sharded memory samples
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=True, profile_memory=True,
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=steps, repeat=1),
            on_trace_ready=self._save)
        self.offset_us = unix_minus_host_us(host_us)
        self.running = False
        self.saved = False

    def start(self) -> "StepProfiler":
        self._prof.start()
        self.running = True
        self._set_meta(profile=self._meta("recording"))
        return self

    def after_step(self, step: int) -> None:
        """The tracer closed ``step`` (training thread): the profiler moves to the next."""
        if not self.running:
            return
        self._guard(self._prof.step)
        if step >= self.steps:  # step 0 warmed up; 1..steps recorded and saved
            self.stop()

    def stop(self) -> None:
        """Stop (and save what was recorded, if not yet saved). Once; never raises."""
        if not self.running:
            return
        self.running = False
        self._guard(self._prof.stop)

    def _save(self, prof) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp.json.gz")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            prof.export_chrome_trace(str(tmp))
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        self.saved = True
        self._set_meta(profile=self._meta("saved"))

    def _meta(self, status: str) -> dict:
        return {"file": f"{PROFILE_DIR}/{self.path.name}", "first_step": 1, "steps": self.steps,
                "unix_minus_host_us": self.offset_us, "status": status}

    def _guard(self, fn) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the profiler never stops training
            self.running = False
            print(f"ddpscope: rank {self.rank}: the profiler stopped ({type(e).__name__}: {e}); tracing goes on",
                  file=sys.stderr, flush=True)
