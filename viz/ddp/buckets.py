"""DDP's gradient buckets as the trace saw them."""

from __future__ import annotations

import pandas as pd

from ddpscope.viz.trace import RunTrace


def bus_bandwidth_factor(world_size: int) -> float:
    """busbw / algbw for a ring all-reduce: 2(N-1)/N (nccl-tests' definition)."""
    return 2.0 * (world_size - 1) / world_size if world_size > 0 else 0.0


def compute_bucket_events(trace: RunTrace) -> pd.DataFrame:
    """Every bucket all-reduce with its timing against its step: ``launch_offset_ms``
    (from the rank's backward start; a profiler trace's: from the ProfilerStep's start), ``duration_ms``, ``algbw_gbps`` (bytes / duration,
    GB/s decimal) and ``busbw_gbps`` (algbw x 2(N-1)/N)."""
    b = trace.buckets
    if len(b) == 0:
        return b.assign(launch_offset_ms=[], duration_ms=[], algbw_gbps=[], busbw_gbps=[])
    s = trace.steps.set_index(["rank", "step"])
    # a profiler trace has no backward span: offsets are from the step's start there
    bwd = s["backward_start_us" if "backward_start_us" in s else "start_us"].reindex(pd.MultiIndex.from_frame(b[["rank", "step"]])).to_numpy()
    dur_us = (b["done_us"] - b["launch_us"]).to_numpy()
    algbw = b["bytes"].to_numpy() / (dur_us * 1e-6) / 1e9
    return b.assign(
        launch_offset_ms=(b["launch_us"].to_numpy() - bwd) / 1e3,
        duration_ms=dur_us / 1e3,
        algbw_gbps=algbw,
        busbw_gbps=algbw * bus_bandwidth_factor(trace.world_size),
    )


def compute_bucket_table(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """One row per bucket index: MiB, parameters, and medians over steps and ranks of the
    launch offset from backward start (ms), all-reduce duration (ms) and bandwidths (GB/s)."""
    cols = ["bucket", "mib", "num_params", "launch_offset_ms", "duration_ms", "algbw_gbps", "busbw_gbps", "params"]
    ev = compute_bucket_events(trace)
    if len(ev) == 0:
        return pd.DataFrame(columns=cols)
    steps = trace.steps.set_index(["rank", "step"])
    keep = ~steps["incomplete"]
    if not include_warmup:
        keep &= ~steps["warmup"]
    ok = keep.reindex(pd.MultiIndex.from_frame(ev[["rank", "step"]])).fillna(False).to_numpy(bool)
    ev = ev[ok & ~ev["incomplete"].to_numpy(bool)]
    if len(ev) == 0:
        return pd.DataFrame(columns=cols)
    last = ev[ev["step"] == ev["step"].max()].drop_duplicates("bucket").set_index("bucket")
    med = ev.groupby("bucket")[["launch_offset_ms", "duration_ms", "algbw_gbps", "busbw_gbps"]].median()
    out = med.join(last[["bytes", "num_params", "params"]])
    out.insert(0, "mib", out.pop("bytes") / 2**20)
    out.insert(1, "num_params", out.pop("num_params"))
    # a profiler trace names no parameter; a bucket seen only in an earlier step (a repeated
    # kernel) has none in the last step's rows
    out["params"] = [", ".join(p) if isinstance(p, (list, tuple)) else "" for p in out["params"]]
    return out.reset_index()[cols]
