"""Figures of one traced ring all-reduce: the step-by-step animation, and step times.

``make_ring_animation_figure`` draws N ranks on a circle, each with its N chunk slots
coloured by state (own data / partially reduced, with how many ranks' data it holds /
fully reduced), and arrows for the chunks in flight. Frame 0 is the start; frame k is
step k (its arrows, and the slots once that step landed). Playing it, each step's frame
lasts in proportion to the step's measured time (median over ranks).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ddpscope.tracer.format import ALL_GATHER, REDUCE_SCATTER
from ddpscope.viz.ring.metrics import compute_ring_step_times, replay_chunk_states, step_durations_ms
from ddpscope.viz.ring.trace import RingTrace

MS_PER_MEDIAN_STEP = 800.0  # playback: a median-length step shows for this long
START_FRAME_MS = 800.0
OWN, PARTIAL, FULL = "#b0b0b0", "#6baed6", "#2ca02c"
PHASE_COLORS = {REDUCE_SCATTER: "#1f77b4", ALL_GATHER: "#9467bd"}
_NODE_R, _SLOT_R = 1.0, 1.55


def _node_xy(n: int) -> np.ndarray:
    """Rank positions on the unit circle, rank 0 on top, clockwise."""
    ang = math.pi / 2 - 2 * math.pi * np.arange(n) / n
    return np.column_stack([np.cos(ang), np.sin(ang)]) * _NODE_R


def _slot_layout(n: int) -> tuple[np.ndarray, float]:
    """(x, y) of each (rank, chunk) slot, shape (n, n, 2), and the slot pitch."""
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    chord = 2 * _SLOT_R * math.sin(math.pi / n) if n > 2 else 2.0
    pitch = min(0.17, 0.85 * chord / cols)
    centre = _node_xy(n) * (_SLOT_R / _NODE_R)
    out = np.zeros((n, n, 2))
    for c in range(n):
        i, j = divmod(c, cols)
        out[:, c, 0] = centre[:, 0] + (j - (cols - 1) / 2) * pitch
        out[:, c, 1] = centre[:, 1] - (i - (rows - 1) / 2) * pitch
    return out, pitch


def _slot_colors(counts: np.ndarray, n: int) -> list[str]:
    colors = []
    for k in counts.ravel():
        if k <= 1:
            colors.append(OWN)
        elif k >= n:
            colors.append(FULL)
        else:  # darker blue as contributions grow
            f = (k - 1) / max(1, n - 2)
            colors.append(f"rgb({int(189 - 120 * f)},{int(215 - 100 * f)},{int(238 - 40 * f)})")
    return colors


def _arrows(steps: pd.DataFrame, xy: np.ndarray) -> tuple[dict, dict]:
    """Arrow lines (with arrowheads) and labels for one step's sends."""
    ax, ay, sym, size, lx, ly, text, hover = [], [], [], [], [], [], [], []
    for row in steps.itertuples():
        a, b = xy[int(row.rank)], xy[int(row.send_to)]
        d = b - a
        length = float(np.hypot(*d)) or 1.0
        u = d / length
        off = np.array([u[1], -u[0]]) * 0.07  # to the right of travel: both directions show for N = 2
        p, q = a + u * 0.2 + off, b - u * 0.2 + off
        ax += [p[0], q[0], None]
        ay += [p[1], q[1], None]
        sym += ["circle", "arrow", "circle"]
        size += [0, 16, 0]
        mid = (p + q) / 2 + off * 2.2
        lx.append(mid[0])
        ly.append(mid[1])
        text.append(f"c{int(row.send_chunk)}")
        hover.append(f"rank {int(row.rank)} → rank {int(row.send_to)}: chunk {int(row.send_chunk)}, "
                     f"{row.send_bytes / 2**10:.1f} KiB<br>{row.phase} · {row.dur_ms:.3f} ms on rank {int(row.rank)}")
    lines = dict(x=ax, y=ay, marker=dict(symbol=sym, size=size, angleref="previous"))
    labels = dict(x=lx, y=ly, text=text, hovertext=hover)
    return lines, labels


def step_label(phase: str, phase_step: int) -> str:
    """"RS 2" / "AG 1": a step's short name (phase steps count from 1)."""
    return f"{'RS' if phase == REDUCE_SCATTER else 'AG'} {int(phase_step) + 1}"


def ring_frame_durations_ms(step_ms: np.ndarray) -> list[float]:
    """Playback time of each frame: the start frame, then each step in proportion to its
    measured time (a median step lasts ``MS_PER_MEDIAN_STEP``)."""
    med = float(np.median(step_ms)) if len(step_ms) else 1.0
    scale = MS_PER_MEDIAN_STEP / med if med > 0 else 1.0
    return [START_FRAME_MS] + [float(t) * scale for t in step_ms]


def make_ring_animation_figure(trace: RingTrace, round_: int) -> go.Figure:
    """The animation of ``round_`` of a ring trace: 2(N-1)+1 frames, play/pause, slider."""
    n = trace.world_size
    st = compute_ring_step_times(trace, round_)
    counts = replay_chunk_states(st, n)  # (frames, rank, chunk)
    step_ms = step_durations_ms(st)
    durations = ring_frame_durations_ms(step_ms)
    nodes = _node_xy(n)
    slots, pitch = _slot_layout(n)
    px_per_unit = 640 / 4.4
    marker_px = max(4.0, pitch * px_per_unit * 0.85)
    chunk_bytes = st.groupby("send_chunk")["send_bytes"].first().to_dict()
    show_counts = n <= 6

    def slot_trace(counts_f: np.ndarray) -> dict:
        hover = [f"rank {r} · chunk {c}"
                 + f" ({chunk_bytes.get(c, 0) / 2**10:.1f} KiB)"
                 + f"<br>{counts_f[r, c]}/{n} ranks' data"
                 + (" · fully reduced" if counts_f[r, c] == n else " · own data" if counts_f[r, c] == 1 else "")
                 for r in range(n) for c in range(n)]
        return dict(marker=dict(color=_slot_colors(counts_f, n), size=marker_px, symbol="square",
                                line=dict(width=1, color="white")),
                    text=[str(k) if show_counts else "" for k in counts_f.ravel()], hovertext=hover)

    def title(k: int) -> str:
        if k == 0:
            return f"Ring all-reduce of {trace.run.get('bytes', 0) / 2**20:.3g} MiB on {n} ranks: start"
        s = by_step[k - 1].iloc[0]
        return (f"Step {k}/{2 * (n - 1)} · {s['phase']} {int(s['phase_step']) + 1}/{n - 1} · "
                f"{step_ms[k - 1]:.3f} ms (median over ranks)")

    empty_arrows = (dict(x=[], y=[], marker=dict(symbol=[], size=[], angleref="previous")),
                    dict(x=[], y=[], text=[], hovertext=[]))
    by_step = {int(k): g for k, g in st.groupby("step")}
    frames = []
    for k in range(2 * n - 1):
        lines, labels = empty_arrows if k == 0 else _arrows(by_step[k - 1], nodes)
        color = PHASE_COLORS.get(by_step[k - 1]["phase"].iloc[0], "#333") if k else "#333"
        frames.append(go.Frame(name=str(k), traces=[0, 1, 2], layout=dict(title=dict(text=title(k))), data=[
            go.Scatter(**slot_trace(counts[k])),
            go.Scatter(x=lines["x"], y=lines["y"], marker={**lines["marker"], "color": color},
                       line=dict(color=color, width=3)),
            go.Scatter(**labels, textfont=dict(color=color)),
        ]))
    fig = go.Figure(frames=frames)
    fig.add_trace(go.Scatter(x=slots[..., 0].ravel(), y=slots[..., 1].ravel(), mode="markers+text",
                             textfont=dict(size=max(8, int(marker_px * 0.5)), color="white"),
                             hoverinfo="text", name="chunk slots", showlegend=False, **slot_trace(counts[0])))
    fig.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", hoverinfo="skip", showlegend=False,
                             name="in flight", line=dict(width=3)))
    fig.add_trace(go.Scatter(x=[], y=[], mode="text", hoverinfo="text", showlegend=False, name="chunks",
                             textfont=dict(size=12)))
    fig.add_trace(go.Scatter(x=nodes[:, 0], y=nodes[:, 1], mode="markers+text", name="ranks",
                             text=[f"rank {r}" for r in range(n)], textposition="middle center",
                             marker=dict(size=52, color="white", line=dict(width=2, color="#333")),
                             hoverinfo="skip", showlegend=False))
    for name, color in (("own data", OWN), ("partially reduced", PARTIAL), ("fully reduced", FULL)):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name,
                                 marker=dict(symbol="square", size=12, color=color)))
    names = [f.name for f in frames]
    labels = ["start"] + [step_label(g["phase"].iloc[0], g["phase_step"].iloc[0]) for _, g in sorted(by_step.items())]
    fig.update_layout(
        title=dict(text=title(0), y=0.98), height=680,
        xaxis=dict(range=[-2.2, 2.2], visible=False), yaxis=dict(range=[-2.2, 2.2], visible=False,
                                                                 scaleanchor="x"),
        margin=dict(t=60, b=90, l=10, r=10), plot_bgcolor="white",
        legend=dict(orientation="h", x=0, y=1.0, yanchor="bottom"),
        meta={"frame_ms": durations, "step_ms": [float(x) for x in step_ms], "round": int(round_)},
        updatemenus=[dict(type="buttons", direction="left", x=0.0, y=0.0, yanchor="top", showactive=False,
                          pad=dict(t=30), buttons=[
            dict(label="▶ play", method="animate",
                 args=[names, {"frame": [{"duration": d, "redraw": True} for d in durations],
                               "transition": {"duration": 0}, "mode": "immediate", "fromcurrent": False}]),
            dict(label="❚❚ pause", method="animate",
                 args=[[None], {"frame": {"duration": 0, "redraw": False}, "mode": "immediate",
                                "transition": {"duration": 0}}]),
        ])],
        sliders=[dict(active=0, x=0.2, len=0.8, y=0.0, yanchor="top", pad=dict(t=20, b=0),
                      currentvalue=dict(prefix="frame: "), steps=[
                          dict(label=lab, method="animate",
                               args=[[nm], {"frame": {"duration": 0, "redraw": True}, "mode": "immediate",
                                            "transition": {"duration": 0}}])
                          for nm, lab in zip(names, labels)])],
    )
    return fig


def make_ring_step_figure(step_times: pd.DataFrame) -> go.Figure:
    """Per-step time on each rank (grouped bars, ms): communication (send + receive) and,
    in reduce-scatter, the time to add the received chunk in."""
    fig = go.Figure()
    labels = {int(s): step_label(g["phase"].iloc[0], g["phase_step"].iloc[0]) for s, g in step_times.groupby("step")}
    for rank, g in step_times.groupby("rank"):
        fig.add_trace(go.Bar(
            x=[labels[int(s)] for s in g["step"]], y=g["dur_ms"], name=f"rank {rank}",
            customdata=np.column_stack([g["comm_ms"], g["reduce_ms"], g["send_chunk"], g["recv_chunk"]]),
            hovertemplate="%{x} rank " + str(rank) + ": %{y:.3f} ms<br>send/recv %{customdata[0]:.3f} ms"
                          " · add %{customdata[1]:.3f} ms<br>sent c%{customdata[2]}, got c%{customdata[3]}"
                          "<extra></extra>"))
    fig.update_layout(barmode="group", height=320, title="Time per ring step and rank",
                      yaxis_title="ms", margin=dict(t=40, b=30, l=50, r=10))
    return fig
