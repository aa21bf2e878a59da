"""The timeline (Gantt) figure: per rank, a compute lane and an all-reduce lane.

Built for size: one Plotly trace per category (forward, backward segments, waiting,
optimizer, buckets, exposed communication), each holding all its bars, never one trace
per bar; numbers as arrays, lanes as numeric positions (benchmarks/gantt.py); the lanes and
bars themselves are ``viz.lanes``'. Times on the x axis are ms from the start of the first
shown step (rank 0's clock; ranks are aligned).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import sample_colorscale

from ddpscope.viz.ddp.buckets import compute_bucket_events
from ddpscope.viz.ddp.stragglers import compute_launch_spread
from ddpscope.viz.intervals import merge_sorted_runs
from ddpscope.viz.lanes import (
    BUCKET_PALETTE,
    COLORS,
    GL_COLORS,
    GL_THRESHOLD,
    OVER_BUCKETS_WIDTH,
    TEXT_LIMIT,
    comm_lane,
    compute_lane,
    gl_hover,
    gl_lines,
    group_starts,
    lane_bars,
    select_steps,
)
from ddpscope.viz.layout import LEGEND_BELOW
from ddpscope.viz.trace import RunTrace, compute_end


def _short(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" … (+{len(names) - limit})" if len(names) > limit else "")


def _only(df: pd.DataFrame, shown: pd.DataFrame) -> pd.DataFrame:
    """Rows of ``df`` whose (rank, step) is among ``shown``'s."""
    if len(df) == 0:
        return df
    key = lambda d: d["rank"].to_numpy(np.int64) * (1 << 32) + d["step"].to_numpy(np.int64)  # noqa: E731
    mask = np.isin(key(df), key(shown))
    return df if mask.all() else df[mask]


def _cached(trace: RunTrace, key: str, make):
    """A table derived from every finished step, computed once per loaded trace."""
    if key not in trace.cache:
        trace.cache[key] = make(trace, select_steps(trace, include_warmup=True))
    return trace.cache[key]


def backward_segments(trace: RunTrace, shown: pd.DataFrame) -> pd.DataFrame:
    """Backward compute cut at gradient-ready times into per-module segments:
    rank, step, start_us, end_us, label (consecutive parameters of one module merge)."""
    return _only(_cached(trace, "backward_segments", _backward_segments), shown)


def exposed_segments(trace: RunTrace, shown: pd.DataFrame) -> pd.DataFrame:
    """All-reduce time after backward compute ended (what the overlap did not hide):
    rank, step, start_us, end_us, with overlapping all-reduces merged."""
    return _only(_cached(trace, "exposed_segments", _exposed_segments), shown)


def _sorted_per_step(events: pd.DataFrame, shown: pd.DataFrame, column: str, time_col: str,
                     by: tuple[str, ...] = ("rank", "step")):
    """``events`` of the shown steps with ``column`` of ``shown`` joined on ``by``, sorted
    by ``by`` and ``time_col``, and a mask of each group's first row; (None, None) if empty."""
    by = list(by)
    if len(events) == 0 or len(shown) == 0:
        return None, None
    df = events.join(shown.set_index(by)[column], on=by, how="inner")
    if len(df) == 0:
        return None, None
    df = df.sort_values([*by, time_col], kind="stable")
    return df, group_starts(df, by)


def shown_passes(trace: RunTrace, shown: pd.DataFrame) -> pd.DataFrame:
    """The forward/backward passes (micro-batches) of the shown steps; traces without a
    passes table give one pass per step, from the step's own columns."""
    p = trace.passes
    if len(p) == 0:
        cols = [c for c in ("rank", "step", "forward_start_us", "forward_end_us", "backward_start_us",
                            "backward_end_us", "compute_end_us", "sync_start_us", "sync_end_us") if c in shown]
        return shown[cols].assign(micro=0, sync=True)
    return _only(p, shown)


def _backward_segments(trace: RunTrace, shown: pd.DataFrame) -> pd.DataFrame:
    passes = shown_passes(trace, shown)
    grads = trace.grads if "micro" in trace.grads or len(trace.grads) == 0 else trace.grads.assign(micro=0)
    g, first = _sorted_per_step(grads, passes, "backward_start_us", "ready_us", by=("rank", "step", "micro"))
    if g is None:
        return pd.DataFrame(columns=["rank", "step", "start_us", "end_us", "label"])
    rank, step, ready = g["rank"].to_numpy(), g["step"].to_numpy(), g["ready_us"].to_numpy(float)
    names = g["name"].to_numpy()
    modules = {n: n.rsplit(".", 1)[0] for n in pd.unique(names)}  # a few hundred names, not one per row
    module = np.array([modules[n] for n in names], dtype=object)
    prev = np.where(first, g["backward_start_us"].to_numpy(float), np.r_[np.nan, ready[:-1]])
    starts = np.flatnonzero(first | np.r_[True, module[1:] != module[:-1]])
    return pd.DataFrame({
        "rank": rank[starts], "step": step[starts], "start_us": np.minimum.reduceat(prev, starts),
        "end_us": np.maximum.reduceat(ready, starts), "label": module[starts],
    })


def _exposed_segments(trace: RunTrace, shown: pd.DataFrame) -> pd.DataFrame:
    b, first = _sorted_per_step(trace.buckets, shown.assign(cut_us=compute_end(shown)), "cut_us", "launch_us")
    if b is None:
        return pd.DataFrame(columns=["rank", "step", "start_us", "end_us"])
    rank, step = b["rank"].to_numpy(), b["step"].to_numpy()
    launch, done, cut = (b[c].to_numpy(float) for c in ("launch_us", "done_us", "cut_us"))
    idx, m_end = merge_sorted_runs(first, launch, done)  # the all-reduces' union within each (rank, step)
    m_start = launch[idx]
    m_cut = cut[idx]
    keep = m_end > m_cut
    return pd.DataFrame({"rank": rank[idx][keep], "step": step[idx][keep],
                         "start_us": np.maximum(m_start, m_cut)[keep], "end_us": m_end[keep]})


def make_timeline_figure(trace: RunTrace, steps: Sequence[int] | None = None, ranks: Sequence[int] | None = None,
                         include_warmup: bool = False, title: str | None = None,
                         webgl: bool | None = None) -> go.Figure:
    """Gantt of backward compute against bucket all-reduces, per rank: a compute lane
    (forward, backward per module from gradient-ready times, waiting for the all-reduces,
    optimizer) and an all-reduce lane (one bar per bucket, coloured by bucket index, with
    the exposed part, after backward compute ended, hatched in red; under ZeRO-1 the
    optimizer's parameter broadcasts too, and DDP's all-reduce of its unused-parameter
    map where it runs one, apart from the buckets). ``webgl``: draw
    WebGL segments (True), SVG bars (False), or choose by size (None)."""
    if trace.source != "ddpscope":  # a profiler trace: kernels, not phases (that module builds on this one)
        from ddpscope.viz.ddp.kernel_gantt import make_kernel_timeline_figure

        return make_kernel_timeline_figure(trace, steps, ranks, title=title, webgl=webgl)
    shown = select_steps(trace, steps, ranks, include_warmup)
    if len(shown) == 0:
        return go.Figure(layout=dict(title=title or "no finished steps to show"))
    data: list[dict] = []
    origin = float(shown.loc[shown["rank"] == shown["rank"].min(), "start_us"].min())
    ranks_shown = sorted(shown["rank"].unique())
    # Lanes are numeric y positions (labelled by ticks): numbers travel as packed arrays,
    # strings one by one. Rank order top to bottom, compute above its all-reduce lane.
    pos = {r: 2 * (len(ranks_shown) - 1 - i) for i, r in enumerate(ranks_shown)}
    lane = lambda df: df["rank"].map(pos).to_numpy(float) + 1  # noqa: E731  compute lane
    comm = lambda df: df["rank"].map(pos).to_numpy(float)  # noqa: E731
    dur = lambda a, b: (np.asarray(b, float) - np.asarray(a, float)) / 1e3  # noqa: E731

    seg = backward_segments(trace, shown)
    ev = _only(_cached(trace, "bucket_events", lambda t, _: compute_bucket_events(t)), shown)
    ex = exposed_segments(trace, shown)
    gl = len(seg) + len(ev) + 3 * len(shown) > GL_THRESHOLD if webgl is None else webgl

    def phase(name, df, a, b, color, what):
        df = df.dropna(subset=[a, b])
        if len(df):
            data.extend(lane_bars(gl, name, lane(df), df[a], df[b], origin, color,
                                      what + " · step %{customdata[0]}<br>%{customdata[1]:.2f} ms",
                                      np.column_stack([df["step"], dur(df[a], df[b])])))

    passes = shown_passes(trace, shown)
    phase("forward", passes, "forward_start_us", "forward_end_us", COLORS["forward"], "forward")
    if len(seg):
        data.extend(lane_bars(
            gl, "backward (per module)", lane(seg), seg["start_us"], seg["end_us"], origin, COLORS["backward"],
            "backward · %{hovertext}<br>step %{customdata[0]} · %{customdata[1]:.2f} ms",
            np.column_stack([seg["step"], dur(seg["start_us"], seg["end_us"])]),
            text=seg["label"].tolist() if len(seg) <= TEXT_LIMIT else None, line=0.5))
    if "sync_end_us" in passes:  # from backward compute's end: a span past the last gradient is waiting too
        phase("waiting for all-reduce", passes[passes["sync"].astype(bool)].assign(wait_us=compute_end(passes)),
              "wait_us", "sync_end_us", COLORS["wait"], "waiting for the averaged gradients")
    if "optimizer_start_us" in shown:
        phase("optimizer.step", shown, "optimizer_start_us", "optimizer_end_us", COLORS["optimizer"], "optimizer.step")

    if len(ev):
        custom = np.column_stack([ev["step"], ev["duration_ms"], ev["bucket"], ev["bytes"] / 2**20,
                                  ev["launch_offset_ms"], ev["algbw_gbps"], ev["busbw_gbps"], ev["queued_ms"],
                                  ev["run_ms"]])
        text = [_short(p) for p in ev["params"]] if len(ev) <= TEXT_LIMIT else None
        hover = ("<b>bucket %{customdata[2]}</b> · step %{customdata[0]}<br>%{customdata[3]:.2f} MiB · "
                 "%{hovertext}<br>launch %{customdata[4]:.2f} ms after backward start<br>duration "
                 "%{customdata[1]:.2f} ms: queued %{customdata[7]:.2f} ms behind earlier buckets, running "
                 "%{customdata[8]:.2f} ms<br>algbw %{customdata[5]:.3f} GB/s · busbw %{customdata[6]:.3f} GB/s "
                 "(over the running time)")
        top = max(1, int(ev["bucket"].max()))
        if not gl:  # buckets are categories: a colour each from a qualitative palette (no colour bar)
            colors = [BUCKET_PALETTE[int(b) % len(BUCKET_PALETTE)] for b in ev["bucket"]]
            data.extend(lane_bars(
                gl, "bucket all-reduce", comm(ev), ev["launch_us"], ev["done_us"], origin,
                colors, hover, custom, text=text, line=0.5))
            queued = ev[ev["queued_ms"] > 0]
            if len(queued):  # NCCL's FIFO stream: the part of a bucket's span spent behind earlier ones
                data.extend(lane_bars(
                    gl, "queued behind earlier buckets", comm(queued), queued["launch_us"],
                    queued["launch_us"] + queued["queued_ms"] * 1e3, origin, "rgba(255,255,255,0.55)",
                    "bucket %{customdata[2]} · step %{customdata[0]}<br>queued %{customdata[1]:.2f} ms behind "
                    "earlier buckets (launched, not yet running)",
                    np.column_stack([queued["step"], queued["queued_ms"], queued["bucket"]]),
                    pattern=dict(shape="/", fgcolor="#555", size=6, solidity=0.3)))
        else:  # WebGL lines take one colour each: lines per bucket index, one hover layer
            idx = ev["bucket"].to_numpy()
            y, start = comm(ev), (ev["launch_us"].to_numpy(float) - origin) / 1e3
            end = (ev["done_us"].to_numpy(float) - origin) / 1e3
            # at most GL_COLORS traces: neighbouring bucket indices share a colour beyond that
            band = np.minimum((idx / top * GL_COLORS).astype(int), GL_COLORS - 1)
            uniq = np.unique(band)
            colors = sample_colorscale("Viridis", list((uniq + 0.5) / GL_COLORS))  # one call: it validates
            for n, (b, color) in enumerate(zip(uniq, colors)):
                m = band == b
                data.append(gl_lines("bucket all-reduce", y[m], start[m], end[m], color, 26, "buckets", n == 0))
            data.append(gl_hover("bucket all-reduce", y, start, end, custom,
                                    None, hover.replace("%{hovertext}", "(show fewer steps for names)")
                                    + "<extra></extra>", "buckets"))
    sync = shown.dropna(subset=["param_sync_start_us", "param_sync_end_us"]) if "param_sync_start_us" in shown \
        else shown.iloc[:0]
    if len(sync):  # ZeRO-1: the optimizer's parameter broadcasts, on the communication lane (all exposed)
        data.extend(lane_bars(
            gl, "parameter broadcast (ZeRO-1)", comm(sync), sync["param_sync_start_us"], sync["param_sync_end_us"],
            origin, COLORS["param_sync"], "parameter broadcast (ZeRO-1) · step %{customdata[0]}<br>%{customdata[1]:.2f} "
            "ms · %{customdata[2]:.3f} MiB (every rank's partition; the step waits for it)",
            np.column_stack([sync["step"], dur(sync["param_sync_start_us"], sync["param_sync_end_us"]),
                             sync["param_sync_bytes"] / 2**20])))
    own = shown.dropna(subset=["ddp_own_start_us", "ddp_own_end_us"]) if "ddp_own_start_us" in shown \
        else shown.iloc[:0]
    if len(own):  # DDP's own all-reduce of its unused-parameter map (find_unused_parameters): not a bucket
        data.extend(lane_bars(
            gl, "DDP's unused-parameter map", comm(own), own["ddp_own_start_us"], own["ddp_own_end_us"], origin,
            COLORS["ddp_own"], "DDP's unused-parameter map (all-reduce, not a bucket) · step %{customdata[0]}<br>"
            "%{customdata[1]:.2f} ms · %{customdata[2]:.0f} bytes",
            np.column_stack([own["step"], dur(own["ddp_own_start_us"], own["ddp_own_end_us"]), own["ddp_own_bytes"]]),
            gl_width=10, bar_width=OVER_BUCKETS_WIDTH))
    bufs = shown.dropna(subset=["buffer_sync_start_us", "buffer_sync_end_us"]) if "buffer_sync_start_us" in shown \
        else shown.iloc[:0]
    if len(bufs):  # DDP's broadcast of the module's buffers (BatchNorm's statistics) before a syncing forward
        data.extend(lane_bars(
            gl, "DDP's buffer broadcast", comm(bufs), bufs["buffer_sync_start_us"], bufs["buffer_sync_end_us"], origin,
            COLORS["buffer_sync"], "DDP's buffer broadcast (from rank 0, before the forward; not a bucket) · step "
            "%{customdata[0]}<br>%{customdata[1]:.2f} ms · %{customdata[2]:.0f} bytes",
            np.column_stack([bufs["step"], dur(bufs["buffer_sync_start_us"], bufs["buffer_sync_end_us"]),
                             bufs["buffer_sync_bytes"]]), gl_width=10, bar_width=OVER_BUCKETS_WIDTH))
    other = shown.dropna(subset=["other_comm_start_us", "other_comm_end_us"]) if "other_comm_start_us" in shown \
        else shown.iloc[:0]
    if len(other):  # the script's own collectives and DDP's outside its reducer: never buckets
        data.extend(lane_bars(
            gl, "other collectives (not buckets)", comm(other), other["other_comm_start_us"],
            other["other_comm_end_us"], origin, COLORS["other_comm"],
            "other collectives: the script's own, DDP's outside its buckets (not buckets) · step %{customdata[0]}<br>"
            "%{customdata[1]:.0f} of them, from the first's start to the last's end: %{customdata[2]:.2f} ms · "
            "%{customdata[3]:.0f} bytes",
            np.column_stack([other["step"], other["other_comm_count"],
                             dur(other["other_comm_start_us"], other["other_comm_end_us"]), other["other_comm_bytes"]]),
            gl_width=10, bar_width=OVER_BUCKETS_WIDTH))
    if len(ex):
        data.extend(lane_bars(
            gl, "exposed all-reduce (after backward)", comm(ex), ex["start_us"], ex["end_us"], origin,
            COLORS["exposed"], "exposed communication · step %{customdata[0]}<br>%{customdata[1]:.2f} ms",
            np.column_stack([ex["step"], dur(ex["start_us"], ex["end_us"])]),
            pattern=dict(shape="/", fgcolor="#E41A1C"), gl_width=10))
    spread = _only(_cached(trace, "launch_spread", lambda t, _: compute_launch_spread(t, include_warmup=True)
                           .rename(columns={"last_rank": "rank"})), shown)
    if len(spread):  # who every bucket waited for: a marker where the last rank launched it
        data.append(dict(
            type="scattergl" if gl else "scatter", mode="markers", name="launched last (the others wait)", x=(spread["last_launch_us"]
                                                                                       - origin) / 1e3,
            y=comm(spread) + 0.45, marker=dict(symbol="triangle-down", size=7, color="#E45756"),
            customdata=np.column_stack([spread["step"], spread["bucket"], spread["spread_ms"]]).astype(np.float32),
            hovertemplate="bucket %{customdata[1]} · step %{customdata[0]}<br>launched last here, "
                          "%{customdata[2]:.2f} ms after the first rank<extra></extra>"))
    # _validate=False: Plotly would otherwise turn ``base`` (an "any" property) into an
    # array of Python objects, element by element, and deep-copy every trace more than
    # once: most of the cost of a big figure. Inputs are numeric arrays built above, and
    # the tests check the figure's contents.
    fig = go.Figure(data=data, _validate=False)
    fig.update_layout(
        barmode="overlay", title=title, height=140 + 70 * 2 * len(ranks_shown), hovermode="closest",
        xaxis=dict(title="ms from the start of the first shown step", zeroline=False),
        yaxis=dict(tickvals=[p + d for r, p in pos.items() for d in (1, 0)],
                   ticktext=[name for r in pos for name in (compute_lane(r), comm_lane(r))],
                   range=[-0.6, 2 * len(ranks_shown) - 0.4], title=None, fixedrange=True),
        legend=LEGEND_BELOW, margin=dict(l=10, r=10, t=40, b=10), dragmode="zoom",
    )
    return fig
