"""DeepSpeed's gradient buckets, one row each, from a sharded trace's collectives: ZeRO
reduces gradients in buckets of ``reduce_bucket_size`` elements (an all-reduce at stages
1-2, a reduce-scatter at stage 3), numbered in the order a micro-batch reduces them: with
gradient accumulation DeepSpeed reduces the same buckets again in each micro-batch it
reduces in (every one at stage 2), so bucket k is one row, reduced ``micro_batches`` times
a step. FSDP2's traces have no buckets (its reductions are per unit): the table is empty
for them."""

from __future__ import annotations

import pandas as pd

from ddpscope.viz.sharded.exposed import with_exposed
from ddpscope.viz.sharded.trace import real_steps

BUCKET_COLUMNS = ["bucket", "collective", "unit", "first_param", "last_param", "params", "micro_batches", "calls",
                  "bytes", "ms", "exposed_ms", "reduce_ms", "start_ms"]


def compute_bucket_table(trace) -> pd.DataFrame:
    """One row per bucket number: the unit and parameters it held (its first and last,
    how many), the collective, per step the micro-batches that reduced it, its calls (a
    bucket larger than DeepSpeed's chunk is sent in several; once per such micro-batch),
    bytes (the message: the whole bucket, each time), ms and exposed ms, the whole
    reduction on the training thread (``reduce_ms``: DeepSpeed's copies and bookkeeping
    around its collectives too; NaN in traces before it), and when it first started after
    its step did (``start_ms``); medians over ranks and non-warm-up steps."""
    colls = with_exposed(trace)
    colls = colls[colls["bucket"].notna() & colls["step"].isin(real_steps(trace))]
    if colls.empty:
        return pd.DataFrame(columns=BUCKET_COLUMNS)
    starts = trace.steps.set_index(["rank", "step"])["start_us"]
    colls = colls.assign(start_ms=[(s - starts.get((r, k), s)) / 1e3 for r, k, s in
                                   zip(colls["rank"], colls["step"], colls["start_us"])])
    per_step = colls.groupby(["bucket", "rank", "step"]).agg(
        collective=("collective", "first"), unit=("name", "first"), first_param=("first_param", "first"),
        last_param=("last_param", "first"), params=("bucket_params", "first"), micro_batches=("micro", "nunique"),
        calls=("bytes", "size"),
        bytes=("bytes", "sum"), ms=("ms", "sum"), exposed_ms=("exposed_ms", "sum"), start_ms=("start_ms", "min"))
    # a reduction's calls share its time: once per micro-batch that reduced the bucket
    held = colls.groupby(["bucket", "rank", "step", "micro"])["bucket_reduce_us"].first()
    per_step["reduce_ms"] = held.groupby(level=["bucket", "rank", "step"]).sum(min_count=1) / 1e3
    text = per_step.groupby("bucket")[["collective", "unit", "first_param", "last_param"]].first()
    numbers = per_step.groupby("bucket")[["params", "micro_batches", "calls", "bytes", "ms", "exposed_ms",
                                          "reduce_ms", "start_ms"]].median()
    out = text.join(numbers).reset_index()
    out["bucket"] = out["bucket"].astype(int)
    for col in ("params", "micro_batches", "calls", "bytes"):  # counts: whole unless ranks or steps differ
        if (out[col] % 1 == 0).all():
            out[col] = out[col].astype(int)
    return out[BUCKET_COLUMNS]
