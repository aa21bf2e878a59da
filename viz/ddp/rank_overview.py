"""Every rank at once: ranks x steps of step time, exposed communication, backward
compute and the first bucket's launch delay, their spread per step, and the ranks that
hold the others back, ranked with their figures.

For one rank's Gantt the Timeline shows a few ranks; this overview is what tells which
ranks to show. It reads the per-step tables only (never per-event ones), so it serves a
1,024-rank run as well as a 2-rank one, and profiler traces as ddpscope's (their steps
and all-reduces come in the same tables). Times in ms.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ddpscope.viz.ddp.overlap import compute_step_breakdown
from ddpscope.viz.layout import LEGEND_BELOW
from ddpscope.viz.trace import RunTrace, fill_comm_columns

#: the overview's metrics: column -> what it is
METRICS = {
    "step_ms": "step time (ms)",
    "exposed_ms": "exposed communication (ms)",
    "backward_ms": "backward compute (ms)",
    "launch_delay_ms": "first bucket's launch delay (ms)",
}
OVERVIEW_COLUMNS = ["rank", "step", "step_ms", "exposed_ms", "backward_ms", "compute_ms", "launch_delay_ms"]


def compute_rank_overview(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """Per rank and step: step_ms, exposed_ms, backward_ms, compute_ms (forward and
    backward; a profiler trace's compute kernels) and launch_delay_ms: how long after the
    first rank this rank launched its first all-reduce of the step (0 for the first; NaN
    when the step launched none)."""
    b = compute_step_breakdown(trace, include_warmup)
    if len(b) == 0:
        return pd.DataFrame(columns=OVERVIEW_COLUMNS)
    out = b[["rank", "step", "step_ms", "exposed_ms", "backward_ms"]].copy()
    if "compute_ms" in b and b["compute_ms"].notna().any():  # a profiler trace: compute kernels
        out["compute_ms"] = b["compute_ms"]
    else:
        out["compute_ms"] = b["forward_ms"].fillna(0) + b["backward_ms"].fillna(0)
    if trace.source == "ddpscope":  # the steps table has each step's first launch (a summary's too)
        first = fill_comm_columns(trace.steps, trace.buckets, trace.passes)[["rank", "step", "first_launch_us"]]
    elif len(trace.buckets):
        first = trace.buckets.groupby(["rank", "step"])["launch_us"].min().rename("first_launch_us").reset_index()
    else:
        first = pd.DataFrame(columns=["rank", "step", "first_launch_us"])
    first = first.dropna(subset=["first_launch_us"]).astype({"first_launch_us": float})
    first["launch_delay_ms"] = (first["first_launch_us"]
                                - first.groupby("step")["first_launch_us"].transform("min")) / 1e3
    out = out.merge(first[["rank", "step", "launch_delay_ms"]], on=["rank", "step"], how="left")
    return out[OVERVIEW_COLUMNS].sort_values(["rank", "step"]).reset_index(drop=True)


def compute_slow_ranks(overview: pd.DataFrame, top: int | None = None) -> pd.DataFrame:
    """Per rank (medians over its steps), the ranks that hold the others back first:
    launch_delay_ms (how late it arrives at the all-reduces), compute_ms and
    compute_vs_median_pct (its compute against the median rank's), step_ms, exposed_ms
    (a late rank waits least: the others wait for it), and ``late_steps_pct``: the share
    of steps in which it was the last to launch. Sorted by launch delay, then compute."""
    cols = ["rank", "launch_delay_ms", "late_steps_pct", "compute_ms", "compute_vs_median_pct", "step_ms",
            "exposed_ms"]
    if len(overview) == 0:
        return pd.DataFrame(columns=cols)
    med = overview.groupby("rank")[["launch_delay_ms", "compute_ms", "step_ms", "exposed_ms"]].median()
    typical = float(med["compute_ms"].median())
    med["compute_vs_median_pct"] = 100.0 * (med["compute_ms"] / typical - 1) if typical > 0 else np.nan
    d = overview.dropna(subset=["launch_delay_ms"])
    if len(d):
        last = d.loc[d.groupby("step")["launch_delay_ms"].idxmax(), "rank"].value_counts()
        med["late_steps_pct"] = 100.0 * last.reindex(med.index).fillna(0) / d["step"].nunique()
    else:
        med["late_steps_pct"] = np.nan
    out = med.reset_index().sort_values(["launch_delay_ms", "compute_ms"], ascending=False, na_position="last")
    out = out[cols].reset_index(drop=True)
    return out if top is None else out.head(top)


def cached_rank_overview(trace: RunTrace) -> pd.DataFrame:
    """``compute_rank_overview(trace)``, computed once per loaded trace (in its cache)."""
    if "rank_overview" not in trace.cache:
        trace.cache["rank_overview"] = compute_rank_overview(trace)
    return trace.cache["rank_overview"]


def ranks_to_show(trace: RunTrace, most: int = 8) -> list[int]:
    """The ranks to draw first: every rank of a run of up to ``most``; of a bigger one,
    rank 0 and the three other ranks that held the others back most (their steps are all
    a summary-first trace needs)."""
    ranks = sorted(int(r) for r in trace.ranks) if trace.ranks else sorted(trace.steps["rank"].unique())
    if len(ranks) <= most:
        return ranks
    slow = [int(r) for r in compute_slow_ranks(cached_rank_overview(trace))["rank"] if int(r) != ranks[0]]
    return sorted({ranks[0], *slow[:3]})


def slow_rank_line(slow: pd.DataFrame, min_ms: float = 1.0) -> str | None:
    """One sentence naming the rank that held the others back most, or None when no rank
    arrived ``min_ms`` late (``slow``: a ``compute_slow_ranks`` table)."""
    if len(slow) == 0 or not np.isfinite(slow["launch_delay_ms"].iloc[0]) or slow["launch_delay_ms"].iloc[0] < min_ms:
        return None
    r = slow.iloc[0]
    return (f"slowest rank: {int(r['rank'])}, {r['launch_delay_ms']:.1f} ms late to the all-reduces (median), the last "
            f"in {r['late_steps_pct']:.0f}% of steps; its compute {r['compute_vs_median_pct']:+.0f}% against the "
            "median rank's")


def make_rank_heatmap_figure(overview: pd.DataFrame, metric: str = "step_ms", title: str | None = None) -> go.Figure:
    """Ranks (rows) x steps (columns) of ``metric``, one cell each: a heatmap, one trace
    whatever the size (1,024 x 100 cells are one array). Click a cell: its rank."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    if len(overview) == 0:
        return go.Figure(layout=dict(title=title or "no finished steps"))
    grid = overview.pivot(index="rank", columns="step", values=metric)
    fig = go.Figure(go.Heatmap(
        z=grid.to_numpy(np.float32), x=grid.columns.to_numpy(), y=grid.index.to_numpy(), colorscale="Viridis",
        colorbar=dict(title="ms", thickness=10), hoverongaps=False,
        hovertemplate="rank %{y} · step %{x}<br>" + METRICS[metric] + ": %{z:.2f}<extra></extra>"))
    fig.update_layout(title=title or f"{METRICS[metric]}, every rank and step",
                      height=min(900, 160 + 6 * len(grid)), margin=dict(l=10, r=10, t=40, b=10),
                      xaxis=dict(title="step"), yaxis=dict(title="rank", autorange="reversed"),
                      clickmode="event+select")
    return fig


def make_step_spread_figure(overview: pd.DataFrame, metric: str = "step_ms") -> go.Figure:
    """Per step, the distribution over ranks of ``metric``: min-max and quartile bands and
    the median."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    fig = go.Figure()
    if len(overview) == 0:
        return fig.update_layout(title="no finished steps")
    q = overview.groupby("step")[metric].quantile([0.0, 0.25, 0.5, 0.75, 1.0]).unstack()
    x = q.index.to_numpy()
    for lo, hi, name, alpha in ((0.0, 1.0, "min-max", 0.15), (0.25, 0.75, "25-75 %", 0.35)):
        fig.add_trace(go.Scatter(x=x, y=q[hi], mode="lines", line=dict(width=0), showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=x, y=q[lo], mode="lines", line=dict(width=0), fill="tonexty", name=name,
                                 fillcolor=f"rgba(76, 120, 168, {alpha})", hoverinfo="skip"))
    fig.add_trace(go.Scatter(x=x, y=q[0.5], mode="lines", name="median", line=dict(color="#4C78A8"),
                             hovertemplate="step %{x}<br>median %{y:.2f} ms<extra></extra>"))
    fig.update_layout(title=f"{METRICS[metric]}: spread over ranks, per step", height=260,
                      margin=dict(l=10, r=10, t=40, b=10), xaxis_title="step", yaxis_title="ms",
                      legend=LEGEND_BELOW)
    return fig
