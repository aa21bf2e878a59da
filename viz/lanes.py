"""Lanes and bars shared by every timeline figure (DDP's Gantt, the profiler kernels',
FSDP2's): the steps shown, lane names and positions, colours, and bars drawn as SVG
rectangles or, above ``GL_THRESHOLD`` bars, WebGL line segments. Times on the x axis are
ms from an origin (µs on rank 0's clock) the figure chooses."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ddpscope.viz.trace import RunTrace

# Per-bar labels (module / parameter names in the hover) only up to this many bars in a
# trace: strings travel one by one, numbers as packed arrays. Fewer steps: names return.
TEXT_LIMIT = 5000
# Above this many bars the figure draws WebGL segments instead of SVG rectangles.
GL_THRESHOLD = 6000
# WebGL lines have one colour per trace: bucket colours come in this many bands.
GL_COLORS = 12
#: a bar's height on its lane (lanes are 1 apart)
BAR_WIDTH = 0.8
#: collectives drawn over the buckets on their lane (DDP's own, the script's): narrower, so
#: the buckets they ran beside, or queued behind, show above and below them
OVER_BUCKETS_WIDTH = 0.3

# bucket all-reduces by index: plotly's qualitative "D3" without its red (exposed time is red)
BUCKET_PALETTE = ("#1F77B4", "#FF7F0E", "#2CA02C", "#9467BD", "#8C564B", "#E377C2", "#7F7F7F", "#BCBD22",
                  "#17BECF")

COLORS = {"forward": "#4C78A8", "backward": "#54A24B", "wait": "#BAB0AC",
          "optimizer": "#F58518", "exposed": "rgba(228, 26, 28, 0.55)", "param_sync": "#B279A2",
          "ddp_own": "#9D755D", "buffer_sync": "#FF9DA6",
          "other_comm": "#BAB0AC"}


def lane_position(fig: go.Figure, label: str) -> float:
    """The y position of a lane label in a figure made here."""
    ax = fig.layout.yaxis
    return float(ax.tickvals[list(ax.ticktext).index(label)])


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


def timeline_extent_ms(trace: RunTrace, steps: Sequence[int] | None = None, include_warmup: bool = False) -> float:
    """How long the shown steps last on the figure's time axis (ms), to give several
    figures one time scale."""
    shown = select_steps(trace, steps, None, include_warmup)
    if len(shown) == 0:
        return 0.0
    origin = shown.loc[shown["rank"] == shown["rank"].min(), "start_us"].min()
    return float((shown["end_us"].max() - origin) / 1e3)


def group_starts(df: pd.DataFrame, by) -> np.ndarray:
    """For rows sorted by ``by``: True where a new group begins."""
    first = np.zeros(len(df), bool)
    if len(df):
        first[0] = True
    for c in by:
        v = df[c].to_numpy()
        first[1:] |= v[1:] != v[:-1]
    return first


def lane_bars(gl: bool, name: str, y, start_us, end_us, origin_us: float, color, hover: str,
                custom: np.ndarray, text: list[str] | None = None, line: float = 0, pattern: dict | None = None,
                **extra) -> list[dict]:
    """Bars from ``start_us`` to ``end_us`` on lane positions ``y``: SVG bars, or WebGL
    line segments when ``gl`` (tens of thousands of SVG rectangles do not stay
    interactive in a browser). ``custom`` rows are [step, duration ms, ...]; ``hover``
    refers only to ``customdata`` and ``hovertext``, so both renderers share it. ``bar_width``
    (lanes; 0.8 by default) narrows bars drawn over others on a lane (``gl_width``, px, the
    WebGL segments'), so those under them stay in sight."""
    start = (np.asarray(start_us, float) - origin_us) / 1e3
    end = (np.asarray(end_us, float) - origin_us) / 1e3
    y = np.asarray(y, float)
    custom = np.asarray(custom, float)
    if text is None and "%{hovertext}" in hover:
        hover = hover.replace("%{hovertext}", "(show fewer steps for names)")
    hover += "<extra></extra>"
    if gl:
        group = extra.get("legendgroup", name)
        return [gl_lines(name, y, start, end, color, extra.get("gl_width", 26), group, extra.get("showlegend", True)),
                gl_hover(name, y, start, end, custom, text, hover, group)]
    marker = dict(color=color, line=dict(width=line, color="white"))
    if pattern:
        marker["pattern"] = pattern
    marker.update({k: v for k, v in extra.items() if k in ("colorscale", "cmin", "cmax", "colorbar")})
    return [dict(
        type="bar", name=name, orientation="h", width=extra.get("bar_width", BAR_WIDTH), y=y, base=start, x=end - start, marker=marker,
        customdata=custom, hovertext=text, hovertemplate=hover, textposition="none",
        **{k: v for k, v in extra.items() if k in ("legendgroup", "showlegend")},
    )]


def gl_lines(name, y, start, end, color, width, group, showlegend) -> dict:
    """Segments as one WebGL line broken by NaNs (float32: half the bytes to ship)."""
    nan = np.full(len(start), np.nan, np.float32)
    return dict(
        type="scattergl", name=name, mode="lines", legendgroup=group, showlegend=showlegend, hoverinfo="skip",
        x=np.column_stack([start.astype(np.float32), end.astype(np.float32), nan]).ravel(),
        y=np.column_stack([y.astype(np.float32), y.astype(np.float32), nan]).ravel(),
        line=dict(color=color, width=width), connectgaps=False,
    )


def gl_hover(name, y, start, end, custom, text, hover, group) -> dict:
    """One invisible point per segment, at its middle, carrying the hover."""
    return dict(
        type="scattergl", name=name, mode="markers", legendgroup=group, showlegend=False,
        x=((start + end) / 2).astype(np.float32), y=y.astype(np.float32), customdata=custom.astype(np.float32),
        hovertext=text, hovertemplate=hover, marker=dict(size=6, opacity=0),
    )
