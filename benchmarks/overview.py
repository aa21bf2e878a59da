"""The rank overview at scale: 1,024 ranks x 100 steps, built and drawn in a real browser.

    python -m benchmarks.overview [--ranks 1024] [--steps 100] [--repeat 3] [--smoke]

Builds an overview table shaped like a real run's (``viz.ddp.rank_overview``: step time,
exposed communication, backward, launch delay per rank and step; per-rank speeds and
step-to-step jitter, one slow rank), then, side by side:

- the heatmap (``make_rank_heatmap_figure``: one trace, the grid as one array) and the
  spread per step, as the Timeline draws them;
- a baseline of one scatter point per rank and step (what a per-rank line or bar chart
  would ship).

For each: the figure's build time, its JSON size (what Streamlit ships), and the time
headless Chromium (Debian's, through Playwright) takes from loading a page that holds
it (plotly.js inlined, no network) to the plot drawn: each page parses plotly.js anew,
about 0.8 s of each figure's time here, which the dashboard pays once. Also checks the slow rank comes
first in ``compute_slow_ranks``. Goal (issue 22): drawn in <= 2 s at 1,024 x 100.
Benchmarks are not tests: nothing is asserted; ``--smoke``: 16 ranks x 10 steps once.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ddpscope.viz.ddp.rank_overview import (
    compute_slow_ranks,
    make_rank_heatmap_figure,
    make_step_spread_figure,
)

CHROMIUM = "/usr/bin/chromium"


def synthetic_overview(ranks: int, steps: int, slow: int, seed: int = 0) -> pd.DataFrame:
    """Rows as ``compute_rank_overview`` gives them: each rank its own speed (±5 %), each
    step ±3 % jitter, rank ``slow`` 40 ms late to every all-reduce (the others wait)."""
    rng = np.random.default_rng(seed)
    r, s = np.meshgrid(np.arange(ranks), np.arange(steps), indexing="ij")
    speed = rng.normal(1.0, 0.05, ranks)[:, None]
    compute = 80.0 * speed * rng.normal(1.0, 0.03, (ranks, steps))
    delay = np.abs(rng.normal(0.0, 1.0, (ranks, steps)))
    delay[slow] += 40.0
    step = compute.max(axis=0) + 40.0 + 20.0  # everyone waits for the slowest, then communicates
    exposed = step[None, :] - compute
    return pd.DataFrame({"rank": r.ravel(), "step": s.ravel(), "step_ms": np.broadcast_to(step, (ranks, steps)).ravel(),
                         "exposed_ms": exposed.ravel(), "backward_ms": (compute * 0.6).ravel(),
                         "compute_ms": compute.ravel(), "launch_delay_ms": delay.ravel()})


def baseline_figure(overview: pd.DataFrame) -> go.Figure:
    """One marker per rank and step (a scatter coloured by the value)."""
    return go.Figure(go.Scatter(x=overview["step"], y=overview["rank"], mode="markers",
                                marker=dict(color=overview["step_ms"], colorscale="Viridis", size=4)))


def draw_ms(page, fig: go.Figure, folder: Path, name: str) -> float:
    """Load a page holding ``fig`` (plotly.js inlined) and wait until Plotly drew it."""
    path = folder / f"{name}.html"
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    t0 = time.perf_counter()
    page.goto(path.as_uri(), timeout=120_000)
    page.wait_for_function("() => { const g = document.querySelector('.js-plotly-plot'); "
                           "return g && g._fullLayout && g.querySelector('.heatmaplayer image, .scatterlayer .trace'); }",
                           timeout=120_000)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="16 ranks x 10 steps once: the script runs, nothing more")
    args = p.parse_args()
    if args.smoke:
        args.ranks, args.steps, args.repeat = 16, 10, 1
    slow_rank = args.ranks * 2 // 3
    overview = synthetic_overview(args.ranks, args.steps, slow_rank)
    t0 = time.perf_counter()
    slow = compute_slow_ranks(overview)
    ranked_ms = (time.perf_counter() - t0) * 1e3
    figures = {"heatmap (ours)": lambda: make_rank_heatmap_figure(overview, "step_ms"),
               "spread per step (ours)": lambda: make_step_spread_figure(overview, "step_ms"),
               "scatter per rank and step": lambda: baseline_figure(overview)}
    from playwright.sync_api import sync_playwright

    rows = {name: {"build": [], "json": 0.0, "draw": []} for name in figures}
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        for k in range(args.repeat):
            for n, (name, build) in enumerate(figures.items()):
                t = time.perf_counter()
                fig = build()
                rows[name]["build"].append((time.perf_counter() - t) * 1e3)
                rows[name]["json"] = len(fig.to_json()) / 2**20
                rows[name]["draw"].append(draw_ms(page, fig, Path(tmp), f"f{n}-{k}"))
        browser.close()
    print(f"{args.ranks} ranks x {args.steps} steps; slow rank {slow_rank}: ranked first by compute_slow_ranks: "
          f"{int(slow['rank'].iloc[0]) == slow_rank} ({ranked_ms:.0f} ms)")
    print(f"{'figure':28} {'build ms':>9} {'JSON MiB':>9} {'load+draw ms':>13}   (medians of {args.repeat})")
    for name, r in rows.items():
        print(f"{name:28} {statistics.median(r['build']):9.0f} {r['json']:9.2f} {statistics.median(r['draw']):13.0f}")
    ours = statistics.median(rows["heatmap (ours)"]["draw"]) + statistics.median(rows["spread per step (ours)"]["draw"])
    print(f"overview drawn (heatmap + spread): {ours / 1e3:.2f} s (goal <= 2 s); baseline scatter / heatmap draw: "
          f"{statistics.median(rows['scatter per rank and step']['draw']) / statistics.median(rows['heatmap (ours)']['draw']):.1f}x")


if __name__ == "__main__":
    main()
