"""Exposed communication of a sharded (FSDP2, DeepSpeed) run: one definition for every
table, figure and prediction. A collective's exposed time is the part of it during which its
rank computed nothing (no unit's compute segment overlaps it); a step's, a unit's or a
phase's is the time its collectives and the waits for them ran (their union: async
collectives side by side, a gather beside the wait for it, each counted once) that no
compute covered. Times in µs in, ms out.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.intervals import intersection, merge_intervals


def _overlap_us(starts: np.ndarray, ends: np.ndarray, a: float, b: float) -> float:
    return float(np.clip(np.minimum(ends, b) - np.maximum(starts, a), 0, None).sum())


def with_exposed(trace) -> pd.DataFrame:
    """The collectives table with ``ms`` and ``exposed_ms`` (no compute on that rank);
    made once per trace (every table, figure and prediction of a page reads it)."""
    if "sharded_exposed" not in trace.cache:
        trace.cache["sharded_exposed"] = _with_exposed(trace.shards)
    return trace.cache["sharded_exposed"]


def _with_exposed(sh) -> pd.DataFrame:
    colls = sh.colls.copy()
    colls["ms"] = (colls["end_us"] - colls["start_us"]) / 1e3
    exposed = []
    segs = {k: g for k, g in sh.segments.groupby(["rank", "step"])}
    for row in colls.itertuples():
        g = segs.get((row.rank, row.step))
        busy = 0.0 if g is None else _overlap_us(g["start_us"].to_numpy(), g["end_us"].to_numpy(),
                                                 row.start_us, row.end_us)
        exposed.append(max(0.0, (row.end_us - row.start_us) - busy) / 1e3)
    colls["exposed_ms"] = exposed
    return colls


EMPTY = pd.DataFrame({"start_us": [], "end_us": []})


def exposed_per_step(colls: pd.DataFrame, waits: pd.DataFrame, segments: pd.DataFrame,
                     by: tuple[str, ...] = ()) -> pd.Series:
    """Exposed communication (ms) per ``(*by, rank, step)`` that has ``colls`` or ``waits``:
    the time either ran (their union: async collectives side by side, a gather beside the
    wait for it, each counted once) that no compute ``segments`` of that rank and step
    (every unit's) covered. The steps table's definition; ``by=("unit",)`` gives it per unit
    (the unit table), ``("unit", "phase")`` per unit and phase (the predictions)."""
    key = [*by, "rank", "step"]
    c_by = dict(list(colls.groupby(key))) if len(colls) else {}
    w_by = dict(list(waits.groupby(key))) if len(waits) else {}
    g_by = dict(list(segments.groupby(["rank", "step"]))) if len(segments) else {}  # grouped once
    out = {}
    for k in sorted(set(c_by) | set(w_by)):
        c, w, g = c_by.get(k, EMPTY), w_by.get(k, EMPTY), g_by.get(k[-2:], EMPTY)
        comm = merge_intervals(np.r_[c["start_us"].to_numpy(float), w["start_us"].to_numpy(float)],
                               np.r_[c["end_us"].to_numpy(float), w["end_us"].to_numpy(float)])
        busy = merge_intervals(g["start_us"].to_numpy(float), g["end_us"].to_numpy(float))
        out[k] = (length(comm) - intersection(comm, busy)) / 1e3
    if not out:
        return pd.Series(dtype=float)
    return pd.Series(list(out.values()), index=pd.MultiIndex.from_tuples(list(out), names=key), dtype=float)


def length(merged: np.ndarray) -> float:
    """Total length of disjoint intervals (``merge_intervals``'s (n, 2) array)."""
    return float((merged[:, 1] - merged[:, 0]).sum())


def in_flight_ms(df: pd.DataFrame) -> float:
    """The time (ms) any of ``df``'s spans (start_us, end_us) was in flight: their union."""
    return length(merge_intervals(df["start_us"].to_numpy(float), df["end_us"].to_numpy(float))) / 1e3


def by_head(series: pd.Series, head: tuple) -> pd.Series:
    """``series``' rows whose index starts with ``head``, indexed by the rest (rank, step)."""
    if not len(series):
        return series
    mask = np.ones(len(series), bool)
    for level, value in enumerate(head):
        mask &= series.index.get_level_values(level) == value
    return series[mask].droplevel(list(range(len(head))))
