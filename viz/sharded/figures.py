"""Figures of a sharded (FSDP2) run: the timeline with per-unit compute and one lane per
collective kind, memory over a step by category, and the model states beside ZeRO's
stages. Times in ms from the start of the first shown step (rank 0's clock); bytes in
the page's unit (``viz.units``), MiB (2^20) unless told.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative

from ddpscope.tracer import format as fmt
from ddpscope.viz.lanes import COLORS, select_steps
from ddpscope.viz.layout import LEGEND_BELOW
from ddpscope.viz.sharded.exposed import with_exposed
from ddpscope.viz.sharded.metrics import MEMORY_LABELS, NO_UNIT
from ddpscope.viz.units import unit_scale

MIB = 2**20
LANES = ("compute", "all-gather", "reduce-scatter")
OTHER_COLOR = "#7f7f7f"  # what no unit issued (DeepSpeed's gather after the step, the gradient norm)
WAIT_COLOR = "rgba(228, 26, 28, 0.75)"
MEMORY_COLORS = {"sharded_params_bytes": "#1f77b4", "unsharded_params_bytes": "#aec7e8",
                 "sharded_grads_bytes": "#ff7f0e", "unsharded_grads_bytes": "#ffbb78",
                 "optimizer_state_bytes": "#2ca02c", "activations_bytes": "#9467bd",
                 "comm_buffers_bytes": "#8c564b", "other_bytes": "#c7c7c7"}


def lane(rank: int, what: str) -> str:
    return f"rank {rank} · {what}"


_REDS = {"#EF553B", "#D62728"}  # red is waiting and exposed time: no unit takes it


def unit_colors(names: list[str]) -> dict[str, str]:
    palette = [c for c in qualitative.Plotly + qualitative.D3 if c.upper() not in _REDS]
    return {n: palette[k % len(palette)] for k, n in enumerate(names)}


def make_sharded_timeline_figure(trace, steps: Sequence[int] | None = None,
                                 ranks: Sequence[int] | None = None) -> go.Figure:
    """Per rank three lanes: compute cut per unit (coloured by unit, the waits for an
    all-gather in red, the optimizer's step in DDP's orange), the all-gathers and the reduce-scatters (a unit's colour;
    prefetched all-gathers hatched). Exposed communication (no compute on the rank
    beside it) is outlined in red."""
    sh = trace.shards
    shown = select_steps(trace, steps, ranks)
    if shown.empty:
        return go.Figure().update_layout(title="No finished step to show")
    origin = float(shown["start_us"].min())
    keep = set(zip(shown["rank"], shown["step"]))
    ranks_shown = sorted(shown["rank"].unique())
    deepspeed = sh.framework == "deepspeed"
    reduced = "gradient reduction" if deepspeed else "reduce-scatter"  # DeepSpeed 1-2 all-reduce, 3 reduce-scatter
    labels = [lane(r, w) for r in ranks_shown for w in LANES[:2] + (reduced,)]
    pos = {lab: len(labels) - k for k, lab in enumerate(labels)}
    colors = unit_colors(sh.units["name"].tolist())

    def pick(df: pd.DataFrame) -> pd.DataFrame:
        return df[[(r, s) in keep for r, s in zip(df["rank"], df["step"])]] if len(df) else df

    fig = go.Figure()
    # the optimizer's span first, under whatever the compute lane draws in it (a wait)
    opt = shown.dropna(subset=["optimizer_start_us", "optimizer_end_us"]) if "optimizer_start_us" in shown \
        else shown.iloc[:0]
    if len(opt):
        fig.add_trace(go.Bar(
            name="optimizer.step", orientation="h", y=[pos[lane(r, "compute")] for r in opt["rank"]],
            base=(opt["optimizer_start_us"] - origin) / 1e3,
            x=(opt["optimizer_end_us"] - opt["optimizer_start_us"]) / 1e3, width=0.8,
            marker_color=COLORS["optimizer"], customdata=opt["step"],
            hovertemplate="optimizer.step (step %{customdata})<br>%{x:.3f} ms (the collectives it issued: on "
                          "their lanes)<extra></extra>"))
    segs = pick(sh.segments)
    for name, g in segs.groupby("name", sort=False):
        fig.add_trace(go.Bar(
            name=str(name), orientation="h", y=[pos[lane(r, "compute")] for r in g["rank"]],
            base=(g["start_us"] - origin) / 1e3, x=(g["end_us"] - g["start_us"]) / 1e3, width=0.8,
            marker_color=colors.get(name, OTHER_COLOR), legendgroup=str(name),
            customdata=np.stack([g["phase"], g["step"]], axis=-1),
            hovertemplate=f"{name} %{{customdata[0]}} (step %{{customdata[1]}})<br>%{{x:.3f}} ms<extra></extra>"))
    waits = pick(sh.waits)
    if len(waits):
        fig.add_trace(go.Bar(
            name="waiting for an all-gather", orientation="h", y=[pos[lane(r, "compute")] for r in waits["rank"]],
            base=(waits["start_us"] - origin) / 1e3, x=(waits["end_us"] - waits["start_us"]) / 1e3, width=0.8,
            marker_color=WAIT_COLOR, customdata=np.stack([waits["name"], waits["phase"]], axis=-1),
            hovertemplate="compute waits for %{customdata[0]}'s all-gather (%{customdata[1]})<br>%{x:.3f} ms"
                          "<extra></extra>"))
    colls = pick(with_exposed(trace))
    # a unit's colour is named once, on its compute; a unit seen only on a collective lane
    # (DeepSpeed's compute is the whole model's) and what no unit issued get their own entry
    named = set(segs["name"].astype(str)) if len(segs) else set()
    for (kind, name, by), g in colls.groupby(["collective", "name", "by"], sort=False, dropna=False):
        label = NO_UNIT if (g["unit"] == -1).all() else str(name)
        first = label not in named
        named.add(label)
        what = "all-gather" if kind == "all_gather" else reduced  # HSDP's all-reduce: after its reduce-scatter
        sent = g["sent_as"].dropna()
        ran = f" (ran as {sent.iloc[0].replace('_', '-')})" if len(sent) else ""
        if isinstance(by, str):  # of no unit: who issued it (clip_grad_norm_, DeepSpeed's gradient norm, the script)
            ran = f": {by}"
        elif kind == "all_reduce" and not deepspeed:
            ran = " (HSDP's all-reduce across replicas)"
        exposed = g["exposed_ms"] > 0.5 * g["ms"]
        fig.add_trace(go.Bar(
            name=label if first else f"{kind.replace('_', '-')} {label}", orientation="h",
            y=[pos[lane(r, what)] for r in g["rank"]], base=(g["start_us"] - origin) / 1e3, x=g["ms"], width=0.6,
            legendgroup=str(name), showlegend=first,
            marker=dict(color=colors.get(name, OTHER_COLOR), pattern_shape=["/" if p else "" for p in g["prefetch"]],
                        line=dict(color=["#e41a1c" if e else "rgba(0,0,0,0)" for e in exposed], width=1.5)),
            customdata=np.stack([g["phase"], g["bytes"] / MIB, g["exposed_ms"], g["prefetch"]], axis=-1),
            hovertemplate=f"{kind.replace('_', '-')} {label}{ran}, %{{customdata[0]}}<br>%{{customdata[1]:.3f}} MiB, %{{x:.3f}} ms, "
                          "exposed %{customdata[2]:.3f} ms<br>prefetched: %{customdata[3]}<extra></extra>"))
    fig.update_layout(
        barmode="overlay", height=120 + 75 * len(ranks_shown) * len(LANES) // 2,
        xaxis_title="ms from the first shown step's start (rank 0's clock)",
        yaxis=dict(tickvals=list(pos.values()), ticktext=list(pos), range=[0.4, len(labels) + 0.6]),
        legend=LEGEND_BELOW, margin=dict(l=10, r=10, t=40, b=10),
        title=f"{'DeepSpeed' if sh.framework == 'deepspeed' else 'FSDP2'}, ZeRO stage {sh.stage}: compute per unit "
              "against its all-gathers and reductions")
    return fig


def make_memory_over_step_figure(samples: pd.DataFrame, title: str = "Memory over one step",
                                 unit: str = "MiB") -> go.Figure:
    """Stacked areas of bytes by category at each unit boundary of one step (measured, or
    predicted: ``sharded.predict.predict_memory``), with the peak marked; in ``unit``."""
    k = unit_scale(unit)
    fig = go.Figure()
    if samples.empty:
        return fig.update_layout(title=f"{title}: no measured step")
    for cat in fmt.MEMORY_CATEGORIES:
        if cat not in samples or not (samples[cat].fillna(0) > 0).any():
            continue
        fig.add_trace(go.Scatter(
            x=samples["t_ms"], y=samples[cat].fillna(0) / k, name=MEMORY_LABELS[cat], stackgroup="memory",
            mode="lines", line=dict(width=0.5, color=MEMORY_COLORS[cat]), customdata=samples["where"],
            hovertemplate=MEMORY_LABELS[cat] + ": %{y:.3f} " + unit + "<br>%{customdata}<extra></extra>"))
    peak = samples[samples["peak"]]
    if len(peak):
        p = peak.iloc[0]
        fig.add_trace(go.Scatter(x=[p["t_ms"]], y=[p["total_bytes"] / k], mode="markers+text",
                                 marker=dict(symbol="triangle-down", size=14, color="#e41a1c"),
                                 text=[f"peak {p['total_bytes'] / k:.2f} {unit}: {p['where']}"],
                                 textposition="top center", name="peak", hoverinfo="skip", cliponaxis=False))
        fig.update_yaxes(range=[0, 1.15 * p["total_bytes"] / k])  # room for the peak's label under the title
    fig.update_layout(title=title, xaxis_title="ms from the step's start", yaxis_title=unit,
                      height=420, legend=LEGEND_BELOW, margin=dict(l=10, r=10, t=40, b=10))
    return fig


def make_stage_comparison_figure(comparison: pd.DataFrame, unit: str = "MiB") -> go.Figure:
    """The measured model states (per rank) beside ZeRO stages 0-3 for this model and N,
    stacked: parameters, gradients, optimizer state (in ``unit``); rows with a total
    only (DeepSpeed's estimators) as one grey bar."""
    k = unit_scale(unit)
    fig = go.Figure()
    rows = comparison["row"].tolist()
    for key, label, color in (("params_bytes", "parameters", "#1f77b4"), ("grads_bytes", "gradients", "#ff7f0e"),
                              ("optimizer_state_bytes", "optimizer state", "#2ca02c")):
        fig.add_trace(go.Bar(x=rows, y=comparison[key] / k, name=label, marker_color=color,
                             hovertemplate="%{x}<br>" + label + ": %{y:.3f} " + unit + "<extra></extra>"))
    totals = comparison[comparison["params_bytes"].isna()]  # a total only: DeepSpeed's estimators
    if len(totals):
        fig.add_trace(go.Bar(x=totals["row"], y=totals["model_state_bytes"] / k, name="estimate (total)",
                             marker_color="#7f7f7f",
                             hovertemplate="%{x}<br>model states: %{y:.3f} " + unit + "<extra></extra>"))
    fig.update_layout(barmode="stack", height=380, yaxis_title=f"{unit} per rank", legend=LEGEND_BELOW,
                      title="Model states: this run beside ZeRO stages 0-3 (this model, this N)",
                      margin=dict(l=10, r=10, t=40, b=10))
    return fig
