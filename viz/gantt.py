"""The timeline (Gantt) figure: per rank, a compute lane and an all-reduce lane.

Built for size: one Plotly trace per category (forward, backward segments, waiting,
optimizer, buckets, exposed communication), each holding all its bars, never one trace
per bar; 8 ranks x 100 steps x 50 buckets builds in well under a second
(benchmarks/gantt.py). Times on the x axis are ms from the start of the first shown step
(rank 0's clock; ranks are aligned).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from viz.buckets import compute_bucket_events
from viz.overlap import merge_intervals
from viz.trace import RunTrace

COLORS = {"forward": "#4C78A8", "backward": ("#72B7B2", "#54A24B"), "wait": "#BAB0AC",
          "optimizer": "#F58518", "exposed": "rgba(228, 26, 28, 0.55)"}


def compute_lane(rank: int) -> str:
    return f"rank {rank} · compute"


def comm_lane(rank: int) -> str:
    return f"rank {rank} · all-reduce"


def select_steps(trace: RunTrace, steps: Sequence[int] | None = None, ranks: Sequence[int] | None = None,
                 include_warmup: bool = False) -> pd.DataFrame:
    """The step rows the figure shows (finished steps; warm-up only if asked or named)."""
    s = trace.steps
    if len(s) == 0:
        return s
    keep = ~s["incomplete"]
    if steps is not None:
        keep &= s["step"].isin(list(steps))
    elif not include_warmup:
        keep &= ~s["warmup"]
    if ranks is not None:
        keep &= s["rank"].isin(list(ranks))
    return s[keep]


def _short(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … (+{len(names) - limit})" if len(names) > limit else "")


def backward_segments(trace: RunTrace, shown: pd.DataFrame) -> pd.DataFrame:
    """Backward compute cut at gradient-ready times into per-module segments:
    rank, step, start_us, end_us, label (consecutive parameters of one module merge)."""
    g = trace.grads
    if len(g) == 0 or len(shown) == 0:
        return pd.DataFrame(columns=["rank", "step", "start_us", "end_us", "label"])
    bounds = shown.set_index(["rank", "step"])[["backward_start_us", "backward_end_us"]]
    g = g.join(bounds, on=["rank", "step"], how="inner").sort_values(["rank", "step", "ready_us"], kind="stable")
    first = (g["rank"] != g["rank"].shift()) | (g["step"] != g["step"].shift())
    prev = g["ready_us"].shift().where(~first, g["backward_start_us"])
    module = g["name"].str.rsplit(".", n=1).str[0]
    new_seg = first | (module != module.shift())
    seg = pd.DataFrame({"rank": g["rank"], "step": g["step"], "start_us": prev, "end_us": g["ready_us"],
                        "label": module, "id": new_seg.cumsum()})
    out = seg.groupby("id", sort=False).agg(rank=("rank", "first"), step=("step", "first"),
                                           start_us=("start_us", "min"), end_us=("end_us", "max"),
                                           label=("label", "first"))
    return out.reset_index(drop=True)


def exposed_segments(trace: RunTrace, shown: pd.DataFrame) -> pd.DataFrame:
    """All-reduce time after backward compute ended (what the overlap did not hide)."""
    rows = []
    b = trace.buckets
    if len(b) and len(shown):
        ends = shown.set_index(["rank", "step"])["backward_end_us"]
        for (rank, step), grp in b.groupby(["rank", "step"]):
            if (rank, step) not in ends.index:
                continue
            cut = ends[(rank, step)]
            for s, e in merge_intervals(grp["launch_us"].to_numpy(), grp["done_us"].to_numpy()):
                if e > cut:
                    rows.append((rank, step, max(s, cut), e))
    return pd.DataFrame(rows, columns=["rank", "step", "start_us", "end_us"])


def _bars(name, lane, start_us, end_us, origin_us, color, hover, customdata=None, **marker) -> go.Bar:
    start = (np.asarray(start_us, float) - origin_us) / 1e3
    return go.Bar(
        name=name, orientation="h", y=lane, base=start, x=(np.asarray(end_us, float) - origin_us) / 1e3 - start,
        marker=dict(color=color, line=dict(width=0), **marker), customdata=customdata,
        hovertemplate=hover + "<extra></extra>", showlegend=True,
    )


def make_timeline_figure(trace: RunTrace, steps: Sequence[int] | None = None, ranks: Sequence[int] | None = None,
                         include_warmup: bool = False, title: str | None = None) -> go.Figure:
    """Gantt of backward compute against bucket all-reduces, per rank."""
    shown = select_steps(trace, steps, ranks, include_warmup)
    fig = go.Figure()
    if len(shown) == 0:
        fig.update_layout(title=title or "no finished steps to show")
        return fig
    origin = float(shown.loc[shown["rank"] == shown["rank"].min(), "start_us"].min())
    ranks_shown = sorted(shown["rank"].unique())
    lanes = [lane for r in ranks_shown for lane in (compute_lane(r), comm_lane(r))]
    lane = lambda df: [compute_lane(r) for r in df["rank"]]  # noqa: E731

    fig.add_trace(_bars("forward", lane(shown), shown["forward_start_us"], shown["forward_end_us"], origin,
                        COLORS["forward"], "forward · step %{customdata}<br>%{base:.1f} → %{x:.1f} ms long",
                        shown["step"]))
    seg = backward_segments(trace, shown)
    if len(seg):
        shade = np.where(np.arange(len(seg)) % 2 == 0, *COLORS["backward"])
        fig.add_trace(_bars("backward (per module)", lane(seg), seg["start_us"], seg["end_us"], origin, shade,
                            "backward · %{customdata[0]}<br>step %{customdata[1]} · %{x:.2f} ms",
                            np.column_stack([seg["label"], seg["step"]])))
    if "sync_end_us" in shown:
        w = shown.dropna(subset=["sync_end_us"])
        fig.add_trace(_bars("waiting for all-reduce", lane(w), w["backward_end_us"], w["sync_end_us"], origin,
                            COLORS["wait"], "waiting for gradients · step %{customdata}<br>%{x:.2f} ms", w["step"]))
    if "optimizer_start_us" in shown:
        o = shown.dropna(subset=["optimizer_start_us"])
        fig.add_trace(_bars("optimizer.step", lane(o), o["optimizer_start_us"], o["optimizer_end_us"], origin,
                            COLORS["optimizer"], "optimizer.step · step %{customdata}<br>%{x:.2f} ms", o["step"]))

    ev = compute_bucket_events(trace)
    keys = pd.MultiIndex.from_frame(shown[["rank", "step"]])
    ev = ev[pd.MultiIndex.from_frame(ev[["rank", "step"]]).isin(keys)] if len(ev) else ev
    if len(ev):
        custom = np.column_stack([
            ev["bucket"], ev["bytes"] / 2**20, [_short(p) for p in ev["params"]], ev["launch_offset_ms"],
            ev["duration_ms"], ev["algbw_gbps"], ev["busbw_gbps"], ev["step"],
        ])
        fig.add_trace(_bars(
            "bucket all-reduce", [comm_lane(r) for r in ev["rank"]], ev["launch_us"], ev["done_us"], origin,
            ev["bucket"].to_numpy(), "<b>bucket %{customdata[0]}</b> · step %{customdata[7]}<br>"
            "%{customdata[1]:.2f} MiB · %{customdata[2]}<br>launch %{customdata[3]:.2f} ms after backward start"
            "<br>duration %{customdata[4]:.2f} ms<br>algbw %{customdata[5]:.3f} GB/s · busbw %{customdata[6]:.3f} GB/s",
            custom, colorscale="Viridis", cmin=0, cmax=max(1, int(ev["bucket"].max())),
            colorbar=dict(title="bucket", thickness=10, x=1.0, len=0.5, y=0.25)))
    ex = exposed_segments(trace, shown)
    if len(ex):
        fig.add_trace(_bars("exposed all-reduce (after backward)", [comm_lane(r) for r in ex["rank"]],
                            ex["start_us"], ex["end_us"], origin, COLORS["exposed"],
                            "exposed communication · step %{customdata}<br>%{x:.2f} ms", ex["step"],
                            pattern=dict(shape="/", fgcolor="#E41A1C")))
    fig.update_layout(
        barmode="overlay", bargap=0.25, title=title, height=140 + 70 * len(lanes),
        xaxis=dict(title="ms from the start of the first shown step", zeroline=False, rangeslider=dict(visible=False)),
        yaxis=dict(categoryorder="array", categoryarray=lanes[::-1], title=None),
        legend=dict(orientation="h", y=-0.18), margin=dict(l=10, r=10, t=40, b=10), dragmode="zoom",
    )
    return fig
