"""The timeline of a profiler (Kineto) trace: per rank, compute kernels, one lane per
collective kind, and the communication no compute kernel hid.

Compute is drawn stream-merged (the union of compute kernels over every stream: what the
overlap figures count) or, with ``per_stream``, one lane per stream. Built like
``viz.ddp.gantt`` (one Plotly trace per category, WebGL segments above ``GL_THRESHOLD`` bars);
x is ms from the start of the first shown step on the lowest shown rank.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ddpscope.viz.intervals import merge_sorted_runs
from ddpscope.viz.lanes import COLORS, GL_THRESHOLD, TEXT_LIMIT, group_starts, lane_bars, select_steps
from ddpscope.viz.layout import LEGEND_BELOW
from ddpscope.viz.trace import RunTrace

COLLECTIVE_COLORS = ["#E45756", "#72B7B2", "#B279A2", "#FF9DA6", "#9D755D", "#EECA3B"]
COMPUTE_COLOR = COLORS["backward"]
MEMORY_COLOR = "#BAB0AC"


def _union_by(df: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Union of [start_us, end_us] within groups ``by``: the groups' columns, start_us,
    end_us and how many events each merged interval holds (``count``)."""
    if len(df) == 0:
        return pd.DataFrame(columns=[*by, "start_us", "end_us", "count"])
    df = df.sort_values([*by, "start_us"], kind="stable")
    first = group_starts(df, by)
    s, e = df["start_us"].to_numpy(float), df["end_us"].to_numpy(float)
    idx, ends = merge_sorted_runs(first, s, e)
    out = df.iloc[idx][by].reset_index(drop=True)
    out["start_us"], out["end_us"] = s[idx], ends
    out["count"] = np.diff(np.r_[idx, len(df)])
    return out


def _subtract(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Per rank, the parts of intervals ``a`` (disjoint) not covered by ``b`` (disjoint)."""
    rows = []
    for rank, g in a.groupby("rank"):
        cover = b[b["rank"] == rank][["start_us", "end_us"]].to_numpy(float)
        for s, e, step in g[["start_us", "end_us", "step"]].itertuples(index=False):
            lo = np.searchsorted(cover[:, 1], s, side="right") if len(cover) else 0
            t = s
            for cs, ce in cover[lo:]:
                if cs >= e:
                    break
                if cs > t:
                    rows.append((rank, step, t, cs))
                t = max(t, ce)
            if t < e:
                rows.append((rank, step, t, e))
    return pd.DataFrame(rows, columns=["rank", "step", "start_us", "end_us"])


def make_kernel_timeline_figure(trace: RunTrace, steps: Sequence[int] | None = None,
                                ranks: Sequence[int] | None = None, per_stream: bool = False,
                                title: str | None = None, webgl: bool | None = None) -> go.Figure:
    """Gantt of a profiler trace's kernels by rank: compute (merged, or per stream), a
    lane per collective kind (one bar per kernel: kind, MiB, dtype, group size in the
    hover), memory copies, and exposed communication (no compute kernel beside it)."""
    shown = select_steps(trace, steps, ranks, include_warmup=True)
    if len(shown) == 0:
        return go.Figure(layout=dict(title=title or "no ProfilerStep to show"))
    k = trace.kernels
    key = shown["rank"].to_numpy(np.int64) * (1 << 32) + shown["step"].to_numpy(np.int64)
    k = k[np.isin(k["rank"].to_numpy(np.int64) * (1 << 32) + k["step"].to_numpy(np.int64), key)]
    low = shown["rank"].min()
    origin = float(min(shown.loc[shown["rank"] == low, "start_us"].min(),
                       k.loc[k["rank"] == low, "start_us"].min() if (k["rank"] == low).any() else np.inf))
    comp = k[k["kind"] == "compute"]
    comm = k[k["kind"] == "comm"]
    mem = k[k["kind"].isin(["memory", "other"])]
    lane_of_compute = ["rank", "stream"] if per_stream else ["rank"]
    comp_u = _union_by(comp, [*lane_of_compute, "step"])
    comp_all = _union_by(comp, ["rank"])
    comm_all = _union_by(comm.assign(step=comm["step"]), ["rank", "step"])
    exposed = _subtract(comm_all, comp_all)
    kinds = sorted(comm["collective"].replace("", "other").unique())

    # lanes, top to bottom per rank: compute (per stream), collectives, memory, exposed
    labels: list[str] = []
    lane_pos: dict[tuple, int] = {}
    for r in sorted(shown["rank"].unique()):
        if per_stream:
            for s in sorted(comp.loc[comp["rank"] == r, "stream"].unique()):
                lane_pos[(r, "compute", s)] = len(labels)
                labels.append(f"rank {r} · stream {s}")
        else:
            lane_pos[(r, "compute", None)] = len(labels)
            labels.append(f"rank {r} · compute")
        for c in kinds:
            lane_pos[(r, "comm", c)] = len(labels)
            labels.append(f"rank {r} · {c}")
        if len(mem):
            lane_pos[(r, "memory", None)] = len(labels)
            labels.append(f"rank {r} · memcpy / other")
        if len(comm):
            lane_pos[(r, "exposed", None)] = len(labels)
            labels.append(f"rank {r} · exposed comm")
    top = len(labels) - 1
    y = lambda keys: np.array([top - lane_pos[kk] for kk in keys], float)  # noqa: E731
    dur = lambda a, b: (np.asarray(b, float) - np.asarray(a, float)) / 1e3  # noqa: E731
    gl = len(comp_u) + len(comm) + len(mem) > GL_THRESHOLD if webgl is None else webgl
    data: list[dict] = []
    if len(comp_u):
        keys = [(r, "compute", s if per_stream else None) for r, s in
                zip(comp_u["rank"], comp_u["stream"] if per_stream else comp_u["rank"])]
        data.extend(lane_bars(gl, "compute kernels", y(keys), comp_u["start_us"], comp_u["end_us"], origin,
                              COMPUTE_COLOR, "compute · step %{customdata[0]}<br>%{customdata[2]:.0f} kernels · "
                              "%{customdata[1]:.3f} ms",
                              np.column_stack([comp_u["step"], dur(comp_u["start_us"], comp_u["end_us"]),
                                               comp_u["count"]])))
    for n, c in enumerate(kinds):
        g = comm[comm["collective"].replace("", "other") == c]
        text = g["name"].astype(str).str.slice(0, 60).tolist() if len(g) <= TEXT_LIMIT else None
        data.extend(lane_bars(
            gl, c, y([(r, "comm", c) for r in g["rank"]]), g["start_us"], g["end_us"], origin,
            COLLECTIVE_COLORS[n % len(COLLECTIVE_COLORS)],
            "<b>" + c + "</b> · step %{customdata[0]}<br>%{hovertext}<br>%{customdata[1]:.3f} ms · "
            "%{customdata[2]:.2f} MiB · group of %{customdata[3]}",
            np.column_stack([g["step"], dur(g["start_us"], g["end_us"]), g["bytes"].to_numpy(float) / 2**20,
                             g["group_size"].to_numpy(float)]), text=text, line=0.5))
    if len(mem):
        text = mem["name"].astype(str).str.slice(0, 60).tolist() if len(mem) <= TEXT_LIMIT else None
        data.extend(lane_bars(gl, "memcpy / other", y([(r, "memory", None) for r in mem["rank"]]), mem["start_us"],
                              mem["end_us"], origin, MEMORY_COLOR,
                              "%{hovertext} · step %{customdata[0]}<br>%{customdata[1]:.3f} ms",
                              np.column_stack([mem["step"], dur(mem["start_us"], mem["end_us"])]), text=text))
    if len(exposed):
        data.extend(lane_bars(gl, "exposed communication (no compute beside it)",
                              y([(r, "exposed", None) for r in exposed["rank"]]), exposed["start_us"],
                              exposed["end_us"], origin, COLORS["exposed"],
                              "exposed communication · step %{customdata[0]}<br>%{customdata[1]:.3f} ms",
                              np.column_stack([exposed["step"], dur(exposed["start_us"], exposed["end_us"])]),
                              pattern=dict(shape="/", fgcolor="#E41A1C"), gl_width=10))
    fig = go.Figure(data=data, _validate=False)  # numeric arrays built above: see viz.ddp.gantt
    fig.update_layout(
        barmode="overlay", title=title, height=140 + 36 * len(labels), hovermode="closest",
        xaxis=dict(title="ms from the start of the first shown step", zeroline=False),
        yaxis=dict(tickvals=[top - i for i in range(len(labels))], ticktext=labels, range=[-0.6, top + 0.6],
                   title=None, fixedrange=True),
        legend=LEGEND_BELOW, margin=dict(l=10, r=10, t=40, b=10), dragmode="zoom",
    )
    return fig
