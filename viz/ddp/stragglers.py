"""Stragglers: which rank every other rank's all-reduce waited for.

A bucket's all-reduce cannot finish before the last rank launched it (these are launch
times: a rank that arrives late shows from its first bucket on). Per step and
bucket (ranks aligned on rank 0's clock): the launch spread (last launch minus first,
ms) and the rank that launched last. Per rank and step, the wait it caused: for each
other rank, the longest time, over the buckets this rank launched last, between that
rank's launch and this one's (the waits of one step's buckets overlap, so the longest
stands for the step), averaged over the other ranks.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.trace import RunTrace


def compute_launch_spread(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """One row per step and bucket launched by every rank: first_launch_us, last_launch_us,
    spread_ms, last_rank (who launched last), ranks."""
    cols = ["step", "bucket", "first_launch_us", "last_launch_us", "spread_ms", "last_rank", "ranks"]
    b = _finished(trace, include_warmup)
    if len(b) == 0 or trace.world_size < 2:
        return pd.DataFrame(columns=cols)
    g = b.groupby(["step", "bucket"])
    out = g.agg(first_launch_us=("launch_us", "min"), last_launch_us=("launch_us", "max"),
                ranks=("rank", "nunique")).reset_index()
    last = b.loc[g["launch_us"].idxmax(), ["step", "bucket", "rank"]].rename(columns={"rank": "last_rank"})
    out = out.merge(last, on=["step", "bucket"])
    out = out[out["ranks"] == b["rank"].nunique()]  # launched everywhere
    out["spread_ms"] = (out["last_launch_us"] - out["first_launch_us"]) / 1e3
    return out[cols].reset_index(drop=True)


def compute_wait_caused(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """Per rank and step: wait_caused_ms (how long the others waited for this rank's
    launches), last_launches (buckets it launched last) and buckets."""
    cols = ["rank", "step", "wait_caused_ms", "last_launches", "buckets"]
    b = _finished(trace, include_warmup)
    if len(b) == 0 or b["rank"].nunique() < 2:
        return pd.DataFrame(columns=cols)
    wide = b.pivot_table(index=["step", "bucket"], columns="rank", values="launch_us", aggfunc="first").dropna()
    ranks = list(wide.columns)
    launch = wide.to_numpy(float)
    last = launch.argmax(axis=1)
    steps = wide.index.get_level_values("step").to_numpy()
    rows = []
    for step in np.unique(steps):
        m = steps == step
        for i, r in enumerate(ranks):
            mine = m & (last == i)
            if mine.any():
                others = [j for j in range(len(ranks)) if j != i]
                waits = [float((launch[mine, i] - launch[mine, j]).max()) for j in others]
                wait = float(np.mean(waits)) / 1e3
            else:
                wait = 0.0
            rows.append({"rank": int(r), "step": int(step), "wait_caused_ms": wait,
                         "last_launches": int(mine.sum()), "buckets": int(m.sum())})
    return pd.DataFrame(rows, columns=cols)


def compute_straggler_summary(trace: RunTrace) -> pd.DataFrame:
    """Per rank, over non-warm-up steps: ``launch_delay_ms``, how late it launched each
    step's first bucket after the first rank did (median over its steps: how late it
    arrives, as ``viz.ddp.rank_overview`` reads it, so the straggler line and the slowest
    rank line say one number of one rank); ``wait_caused_ms``, the median wait it caused
    per step (at least the launch delay: a late rank's backward can fall further behind);
    the share of buckets it launched last (%), and the median spread of those (ms)."""
    cols = ["rank", "launch_delay_ms", "wait_caused_ms", "last_launch_pct", "spread_ms"]
    w = compute_wait_caused(trace)
    if len(w) == 0:
        return pd.DataFrame(columns=cols)
    s = compute_launch_spread(trace)
    out = w.groupby("rank").agg(wait_caused_ms=("wait_caused_ms", "median"), last=("last_launches", "sum"),
                                buckets=("buckets", "sum")).reset_index()
    out["last_launch_pct"] = 100.0 * out.pop("last") / out.pop("buckets")
    spread = s.groupby("last_rank")["spread_ms"].median()
    out["spread_ms"] = out["rank"].map(spread).fillna(0.0)
    first = _finished(trace, False).groupby(["rank", "step"])["launch_us"].min()  # each rank's first launch
    delay = (first - first.groupby(level="step").transform("min")) / 1e3
    out["launch_delay_ms"] = out["rank"].map(delay.groupby(level="rank").median()).fillna(0.0)
    return out[cols]


def straggler_line(s: pd.DataFrame, min_ms: float = 1.0) -> str | None:
    """One sentence naming the rank the others waited for most (``s``: a
    ``compute_straggler_summary`` table), or None below ``min_ms``."""
    if len(s) == 0:
        return None
    top = s.sort_values("wait_caused_ms", ascending=False).iloc[0]
    if top["wait_caused_ms"] < min_ms:
        return None
    return (f"straggler: rank {int(top['rank'])} launched last in {top['last_launch_pct']:.0f}% of buckets, its first "
            f"all-reduce of a step {top['launch_delay_ms']:.1f} ms after the others' first; they waited {top['wait_caused_ms']:.1f} ms per step "
            "for it (medians)")


def _finished(trace: RunTrace, include_warmup: bool) -> pd.DataFrame:
    b, s = trace.buckets, trace.steps
    if len(b) == 0 or len(s) == 0:
        return b
    keep = ~s["incomplete"]
    if not include_warmup and "warmup" in s:
        keep &= ~s["warmup"]
    ok = s.loc[keep, ["step"]].drop_duplicates()
    b = b[~b["incomplete"].astype(bool)] if "incomplete" in b else b
    return b.merge(ok, on="step")
