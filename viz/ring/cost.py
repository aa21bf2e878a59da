"""The ring all-reduce cost model, fitted to a measured ring, and its what-if over N.

The alpha-beta model (Thakur et al.; Patarasuk & Yuan): a ring all-reduce of M bytes
over N ranks takes 2(N-1) steps, each paying a latency ``a`` and moving M/N bytes at
bandwidth ``B``::

    T(N, M) = 2(N-1) a + 2(N-1)/N * M / B

The bandwidth term tends to 2M/B as N grows: per-rank traffic is bounded, which is why
rings scale; the latency term grows linearly in N. The model leaves out the time to add
received chunks (on CPU it is in the measured steps, so it is folded into the fit).

A single tensor size cannot separate a from B; the ring job therefore also runs two
small calibration sizes, and the fit uses every size's median time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ddpscope.viz.layout import LEGEND_BELOW
from ddpscope.viz.ring.metrics import compute_ring_rounds, ring_factor
from ddpscope.viz.ring.trace import RingTrace

MAX_WHATIF_N = 64


@dataclass(frozen=True, kw_only=True)
class RingCostModel:
    """``alpha_us``: per-step latency (µs); ``bandwidth_GBps``: per-link bandwidth B in
    GB/s (10^9 bytes/s). ``sizes``: distinct tensor sizes the fit used; with one size the
    latency is not identifiable and is set to 0 (``latency_fitted`` False)."""

    alpha_us: float
    bandwidth_GBps: float
    sizes: int = 0
    latency_fitted: bool = True

    def __post_init__(self) -> None:
        if not (self.alpha_us >= 0 and np.isfinite(self.alpha_us)):
            raise ValueError(f"latency alpha must be >= 0 µs, got {self.alpha_us}")
        if not (self.bandwidth_GBps > 0 and np.isfinite(self.bandwidth_GBps)):
            raise ValueError(f"bandwidth B must be > 0 GB/s, got {self.bandwidth_GBps}")

    def time_us(self, n, size_bytes) -> np.ndarray:
        """Predicted ring all-reduce time (µs) for N ranks (array-like) and M bytes."""
        n = np.asarray(n, dtype=float)
        return 2 * (n - 1) * self.alpha_us + ring_factor(n) * size_bytes / (self.bandwidth_GBps * 1e3)


def fit_ring_cost(trace: RingTrace) -> RingCostModel:
    """Least-squares fit of a and B to the median ring time of each size (timed rounds).
    Raises ``ValueError`` if no timed round finished."""
    r = compute_ring_rounds(trace)
    r = r[~r["warmup"] & r["ring_ms"].notna()]
    if not len(r):
        raise ValueError("no timed ring round to fit the cost model to")
    med = r.groupby("bytes")["ring_ms"].median()
    n = trace.world_size
    m = med.index.to_numpy(float)
    t_us = med.to_numpy(float) * 1e3
    x_lat = np.full_like(m, 2.0 * (n - 1))
    x_bw = ring_factor(n) * m  # bytes; coefficient 1/B in µs per byte
    if len(m) >= 2:
        (alpha, inv_b), *_ = np.linalg.lstsq(np.column_stack([x_lat, x_bw]), t_us, rcond=None)
        if alpha >= 0 and inv_b > 0:
            return RingCostModel(alpha_us=float(alpha), bandwidth_GBps=float(1e-3 / inv_b), sizes=len(m))
        if inv_b <= 0:  # noise swamped the size dependence: latency only would be meaningless
            inv_b = float(np.sum(x_bw * t_us) / np.sum(x_bw * x_bw))
            return RingCostModel(alpha_us=0.0, bandwidth_GBps=float(1e-3 / inv_b), sizes=len(m),
                                 latency_fitted=False)
    # One size, or a negative latency: bandwidth only, through the origin.
    inv_b = float(np.sum(x_bw * t_us) / np.sum(x_bw * x_bw))
    return RingCostModel(alpha_us=0.0, bandwidth_GBps=float(1e-3 / inv_b), sizes=len(m), latency_fitted=False)


def compute_ring_fit(trace: RingTrace, model: RingCostModel) -> pd.DataFrame:
    """How well ``model`` fits the ring's own times: per tensor size (timed rounds),
    bytes, MiB, ring_ms (measured median), model_ms (the alpha-beta time), error_pct
    (model against measured)."""
    r = compute_ring_rounds(trace)
    med = r[~r["warmup"] & r["ring_ms"].notna()].groupby("bytes")["ring_ms"].median()
    model_ms = model.time_us(trace.world_size, med.index.to_numpy(float)) / 1e3
    return pd.DataFrame({"bytes": med.index, "MiB": med.index / 2**20, "ring_ms": med.to_numpy(),
                         "model_ms": model_ms, "error_pct": (model_ms / med.to_numpy() - 1) * 100})


def link_GBps(trace: RingTrace) -> float | None:
    """The emulated nodes' link rate (GB/s, 10^9 bytes/s) the ring ran over; None when it
    did not run on emulated nodes."""
    lab = trace.run.get("emulation")
    try:
        return float(lab["link_bps"]) / 8e9 if isinstance(lab, dict) else None
    except (KeyError, TypeError, ValueError):
        return None


def describe_fit(trace: RingTrace, model: RingCostModel) -> str:
    """The fit in a sentence, against the emulated link's rate when there is one."""
    text = (f"alpha-beta fit to {model.sizes} tensor sizes: a = {model.alpha_us:.1f} µs per step, "
            f"B = {model.bandwidth_GBps:.4g} GB/s" + ("" if model.latency_fitted else
                                                     " (latency not separable from this trace; set to 0)"))
    link = link_GBps(trace)
    if link is None:
        return text
    lab = trace.run["emulation"]
    ref = compute_ring_rounds(trace)
    ref = ref[~ref["warmup"] & (ref["bytes"] == trace.size_bytes)]["ref_busbw_GBps"].median()
    return (f"{text}; over {lab.get('nodes')} emulated nodes' {lab.get('link')} links ({link:.4g} GB/s): B is "
            f"{model.bandwidth_GBps / link:.0%} of the link, dist.all_reduce's busbw {ref / link:.0%}")


def compute_ring_whatif(model: RingCostModel, size_bytes: float, n_max: int = MAX_WHATIF_N) -> pd.DataFrame:
    """Predicted ring all-reduce for N = 2 .. ``n_max``: n, latency_ms, bandwidth_ms,
    total_ms, volume_bytes (sent per rank), volume_over_M (tends to 2)."""
    if not 2 <= n_max <= 4096:
        raise ValueError(f"n_max must be in 2..4096, got {n_max}")
    if not size_bytes > 0:
        raise ValueError(f"size must be > 0 bytes, got {size_bytes}")
    n = np.arange(2, n_max + 1)
    lat = 2 * (n - 1) * model.alpha_us / 1e3
    total = model.time_us(n, size_bytes) / 1e3
    vol = ring_factor(n) * size_bytes
    return pd.DataFrame({"n": n, "latency_ms": lat, "bandwidth_ms": total - lat, "total_ms": total,
                         "volume_bytes": vol, "volume_over_M": vol / size_bytes})


def make_ring_whatif_figure(whatif: pd.DataFrame, size_bytes: float,
                            measured: list[tuple[int, float]] | None = None) -> go.Figure:
    """Left: predicted time vs N (latency and bandwidth terms stacked), with measured
    (N, ms) points; right: bytes each rank sends vs N, approaching 2M."""
    mib = size_bytes / 2**20
    whatif = {k: whatif[k].tolist() for k in ("n", "latency_ms", "bandwidth_ms", "volume_bytes")}  # 63 points: plain JSON
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"Predicted ring all-reduce time, M = {mib:.4g} MiB", "Bytes sent per rank: 2(N-1)/N x M"))
    fig.add_trace(go.Scatter(x=whatif["n"], y=whatif["bandwidth_ms"], name="bandwidth term 2(N-1)/N·M/B",
                             mode="lines", stackgroup="t", line=dict(color="#1f77b4")), row=1, col=1)
    fig.add_trace(go.Scatter(x=whatif["n"], y=whatif["latency_ms"], name="latency term 2(N-1)·a",
                             mode="lines", stackgroup="t", line=dict(color="#ff7f0e")), row=1, col=1)
    if measured:
        fig.add_trace(go.Scatter(x=[p[0] for p in measured], y=[p[1] for p in measured], mode="markers",
                                 name="measured (median)", marker=dict(color="black", size=10, symbol="x")),
                      row=1, col=1)
    fig.add_trace(go.Scatter(x=whatif["n"], y=[v / 2**20 for v in whatif["volume_bytes"]], mode="lines+markers",
                             name="sent per rank (MiB)", marker=dict(size=4), line=dict(color="#2ca02c")),
                  row=1, col=2)
    fig.add_trace(go.Scatter(x=[2, int(max(whatif["n"]))], y=[2 * mib, 2 * mib], mode="lines",
                             name="2M (limit)", line=dict(color="gray", dash="dash")), row=1, col=2)
    fig.update_xaxes(title_text="ranks N", row=1, col=1)
    fig.update_xaxes(title_text="ranks N", row=1, col=2)
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="MiB", rangemode="tozero", row=1, col=2)
    fig.update_layout(height=430, margin=dict(t=50, b=100, l=50, r=20), legend=LEGEND_BELOW)
    return fig
