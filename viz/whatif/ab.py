"""A against B: a traced run (A), the run again at another bucket setting (B), and what
the what-if predicted for B from A. Step medians side by side, bucket by bucket tables
and a diff timeline of one median step.

Per bucket (medians over usable steps and ranks, ms, from the rank's backward start):
``launch_ms``, ``flight_ms`` (launch to done) and ``exposed_ms``: the part of the
rank's wait after its backward compute (to its last gradient) that ends with this bucket,
i.e. ``done`` less the later of that end and every earlier bucket's done (never below 0).
A rank's buckets' exposed times add up to its step's exposed communication.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ddpscope.viz.ddp.compare import compute_waited_steps, difference_interval, within_noise
from ddpscope.viz.layout import LEGEND_BELOW
from ddpscope.viz.trace import RunTrace, compute_end
from ddpscope.viz.whatif.model import usable_steps
from ddpscope.viz.whatif.sweep import _medians

STEP_ROWS = ("step_ms", "exposed_ms", "comm_ms", "backward_ms")
BUCKET_FIELDS = ("mib", "launch_ms", "flight_ms", "exposed_ms")


def compute_bucket_timing(trace: RunTrace, per_step: bool = False) -> pd.DataFrame:
    """One row per bucket index: ``mib`` and the medians of ``launch_ms``,
    ``flight_ms`` and ``exposed_ms`` (see the module); ``backward_ms`` (backward compute)
    and ``step_ms`` (the rank's, the same on every row) for drawing. ``per_step``: a row
    per rank, step and bucket instead (``rank`` and ``step`` columns), no medians."""
    steps = usable_steps(trace)
    # backward compute ends at its last gradient (the span may run on, waiting in DDP's
    # finalize): the wait after it is the step's exposed communication
    s = trace.steps.assign(compute_end_us=compute_end(trace.steps)).set_index(["rank", "step"])
    rows = []
    for (rank, step), g in trace.buckets[trace.buckets["step"].isin(steps)].groupby(["rank", "step"]):
        st = s.loc[(rank, step)]
        b0, b1 = float(st["backward_start_us"]), float(st["compute_end_us"])
        g = g.sort_values("bucket")
        done_before = b1
        for row in g.itertuples():
            exposed = max(0.0, float(row.done_us) - done_before)
            done_before = max(done_before, float(row.done_us))
            rows.append({"rank": rank, "step": step, "bucket": int(row.bucket), "mib": row.bytes / 2**20,
                         "launch_ms": (row.launch_us - b0) / 1e3, "flight_ms": (row.done_us - row.launch_us) / 1e3,
                         "exposed_ms": exposed / 1e3, "backward_ms": (b1 - b0) / 1e3,
                         "step_ms": float(st["end_us"] - st["start_us"]) / 1e3})
    cols = ["bucket", *BUCKET_FIELDS, "backward_ms", "step_ms"]
    if per_step:
        return pd.DataFrame(rows, columns=["rank", "step", *cols])
    if not rows:
        return pd.DataFrame(columns=cols)
    return pd.DataFrame(rows).drop(columns=["rank", "step"]).groupby("bucket").median().reset_index()[cols]


def compute_bucket_ab(a: RunTrace, b: RunTrace, names: tuple[str, str] = ("A", "B")) -> pd.DataFrame:
    """Bucket by bucket, A beside B: ``<name> mib``, ``<name> launch_ms``, ``<name>
    flight_ms``, ``<name> exposed_ms`` for each; a bucket one run lacks is empty there."""
    ta, tb = compute_bucket_timing(a), compute_bucket_timing(b)
    cols = ["bucket", *BUCKET_FIELDS]
    out = ta[cols].merge(tb[cols], on="bucket", how="outer", suffixes=(f" {names[0]}", f" {names[1]}"))
    order = ["bucket"] + [f"{f} {n}" for f in BUCKET_FIELDS for n in names]
    return out[order].sort_values("bucket").reset_index(drop=True)


def compute_ab_steps(a: RunTrace, predicted: RunTrace, b: RunTrace) -> pd.DataFrame:
    """Rows step, exposed communication, communication and backward (medians over every
    measured step, each step the rank it waited for: ``compute_waited_steps``, ms);
    columns ``A measured``, ``B predicted``, ``B measured``,
    ``error %`` (predicted against measured), ``B - A measured`` with its 95 % interval
    (``B - A lo``, ``B - A hi``: each run's steps resampled, ``viz.ddp.compare``) and
    ``within noise`` (the interval holds 0: not a difference these runs can show)."""
    ma, mp, mb = _medians(a), _medians(predicted), _medians(b)
    ba, bb = compute_waited_steps(a), compute_waited_steps(b)
    rows = []
    for k in STEP_ROWS:
        err = 100.0 * (mp[k] - mb[k]) / mb[k] if mb[k] else np.nan
        _, lo, hi = difference_interval(ba, bb, k)
        rows.append({"median": k, "A measured": ma[k], "B predicted": mp[k], "B measured": mb[k], "error %": err,
                     "B - A measured": mb[k] - ma[k], "B - A lo": lo, "B - A hi": hi,
                     "within noise": within_noise(lo, hi)})
    return pd.DataFrame(rows)


def make_ab_timeline_figure(runs: dict[str, RunTrace], title: str = "A against B: one median step") -> go.Figure:
    """A median step of each run from its backward's start (ms): the backward as a bar,
    each bucket's all-reduce as a line from launch to done, its exposed part thick;
    runs one above the other, buckets in a cascade within each."""
    fig = go.Figure()
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    ticks = []
    for k, (name, trace) in enumerate(runs.items()):
        t = compute_bucket_timing(trace)
        y0 = -2.0 * k
        color = colors[k % len(colors)]
        ticks.append((y0, name))
        if not len(t):
            continue
        bwd = float(t["backward_ms"].median())
        fig.add_trace(go.Bar(x=[bwd], base=[0.0], y=[y0 + 0.45], orientation="h", width=0.25, name=f"{name}: backward",
                             marker_color="rgba(120,120,120,0.45)", hovertemplate="backward %{x:.1f} ms<extra></extra>"))
        n = len(t)
        xs, ys, xe, ye, text = [], [], [], [], []
        for i, row in enumerate(t.itertuples()):
            y = y0 + 0.25 - 1.2 * (i + 1) / (n + 1)
            xs += [row.launch_ms, row.launch_ms + row.flight_ms, None]
            ys += [y, y, None]
            end = row.launch_ms + row.flight_ms
            if row.exposed_ms > 0:
                xe += [end - row.exposed_ms, end, None]
                ye += [y, y, None]
            text += [f"bucket {row.bucket}: {row.mib:.2f} MiB, launch {row.launch_ms:.1f} ms, in flight "
                     f"{row.flight_ms:.1f} ms, exposed {row.exposed_ms:.1f} ms"] * 2 + [None]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(color=color, width=2), name=f"{name}: all-reduce",
                                 text=text, hovertemplate="%{text}<extra></extra>"))
        if xe:
            fig.add_trace(go.Scatter(x=xe, y=ye, mode="lines", line=dict(color=color, width=7),
                                     name=f"{name}: exposed", hoverinfo="skip", opacity=0.6))
        last = float((t["launch_ms"] + t["flight_ms"]).max())
        fig.add_trace(go.Scatter(x=[max(bwd, last)] * 2, y=[y0 - 1.0, y0 + 0.6], mode="lines", showlegend=False,
                                 line=dict(color=color, dash="dot"), hovertemplate=f"{name}: synced at %{{x:.1f}} ms"
                                                                                     "<extra></extra>"))
    fig.update_layout(title=title, barmode="overlay", height=220 + 160 * len(runs),
                      xaxis_title="ms from backward start (medians over steps and ranks)",
                      yaxis=dict(tickvals=[y for y, _ in ticks], ticktext=[n for _, n in ticks], zeroline=False),
                      legend=LEGEND_BELOW)
    return fig
