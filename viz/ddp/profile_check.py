"""The tracer checked against torch.profiler on the same run (``ddpscope run --profile``).

Both record every bucket all-reduce of the profiled steps: the tracer from DDP's
communication hook (launch) to the completion of its future; the profiler as the
collective's span (for gloo, ``gloo:all_reduce`` on gloo's worker thread, from when the
work starts running to when it ends; for NCCL, the kernel). The profile's Unix-clock
times are put on the tracer's clock with the offset each rank sampled when the profiler
started (``profile.unix_minus_host_us``: no fitting of one trace to the other), then on
rank 0's clock as the trace's own times are.

``ProfilerStep#k`` is the tracer's step ``k`` (the profiler records steps ``first_step``
.. ``first_step + steps - 1``, as the rank's trace says); the k-th all-reduce of a step (in start
order) is matched to the tracer's k-th bucket (in launch order).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sources.run_profile import on_trace_clock, profiled_steps
from ddpscope.viz.trace import RunTrace


def compute_profile_agreement(trace: RunTrace, profile: RunTrace) -> pd.DataFrame:
    """One row per rank, profiled step and bucket: the tracer's bytes, launch and
    completion, the profiler's bytes, start and end (µs, the trace's clock), and
    ``start_after_launch_ms`` (queueing before the collective ran), ``end_before_done_ms``
    (from the collective's end to the tracer seeing its completion). A step whose counts
    differ keeps its unmatched rows (NaN on the missing side)."""
    cols = ["rank", "step", "bucket", "tracer_bytes", "profile_bytes", "launch_us", "done_us", "profile_start_us",
            "profile_end_us", "start_after_launch_ms", "end_before_done_ms"]
    rows = []
    k = profile.kernels
    ar = k[(k["collective"] == "allreduce") & (k["step"] >= 0)]
    for rank, meta in sorted(trace.ranks.items()):
        host = on_trace_clock(meta, profile.ranks.get(rank))
        if host is None:
            continue
        mine = ar[ar["rank"] == rank]
        start = host(mine["ts_raw"].to_numpy(float))
        end = host(mine["ts_raw"].to_numpy(float) + mine["dur_raw"].to_numpy(float))
        pr = pd.DataFrame({"step": mine["step"].to_numpy(), "start": start, "end": end,
                           "bytes": mine["bytes"].to_numpy(float)}).sort_values(["step", "start"])
        tb = trace.buckets[trace.buckets["rank"] == rank].sort_values(["step", "launch_us"])
        recorded = profiled_steps(meta)
        for step in sorted(set(pr["step"]) | set(tb.loc[tb["step"].isin(recorded), "step"])):
            p, t = pr[pr["step"] == step], tb[tb["step"] == step]
            for i in range(max(len(p), len(t))):
                a = t.iloc[i] if i < len(t) else None
                b = p.iloc[i] if i < len(p) else None
                row = {"rank": rank, "step": int(step), "bucket": i,
                       "tracer_bytes": a["bytes"] if a is not None else np.nan,
                       "profile_bytes": b["bytes"] if b is not None else np.nan,
                       "launch_us": a["launch_us"] if a is not None else np.nan,
                       "done_us": a["done_us"] if a is not None else np.nan,
                       "profile_start_us": b["start"] if b is not None else np.nan,
                       "profile_end_us": b["end"] if b is not None else np.nan}
                row["start_after_launch_ms"] = (row["profile_start_us"] - row["launch_us"]) / 1e3
                row["end_before_done_ms"] = (row["done_us"] - row["profile_end_us"]) / 1e3
                rows.append(row)
    return pd.DataFrame(rows, columns=cols)
