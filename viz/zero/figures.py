"""Figures of memory per ZeRO stage: a measured run beside the model, and projections.

Bars stack parameters / gradients / optimizer state / activations. ``unit`` is one of
``viz.units.UNITS`` and is written on the axis: GB and MB are decimal (10^9, 10^6 bytes, the
ZeRO paper's unit), GiB and MiB binary (2^30, 2^20).
"""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go

from ddpscope.viz.layout import LEGEND_BELOW
from ddpscope.viz.units import unit_scale

PARTS = (("params_bytes", "parameters", "#1f77b4"), ("grads_bytes", "gradients", "#ff7f0e"),
         ("optimizer_state_bytes", "optimizer state", "#2ca02c"), ("activations_bytes", "activations", "#9467bd"))


def make_zero_run_figure(comparison: pd.DataFrame, unit: str = "MiB", rank: int = 0) -> go.Figure:
    """Measured (one rank) beside predicted, per stage. The measured "activations" part
    is everything else the step's peak held: peak tensor memory minus model states
    (activations, temporaries, communication buffers); the predicted one is the
    transformer estimate when the comparison has one."""
    k = unit_scale(unit)
    c = comparison[comparison["rank"] == rank].sort_values("stage")
    stages = [f"stage {int(s)}" for s in c["stage"]]
    x = [stages * 2, ["measured"] * len(c) + ["predicted"] * len(c)]
    other = (c["peak_bytes"] - c["model_state_bytes"]).clip(lower=0)
    fig = go.Figure()
    for key, label, color in PARTS:
        if key == "activations_bytes":
            measured = other
            predicted = c["predicted_activations_bytes"] if "predicted_activations_bytes" in c else [0.0] * len(c)
            label = "activations (measured: peak - model states)"
        else:
            measured, predicted = c[key], c[f"predicted_{key}"]
        y = [v / k for v in list(measured) + list(predicted)]
        fig.add_trace(go.Bar(x=x, y=y, name=label, marker_color=color,
                             hovertemplate="%{x}<br>" + label + ": %{y:.3f} " + unit + "<extra></extra>"))
    fig.update_layout(barmode="stack", height=420, yaxis_title=unit, margin=dict(t=40, b=40, l=60, r=10),
                      title=f"Rank {rank}: measured vs predicted per ZeRO stage ({unit})",
                      legend=LEGEND_BELOW)
    return fig


def make_zero_projection_figure(memory: pd.DataFrame, unit: str = "GB",
                                device_bytes: float | None = None) -> go.Figure:
    """Per-device memory per stage from ``viz.zero.model.compute_zero_memory``, stacked,
    with the device's memory as a line when given."""
    k = unit_scale(unit)
    labels = [f"stage {int(s)}" for s in memory["stage"]]
    fig = go.Figure()
    for key, label, color in PARTS:
        vals = memory[key] / k
        if key == "activations_bytes" and not (vals > 0).any():
            continue
        fig.add_trace(go.Bar(x=labels, y=vals.tolist(), name=label, marker_color=color,
                             hovertemplate="%{x}<br>" + label + ": %{y:.4g} " + unit + "<extra></extra>"))
    fig.add_trace(go.Scatter(x=labels, y=(memory["total_bytes"] / k).tolist(), mode="text",
                             text=[f"{v:.3g} {unit}" for v in memory["total_bytes"] / k], textposition="top center",
                             showlegend=False, hoverinfo="skip"))
    if device_bytes:
        fig.add_hline(y=device_bytes / k, line_dash="dash", line_color="red",
                      annotation_text=f"device memory {device_bytes / k:.4g} {unit}")
    fig.update_layout(barmode="stack", height=420, yaxis_title=f"per device ({unit})",
                      margin=dict(t=40, b=40, l=60, r=10), legend=LEGEND_BELOW)
    return fig
