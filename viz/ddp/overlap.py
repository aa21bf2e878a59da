"""How much of each step's all-reduce the backward pass hid: per-step, per-rank metrics.

Definitions (times in ms):
- communication time: the union of the step's bucket all-reduce intervals
  [launch, completion] (busy time, overlapping buckets counted once);
- overlapped: the part of it inside backward compute [backward start, backward end]
  (under gradient accumulation, inside any of the step's backward passes);
- exposed: the rest, i.e. all-reduce time after backward compute ended;
- overlap %: overlapped / communication time, as Holistic Trace Analysis defines it.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.trace import RunTrace, fill_comm_columns


def _steps(trace: RunTrace, include_warmup: bool) -> pd.DataFrame:
    steps = trace.steps
    if len(steps) == 0:
        return steps
    keep = ~steps["incomplete"]
    if not include_warmup:
        keep &= ~steps["warmup"]
    return steps[keep]


def compute_step_breakdown(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """Per rank and step: step, forward, backward compute, optimizer, communication,
    overlapped and exposed communication (ms) and overlap % (warm-up steps left out
    unless ``include_warmup``; unfinished steps always left out). Forward and backward
    are summed over the step's micro-batches (``micro_batches`` of them). It reads the
    steps table only (its communication columns: ``tracer.step_summary``), so it serves
    a run read from its summaries. A profiler trace's steps come from its kernels
    (``viz.ddp.kernel_overlap``), in the same columns."""
    if trace.source != "ddpscope":
        from ddpscope.viz.ddp.kernel_overlap import compute_kernel_step_breakdown  # it builds on this module

        return compute_kernel_step_breakdown(trace, include_warmup)
    steps = _steps(trace, include_warmup)
    cols = ["rank", "step", "warmup", "step_ms", "forward_ms", "backward_ms", "optimizer_ms",
            "comm_ms", "overlapped_ms", "exposed_ms", "overlap_pct", "buckets", "micro_batches"]
    if len(steps) == 0:
        return pd.DataFrame(columns=cols)
    s = fill_comm_columns(steps, trace.buckets, trace.passes)
    comm, overlapped = s["comm_us"].to_numpy(float), s["overlapped_us"].to_numpy(float)
    micro = s["micro_batches"].fillna(0).to_numpy()

    def total_ms(phase: str) -> np.ndarray:
        """A step's ``phase`` compute summed over its passes; the span if not recorded."""
        span = (s[f"{phase}_end_us"] - s[f"{phase}_start_us"]).to_numpy(float)
        total = s[f"{phase}_us"].to_numpy(float)
        return np.where(np.isfinite(total) & (micro > 0), total, span) / 1e3

    return pd.DataFrame({
        "rank": s["rank"].to_numpy(), "step": s["step"].to_numpy(), "warmup": s["warmup"].to_numpy(),
        "step_ms": (s["end_us"] - s["start_us"]).to_numpy(float) / 1e3,
        "forward_ms": total_ms("forward"), "backward_ms": total_ms("backward"),
        "optimizer_ms": (s["optimizer_end_us"] - s["optimizer_start_us"]).to_numpy(float) / 1e3,
        "comm_ms": comm / 1e3, "overlapped_ms": overlapped / 1e3, "exposed_ms": (comm - overlapped) / 1e3,
        "overlap_pct": np.where(comm > 0, 100.0 * overlapped / np.where(comm > 0, comm, 1.0), np.nan),
        "buckets": s["num_buckets"].fillna(0).astype(int).to_numpy(),
        "micro_batches": np.where(micro > 0, micro, 1).astype(int),
    }, columns=cols)


def compute_ddp_logging_view(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """The four durations DDP's own runtime logging reports, derived from the trace with
    DDP's definitions (ms): ``forward_compute`` (forward start -> forward end, where DDP
    starts its backward clock), ``backward_compute`` (forward end -> end of backward
    compute), ``backward_comm`` (first bucket launch -> DDP has written every averaged
    gradient, i.e. the end of the grad-sync span; the last bucket completion if absent)
    and ``backward_compute_comm_overlap`` (first bucket launch -> end of backward compute)."""
    steps = _steps(trace, include_warmup) if trace.source == "ddpscope" else trace.steps.iloc[:0]
    cols = ["rank", "step", "forward_compute_ms", "backward_compute_ms", "backward_comm_ms",
            "backward_compute_comm_overlap_ms"]
    if len(steps) == 0 or len(trace.buckets) == 0:
        return pd.DataFrame(columns=cols)
    b = trace.buckets.groupby(["rank", "step"]).agg(first_launch=("launch_us", "min"), last_done=("done_us", "max"))
    df = steps.join(b, on=["rank", "step"], how="inner")
    comm_end = df["sync_end_us"].fillna(df["last_done"]) if "sync_end_us" in df else df["last_done"]
    return pd.DataFrame({
        "rank": df["rank"], "step": df["step"],
        "forward_compute_ms": (df["forward_end_us"] - df["forward_start_us"]) / 1e3,
        "backward_compute_ms": (df["backward_end_us"] - df["forward_end_us"]) / 1e3,
        "backward_comm_ms": (comm_end - df["first_launch"]) / 1e3,
        "backward_compute_comm_overlap_ms": (df["backward_end_us"] - df["first_launch"]) / 1e3,
    }).reset_index(drop=True)


def compute_rank_medians(trace: RunTrace) -> pd.DataFrame:
    """Per rank: medians over non-warm-up, finished steps of ``compute_step_breakdown``."""
    b = compute_step_breakdown(trace)
    cols = ["step_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms", "overlapped_ms", "exposed_ms",
            "overlap_pct"]
    if "compute_ms" in b:  # a profiler trace: compute kernels, not forward / backward / optimizer
        cols = ["step_ms", "compute_ms", "comm_ms", "overlapped_ms", "exposed_ms", "overlap_pct"]
    if len(b) == 0:
        return pd.DataFrame(columns=["rank", "steps", *cols])
    med = b.groupby("rank")[cols].median()
    med.insert(0, "steps", b.groupby("rank").size())
    return med.reset_index()
