"""Overlap of communication and compute read from GPU kernels (profiler traces), with
Holistic Trace Analysis' definitions, so the figures can be checked against HTA's:

- kernels counted: those launched before the last ``ProfilerStep`` began (HTA leaves the
  last step out), classed by HTA 0.5.0's kernel names; a file HTA reads with a float64
  ``ts`` column (any ts written as a float, whole ones too, or an event without ts) has
  its times rounded as HTA rounds them (start up, end down), unless
  ``HTA_DISABLE_NS_ROUNDING=1``;
- kernel time: first kernel start to last kernel end; idle: kernel time minus the union
  of all kernels; compute: the union of compute kernels; non-compute: the rest;
- overlap %: the intersection of the union of compute kernels with the union of
  communication kernels, over the union of communication kernels.

Per step, ``compute_kernel_step_breakdown`` gives the same columns as
``viz.ddp.overlap.compute_step_breakdown`` does for ddpscope's traces (ms).
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

from ddpscope.viz.intervals import covered, intersection, merge_intervals
from ddpscope.viz.trace import RunTrace

HTA_DISABLE_ROUNDING = "HTA_DISABLE_NS_ROUNDING"  # HTA's own switch: "1" turns its rounding off


def _length(merged: np.ndarray) -> float:
    return float((merged[:, 1] - merged[:, 0]).sum()) if len(merged) else 0.0


def hta_rounds(trace: RunTrace, rank: int) -> bool:
    """HTA 0.5.0 rounds this rank's times to whole µs: its ``ts`` column is float64 (a ts
    written as a float, ``1000.0`` too, or an event without one: ``viz.sources.kineto_file``)
    and ``HTA_DISABLE_NS_ROUNDING`` is not ``"1"`` (read as HTA reads it)."""
    return bool(trace.ranks.get(int(rank), {}).get("hta_rounds")) and os.environ.get(HTA_DISABLE_ROUNDING) != "1"


def _overlap(ts: np.ndarray, end: np.ndarray, kind: np.ndarray) -> dict[str, float]:
    every = merge_intervals(ts, end)
    comp = merge_intervals(ts[kind == "compute"], end[kind == "compute"])
    comm = merge_intervals(ts[kind == "comm"], end[kind == "comm"])
    span = float(every[-1, 1] - every[0, 0]) if len(every) else 0.0
    return {"span": span, "idle": span - _length(every), "compute": _length(comp), "comm": _length(comm),
            "overlap": intersection(comp, comm)}


def compute_hta_breakdown(trace: RunTrace) -> pd.DataFrame:
    """Per rank, as HTA 0.5.0's ``get_comm_comp_overlap`` and ``get_temporal_breakdown``
    compute them, rule for rule: kernels classed by HTA's names (``hta_kind``), starts
    rounded up and ends (``ts + dur`` on the file's clock) down to whole µs where HTA
    rounds (``hta_rounds``), else ends taken from the rank's first kernel start, as HTA
    does after subtracting it: comp_comm_overlap_pct, idle_pct, compute_pct,
    non_compute_pct and the times behind them (µs): kernel_us, idle_us, compute_us,
    comm_us, overlap_us. Beside them ddpscope's own overlap (``ddpscope_overlap_pct``:
    ddpscope's classes, ns times unrounded) and ``hta_rounded``."""
    cols = ["rank", "comp_comm_overlap_pct", "idle_pct", "compute_pct", "non_compute_pct", "kernel_us", "idle_us",
            "compute_us", "comm_us", "overlap_us", "ddpscope_overlap_pct", "hta_rounded"]
    k = trace.kernels
    if len(k) == 0:
        return pd.DataFrame(columns=cols)
    out = []
    for rank, g in k[k["hta"]].groupby("rank", sort=True):
        raw_ts, raw_dur = g["ts_raw"].to_numpy(float), g["dur_raw"].to_numpy(float)
        t0 = raw_ts.min()
        rel_ts = raw_ts - t0  # exact (Sterbenz); the end then keeps ns: at ~1.7e15 µs float64 steps by 0.25 µs
        rounded = hta_rounds(trace, rank)
        if rounded:
            ts, end = np.ceil(raw_ts), np.floor(raw_ts + raw_dur)
        else:
            ts, end = rel_ts, rel_ts + raw_dur
        kinds = g["hta_kind"] if "hta_kind" in g else g["kind"]
        h = _overlap(ts, end, np.asarray(kinds, dtype=object))
        own = _overlap(rel_ts, rel_ts + raw_dur, np.asarray(g["kind"], dtype=object))
        span = h["span"]
        pct = (lambda x: 100.0 * x / span) if span > 0 else (lambda x: np.nan)
        out.append({"rank": int(rank),
                    "comp_comm_overlap_pct": 100.0 * h["overlap"] / h["comm"] if h["comm"] else np.nan,
                    "idle_pct": pct(h["idle"]), "compute_pct": pct(h["compute"]),
                    "non_compute_pct": pct(span - h["compute"] - h["idle"]), "kernel_us": span, "idle_us": h["idle"],
                    "compute_us": h["compute"], "comm_us": h["comm"], "overlap_us": h["overlap"],
                    "ddpscope_overlap_pct": 100.0 * own["overlap"] / own["comm"] if own["comm"] else np.nan,
                    "hta_rounded": rounded})
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
