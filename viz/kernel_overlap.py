"""Overlap of communication and compute read from GPU kernels (profiler traces), with
Holistic Trace Analysis' definitions, so the figures can be checked against HTA's:

- kernels counted: those launched before the last ``ProfilerStep`` began (HTA leaves the
  last step out); timestamps with ns resolution are rounded to whole µs as HTA rounds them
  (start up, end down);
- kernel time: first kernel start to last kernel end; idle: kernel time minus the union
  of all kernels; compute: the union of compute kernels; non-compute: the rest;
- overlap %: the intersection of the union of compute kernels with the union of
  communication kernels, over the union of communication kernels.

Per step, ``compute_kernel_step_breakdown`` gives the same columns as
``viz.overlap.compute_step_breakdown`` does for ddpscope's traces (ms).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.overlap import covered, merge_intervals
from ddpscope.viz.trace import RunTrace


def intersection(a: np.ndarray, b: np.ndarray) -> float:
    """Length of the intersection of two sets of disjoint sorted intervals ((n, 2) arrays)."""
    if len(a) == 0 or len(b) == 0:
        return 0.0
    # every boundary of both sets; the length between boundaries covered by both
    edges = np.unique(np.concatenate([a.ravel(), b.ravel()]))
    mid = (edges[:-1] + edges[1:]) / 2

    def inside(m, iv):
        i = np.searchsorted(iv[:, 0], m, side="right") - 1
        return (i >= 0) & (m < iv[np.clip(i, 0, None), 1])

    both = inside(mid, a) & inside(mid, b)
    return float(np.diff(edges)[both].sum())


def _length(merged: np.ndarray) -> float:
    return float((merged[:, 1] - merged[:, 0]).sum()) if len(merged) else 0.0


def compute_hta_breakdown(trace: RunTrace) -> pd.DataFrame:
    """Per rank, as HTA's ``get_comm_comp_overlap`` and ``get_temporal_breakdown``:
    comp_comm_overlap_pct, idle_pct, compute_pct, non_compute_pct, and the times behind
    them (µs): kernel_us, idle_us, compute_us, comm_us, overlap_us."""
    cols = ["rank", "comp_comm_overlap_pct", "idle_pct", "compute_pct", "non_compute_pct", "kernel_us", "idle_us",
            "compute_us", "comm_us", "overlap_us"]
    k = trace.kernels
    if len(k) == 0:
        return pd.DataFrame(columns=cols)
    out = []
    for rank, g in k[k["hta"]].groupby("rank", sort=True):
        ts, end = g["ts_raw"].to_numpy(float), g["ts_raw"].to_numpy(float) + g["dur_raw"].to_numpy(float)
        if trace.ranks.get(int(rank), {}).get("float_times"):
            ts, end = np.ceil(ts), np.floor(end)
        kind = g["kind"].to_numpy()
        every = merge_intervals(ts, end)
        comp = merge_intervals(ts[kind == "compute"], end[kind == "compute"])
        comm = merge_intervals(ts[kind == "comm"], end[kind == "comm"])
        span = float(every[-1, 1] - every[0, 0]) if len(every) else 0.0
        idle = span - _length(every)
        compute, comm_t = _length(comp), _length(comm)
        overlap = intersection(comp, comm)
        pct = (lambda x: 100.0 * x / span) if span > 0 else (lambda x: np.nan)
        out.append({"rank": int(rank), "comp_comm_overlap_pct": 100.0 * overlap / comm_t if comm_t else np.nan,
                    "idle_pct": pct(idle), "compute_pct": pct(compute), "non_compute_pct": pct(span - compute - idle),
                    "kernel_us": span, "idle_us": idle, "compute_us": compute, "comm_us": comm_t,
                    "overlap_us": overlap})
    return pd.DataFrame(out, columns=cols)


def compute_kernel_step_breakdown(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """Per rank and ProfilerStep (ms): step (its CPU span), compute (union of compute
    kernels launched in the step), communication (union of its communication kernels),
    overlapped (communication while compute ran), exposed (communication while no compute
    ran), overlap %, and the step's all-reduces (``buckets``). Forward, backward and
    optimizer are not separable in a kernel trace: NaN."""
    cols = ["rank", "step", "warmup", "step_ms", "forward_ms", "backward_ms", "optimizer_ms", "comm_ms",
            "overlapped_ms", "exposed_ms", "overlap_pct", "buckets", "micro_batches", "compute_ms"]
    steps = trace.steps
    if len(steps) == 0:
        return pd.DataFrame(columns=cols)
    k = trace.kernels
    groups = {key: g for key, g in k[k["step"] >= 0].groupby(["rank", "step"])} if len(k) else {}
    nb = trace.buckets.groupby(["rank", "step"]).size().to_dict() if len(trace.buckets) else {}
    out = []
    for s in steps.itertuples(index=False):
        g = groups.get((s.rank, s.step))
        if g is None:
            comp = comm = np.empty((0, 2))
        else:
            kind = g["kind"].to_numpy()
            st, en = g["start_us"].to_numpy(float), g["end_us"].to_numpy(float)
            comp = merge_intervals(st[kind == "compute"], en[kind == "compute"])
            comm = merge_intervals(st[kind == "comm"], en[kind == "comm"])
        comm_t, overlapped = covered(comm, -np.inf, np.inf), intersection(comp, comm)
        out.append({"rank": s.rank, "step": s.step, "warmup": False, "step_ms": (s.end_us - s.start_us) / 1e3,
                    "forward_ms": np.nan, "backward_ms": np.nan, "optimizer_ms": np.nan, "comm_ms": comm_t / 1e3,
                    "overlapped_ms": overlapped / 1e3, "exposed_ms": (comm_t - overlapped) / 1e3,
                    "overlap_pct": 100.0 * overlapped / comm_t if comm_t > 0 else np.nan,
                    "buckets": nb.get((s.rank, s.step), 0), "micro_batches": 1, "compute_ms": _length(comp) / 1e3})
    return pd.DataFrame(out, columns=cols)
