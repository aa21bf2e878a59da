"""A traced run's own torch.profiler traces (``ddpscope run --profile``), on its clock.

The profile is written beside the trace (``RUN/profile/``), one Kineto file per rank.
Its times are Unix µs from Kineto's base time; each rank sampled, when its profiler
started, the Unix clock against its own host clock (``profile.unix_minus_host_us`` in its
metadata), so a profile time goes onto the trace's axis without fitting one trace to the
other: Unix µs -> the rank's host clock -> rank 0's clock (``clock_alignment``), as the
trace's own times do. The comparisons of the tracer against it live beside what they
compare (``viz.ddp.profile_check``: DDP's buckets; ``viz.sharded.profile_check``: FSDP2's
collectives).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

from ddpscope.tracer import format as fmt
from ddpscope.viz.run_files import clock_alignment
from ddpscope.viz.sources.kineto import load_kineto
from ddpscope.viz.sources.kineto_file import FILE_RE
from ddpscope.viz.trace import RunTrace, TraceError


def profile_folder(trace: RunTrace) -> Path | None:
    """The run's profiler traces (``RUN/profile/``), or None if it was not profiled."""
    folder = Path(trace.path) / fmt.PROFILE_DIR
    if folder.is_dir() and any(FILE_RE.match(p.name) for p in folder.iterdir()):
        return folder
    return None


def load_run_profile(trace: RunTrace) -> RunTrace:
    folder = profile_folder(trace)
    if folder is None:
        raise TraceError(f"{trace.path.name} has no profiler traces (trace it with `ddpscope run --profile`)")
    return load_kineto(folder)


def on_trace_clock(meta: dict, profile_meta: dict) -> Callable[[np.ndarray], np.ndarray] | None:
    """Raw profile times of a rank (``ts_raw``, µs from Kineto's base time) -> µs on the
    trace's clock; None when the rank was not profiled (``meta``: the rank's trace
    metadata; ``profile_meta``: its profile's, from ``load_run_profile``)."""
    prof = meta.get("profile") or {}
    if not prof or profile_meta is None or "unix_minus_host_us" not in prof:
        return None
    align = clock_alignment(meta)
    shift = (profile_meta.get("base_time_ns") or 0) / 1e3 - prof["unix_minus_host_us"]
    return lambda t: align(np.asarray(t, float) + shift)  # clock_alignment works on arrays


def profiled_steps(meta: dict) -> range:
    """The steps the rank's profiler recorded (``ProfilerStep#k`` is the tracer's step k)."""
    prof = meta.get("profile") or {}
    first = int(prof.get("first_step", 0))
    return range(first, first + int(prof.get("steps", 0)))
