"""Interval arithmetic on time spans (µs or ms, any one unit): unions, coverage and
intersections, vectorised with numpy. Shared by the overlap metrics (ddpscope's and the
profiler kernels'), the timelines and the what-if."""

from __future__ import annotations

import numpy as np
import pandas as pd


def merge_sorted_runs(first: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Union of intervals within groups, vectorised. The intervals are sorted by group,
    then start; ``first`` marks each group's first one. Returns ``(idx, merged_ends)``:
    merged interval k starts at ``starts[idx[k]]`` (and belongs to that row's group) and
    ends at ``merged_ends[k]``."""
    first = np.asarray(first, bool)
    if first[1:].any():
        reach = pd.Series(ends).groupby(np.cumsum(first) - 1).cummax().to_numpy()  # running end, per group
    else:  # one group (merge_intervals: per rank and step, thousands of calls a page): numpy, not a groupby
        e = np.asarray(ends, float)
        reach = np.fmax.accumulate(e)  # as pandas' cummax: a NaN end is skipped, and stays NaN in place
        reach[np.isnan(e)] = np.nan  # (fmax is NaN only where every end so far is, this one too)
    new = first | np.r_[True, starts[1:] > reach[:-1]]  # a gap before this interval starts a new run
    idx = np.flatnonzero(new)
    return idx, np.maximum.reduceat(ends, idx)


def merge_intervals(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Union of intervals as an (n, 2) array of disjoint, sorted [start, end]."""
    if len(starts) == 0:
        return np.empty((0, 2))
    order = np.argsort(starts, kind="stable")
    s, e = np.asarray(starts, float)[order], np.asarray(ends, float)[order]
    idx, merged_ends = merge_sorted_runs(np.r_[True, np.zeros(len(s) - 1, bool)], s, e)
    return np.column_stack([s[idx], merged_ends])


def covered(merged: np.ndarray, lo: float, hi: float) -> float:
    """Length of ``merged`` (disjoint intervals) inside [lo, hi]."""
    if len(merged) == 0 or hi <= lo:
        return 0.0
    return float(np.clip(np.minimum(merged[:, 1], hi) - np.maximum(merged[:, 0], lo), 0, None).sum())


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
