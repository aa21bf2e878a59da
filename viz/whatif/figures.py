"""The what-if figure: step time and exposed communication against bucket_cap_mb."""

from __future__ import annotations

import math

import pandas as pd
import plotly.graph_objects as go

from ddpscope.viz.layout import LEGEND_BELOW


def make_cap_sweep_figure(sweep: pd.DataFrame, measured: pd.DataFrame | None = None,
                          best_cap: float | None = None, title: str = "Predicted step time against bucket_cap_mb",
                          noise_ms: float | None = None) -> go.Figure:
    """Predicted step time and exposed communication (ms) per cap (MiB, log axis) as
    curves, measured runs as points on them, the traced cap and ``best_cap`` marked;
    with ``noise_ms`` (the run's step-to-step noise), the band of steps that cannot be told
    apart from the fastest one shaded."""
    fig = go.Figure()
    if "first_bucket_mb" in sweep:  # the curve is explicit caps; DDP's default (1 MiB first bucket) is a marker
        curve = sweep[sweep["first_bucket_mb"] == sweep["bucket_cap_mb"]]
    else:
        curve = sweep
    x = curve["bucket_cap_mb"].tolist()
    fig.add_trace(go.Scatter(x=x, y=curve["step_ms"].tolist(), mode="lines+markers", name="step (predicted)",
                             line=dict(color="#1f77b4"), hovertemplate="%{x:g} MiB: %{y:.1f} ms<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=curve["exposed_ms"].tolist(), mode="lines+markers",
                             name="exposed communication (predicted)", line=dict(color="#d62728", dash="dash"),
                             hovertemplate="%{x:g} MiB: %{y:.1f} ms exposed<extra></extra>"))
    traced = sweep[sweep["traced"]] if "traced" in sweep else sweep.iloc[0:0]
    if len(traced):
        fig.add_trace(go.Scatter(x=traced["bucket_cap_mb"].tolist(), y=traced["step_ms"].tolist(), mode="markers",
                                 name="traced cap (replayed)",
                                 marker=dict(symbol="circle-open", size=16, color="#1f77b4", line=dict(width=2))))
    if measured is not None and len(measured):
        m = measured.dropna(subset=["bucket_cap_mb", "step_ms"])
        # the setting, not only the x: DDP's default and an explicit 25 MiB share x = 25
        setting = (m["setting"] if "setting" in m else m["bucket_cap_mb"].map(lambda c: f"{c:g} MiB")).tolist()
        fig.add_trace(go.Scatter(x=m["bucket_cap_mb"].tolist(), y=m["step_ms"].tolist(), mode="markers",
                                 name="step (measured runs)", text=m["run"].tolist(), customdata=setting,
                                 marker=dict(symbol="x", size=11, color="black"),
                                 hovertemplate="%{text} (%{customdata}): %{y:.1f} ms<extra></extra>"))
        fig.add_trace(go.Scatter(x=m["bucket_cap_mb"].tolist(), y=m["exposed_ms"].tolist(), mode="markers",
                                 name="exposed (measured runs)", text=m["run"].tolist(), customdata=setting,
                                 marker=dict(symbol="x-thin", size=11, color="#d62728", line=dict(width=2)),
                                 hovertemplate="%{text} (%{customdata}): %{y:.1f} ms exposed<extra></extra>"))
    if best_cap is not None:
        row = sweep.loc[(sweep["bucket_cap_mb"] - best_cap).abs().idxmin()]  # the first: the default, if any
        fig.add_trace(go.Scatter(x=[float(row["bucket_cap_mb"])], y=[float(row["step_ms"])], mode="markers+text",
                                 name="best cap (predicted)", text=[f"best: {row['bucket_cap_mb']:.4g} MiB"],
                                 textposition="top center",
                                 marker=dict(symbol="star", size=18, color="#2ca02c")))
    if noise_ms is not None and math.isfinite(noise_ms) and len(curve):
        fastest = float(curve["step_ms"].min())
        fig.add_hrect(y0=fastest, y1=fastest + noise_ms, fillcolor="#2ca02c", opacity=0.12, line_width=0,
                      annotation_text=f"within the noise of the fastest (+{noise_ms:.1f} ms)",
                      annotation_position="top right", annotation_font_size=11)
    # ticks at the caps themselves: plotly's own log ticks read "2 5 1 2 5 10 2 5 100"
    caps = sorted({float(c) for c in sweep["bucket_cap_mb"]})
    fig.update_xaxes(type="log", title_text="bucket_cap_mb (MiB, log scale)", tickvals=caps,
                     ticktext=[f"{c:.4g}" for c in caps])  # a cap read off bytes: 0.0999994 reads 0.1
    fig.update_yaxes(title_text="ms", rangemode="tozero")
    fig.update_layout(title=title, height=430, margin=dict(t=50, b=90, l=50, r=20),
                      legend=LEGEND_BELOW)
    return fig
