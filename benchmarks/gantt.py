"""Timeline figure at scale: 8 ranks x 100 steps x 50 buckets (and 100 parameters).

Builds ``viz.ddp.gantt.make_timeline_figure`` and a ``plotly.express.timeline`` baseline
over the same bars (one row per bar, coloured by kind) in the same run, and prints the
ratios for building the figure and for building plus JSON serialisation (what
Streamlit ships to the browser). Both use the same derived tables (backward segments,
exposed intervals), cached per loaded trace as in the app; the first, uncached build is
printed too.
Target: >= 10x faster than the baseline.

    python -m benchmarks.gantt [--ranks 8] [--steps 100] [--buckets 50] [--repeat 3] [--smoke]

Benchmarks are not tests: nothing is asserted; ``--smoke`` runs tiny sizes once.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.express as px

from ddpscope.viz.ddp.gantt import backward_segments, exposed_segments, make_timeline_figure
from ddpscope.viz.lanes import select_steps
from ddpscope.viz.trace import RunTrace


def synthetic_trace(ranks: int, steps: int, buckets: int, params: int = 100, seed: int = 0) -> RunTrace:
    """A trace shaped like a real one: forward, backward with gradients ready in reverse
    order, buckets launched as their last gradient is ready, then the optimizer."""
    rng = np.random.default_rng(seed)
    srows, brows, grows = [], [], []
    names = [f"layers.{i // 2}.{'weight' if i % 2 else 'bias'}" for i in range(params)]
    per_bucket = params // buckets
    for r in range(ranks):
        t = rng.uniform(0, 500)
        for s in range(steps):
            fwd, bwd, opt = 20_000 * rng.uniform(0.9, 1.1), 40_000 * rng.uniform(0.9, 1.1), 10_000
            bs, be = t + fwd + 500, t + fwd + 500 + bwd
            ready = np.sort(rng.uniform(bs, be, params))
            for i, tr in enumerate(ready):
                grows.append((r, s, params - 1 - i, names[params - 1 - i], tr))
            done = be
            for b in range(buckets):
                launch = ready[min((b + 1) * per_bucket, params) - 1]
                done = max(done - 2_000, launch) + rng.uniform(500, 3_000)
                brows.append((r, s, b, 1 << 20, per_bucket, names[b * per_bucket:(b + 1) * per_bucket], launch, done, False))
            sync = max(be, done) + 200
            srows.append(dict(rank=r, step=s, warmup=s == 0, incomplete=False, start_us=t, end_us=sync + opt,
                              forward_start_us=t, forward_end_us=t + fwd, backward_start_us=bs, backward_end_us=be,
                              sync_start_us=be, sync_end_us=sync, optimizer_start_us=sync, optimizer_end_us=sync + opt))
            t = sync + opt + 1_000
    return RunTrace(
        path=Path("synthetic"), run={"world_size": ranks, "status": "complete"}, ranks={},
        steps=pd.DataFrame(srows),
        buckets=pd.DataFrame(brows, columns=["rank", "step", "bucket", "bytes", "num_params", "params", "launch_us",
                                             "done_us", "incomplete"]),
        grads=pd.DataFrame(grows, columns=["rank", "step", "param", "name", "ready_us"]),
        memory=pd.DataFrame(),
    )


def baseline_figure(trace: RunTrace):
    """The obvious way: one row per bar into px.timeline (datetime axis, colour by kind)."""
    shown = select_steps(trace, include_warmup=True)
    parts = [
        shown.assign(kind="forward", lane=shown["rank"].map("rank {} compute".format),
                     start=shown["forward_start_us"], end=shown["forward_end_us"]),
        shown.assign(kind="optimizer", lane=shown["rank"].map("rank {} compute".format),
                     start=shown["optimizer_start_us"], end=shown["optimizer_end_us"]),
    ]
    seg = backward_segments(trace, shown)
    parts.append(seg.assign(kind="backward", lane=seg["rank"].map("rank {} compute".format),
                            start=seg["start_us"], end=seg["end_us"]))
    b = trace.buckets
    parts.append(b.assign(kind="bucket " + b["bucket"].astype(str), lane=b["rank"].map("rank {} all-reduce".format),
                          start=b["launch_us"], end=b["done_us"]))
    ex = exposed_segments(trace, shown)
    parts.append(ex.assign(kind="exposed", lane=ex["rank"].map("rank {} all-reduce".format),
                           start=ex["start_us"], end=ex["end_us"]))
    df = pd.concat([p[["kind", "lane", "start", "end"]] for p in parts], ignore_index=True)
    df["start"] = pd.to_datetime(df["start"], unit="us")
    df["end"] = pd.to_datetime(df["end"], unit="us")
    return px.timeline(df, x_start="start", x_end="end", y="lane", color="kind")


def _time(fn, repeat: int) -> tuple[float, float]:
    """Median seconds to build, and to build and serialise to JSON."""
    build, total = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fig = fn()
        t1 = time.perf_counter()
        fig.to_json()
        build.append(t1 - t0)
        total.append(time.perf_counter() - t0)
    return statistics.median(build), statistics.median(total)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--buckets", type=int, default=50)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: the script runs, nothing more")
    args = p.parse_args()
    if args.smoke:
        args.ranks, args.steps, args.buckets, args.repeat = 2, 3, 4, 1
    trace = synthetic_trace(args.ranks, args.steps, args.buckets)
    t0 = time.perf_counter()
    make_timeline_figure(trace, include_warmup=True)  # fills the per-trace cache both figures use
    cold = time.perf_counter() - t0
    ours = _time(lambda: make_timeline_figure(trace, include_warmup=True), args.repeat)
    base = _time(lambda: baseline_figure(trace), args.repeat)
    fig = make_timeline_figure(trace, include_warmup=True)
    bars = sum(len(t.x) for t in fig.data if t.type == "bar" or t.mode == "markers")  # one hover point per bar
    print(f"{args.ranks} ranks x {args.steps} steps x {args.buckets} buckets: {bars} bars, "
          f"{len(fig.data)} traces (baseline: {len(baseline_figure(trace).data)} traces)")
    print(f"  make_timeline_figure   build {ours[0] * 1e3:8.1f} ms   build + to_json {ours[1] * 1e3:8.1f} ms"
          f"   (median of {args.repeat})")
    print(f"  make_timeline_figure   first build on a freshly loaded trace {cold * 1e3:8.1f} ms (derived tables cached)")
    print(f"  px.timeline baseline   build {base[0] * 1e3:8.1f} ms   build + to_json {base[1] * 1e3:8.1f} ms")
    print(f"  speed-up: build {base[0] / ours[0]:.1f}x, build + to_json {base[1] / ours[1]:.1f}x   (target >= 10x)")


if __name__ == "__main__":
    main()
