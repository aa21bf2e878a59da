"""DeepSpeed's gradient buckets at another ``reduce_bucket_size``: the buckets a rerun
would reduce and the step it would take, from one trace of the run.

Layout (exact): ZeRO adds each parameter's gradient to a bucket as it becomes ready and
first reduces the bucket when the parameter would not fit in it: the bucket's elements
plus the parameter's over ``reduce_bucket_size`` (stages 1-2,
``reduce_independent_p_g_buckets_and_remove_grads``; stage 3,
``reduce_ready_partitions_and_remove_grads``: a parameter larger than the size goes
alone); what is left is reduced when the backward ends. The trace lists each bucket's
parameters' elements in the order they were added (``bucket_numels``); set end to end
per micro-batch they are the gradients in the order ZeRO takes them (as they become
ready; stage 1 without ``overlap_comm``: in parameter order once the backward ends),
which the size does not move, so ``recut`` at another size gives the rerun's buckets
(tests/viz/sharded/test_deepspeed_peak.py: against real reruns, stages 1-3).

Time (a model): a bucket's reduction costs what the run's own cost for their size
(``bucket_cost``): a line through them (one point per bucket and micro-batch: its whole
reduction on the training thread, DeepSpeed's own copies and bookkeeping around its
collectives included, against its bytes; the ``AllReduceCost`` DDP's what-if fits). A
run whose buckets are all one size (or a few large ones) cannot tell a fixed cost per
reduction from bandwidth: there the fixed cost is what the run's own small all-reduces
outside its buckets held the training thread, on average (``in_situ_latency``: ZeRO's
gradient-norm all-reduce, every step and rank), and the buckets' time beyond it is per
byte; where the run has none, a calibration of these ranks in the run folder (``ddpscope
calibrate``), its all-reduce curve scaled to the run's reductions. The step changes by the new
buckets' cost less the run's buckets' cost on the same line: a reduction holds the
training thread (on gloo, DeepSpeed's CPU accelerator, its collectives too). On CUDA with
``overlap_comm`` the collectives run on DeepSpeed's own stream and this counts the host's
part only. At the run's own size the prediction is the run. A bucket reduced in several
calls (a message over DeepSpeed's chunk) is costed as one. Traces made before the whole
reduction was timed are not costed (the step is not predicted; their buckets are).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sharded.exposed import with_exposed
from ddpscope.viz.sharded.metrics import real_sharded_steps
from ddpscope.viz.sharded.trace import real_steps
from ddpscope.viz.whatif.cost import AllReduceCost, fit_line, read_calibration

MIB = 2**20
SMALL_ALL_REDUCE_BYTES = 64 * 1024  # latency alone: at this machine's ~0.7 GB/s, 0.1 ms of bandwidth
MIN_IN_SITU = 5  # fewer small all-reduces than this say nothing of their mean


def recut(numels, bucket_elements: int) -> list[int]:
    """The buckets (elements each, in reduction order) DeepSpeed makes of gradients of
    ``numels`` elements ready in that order at ``reduce_bucket_size`` = ``bucket_elements``."""
    if bucket_elements < 1:
        raise ValueError(f"reduce_bucket_size must be >= 1 element, got {bucket_elements}")
    out, held = [], 0
    for n in numels:
        if held and held + n > bucket_elements:
            out.append(held)
            held = 0
        held += int(n)
    if held:
        out.append(held)
    return out


def bucket_elements(trace, bucket_mib: float) -> int:
    """``reduce_bucket_size`` (elements) a rerun takes for ``bucket_mib`` MiB of the
    communication dtype, as ``ddpscope run --bucket-cap-mb`` sets it. ``ValueError`` where
    the run did not record its size or ``bucket_mib`` is not > 0."""
    ds = trace.run.get("deepspeed") or {}
    now_bytes, now_elements = ds.get("reduce_bucket_bytes"), ds.get("reduce_bucket_size")
    if not all(isinstance(v, (int, float)) and v > 0 for v in (now_bytes, now_elements)):
        raise ValueError("the run did not record DeepSpeed's reduce_bucket_size")
    if not (np.isfinite(bucket_mib) and bucket_mib > 0):
        raise ValueError(f"reduce_bucket_size must be > 0 MiB, got {bucket_mib}")
    itemsize = max(1, round(now_bytes / now_elements))
    return max(1, int(bucket_mib * MIB) // itemsize)


def reductions(trace) -> pd.DataFrame:
    """The run's gradient-bucket reductions of its real steps, one row per rank, step,
    micro-batch and bucket: ``numels`` (its parameters' elements in order; None where the
    trace lists none), ``elements``, ``bytes`` (its calls' messages), ``ms`` and
    ``exposed_ms`` (its calls', ``with_exposed``) and ``held_ms`` (the whole reduction on
    the training thread, DeepSpeed's own work included; NaN in traces before it), in
    reduction order; made once per trace (the page's table and every size's prediction
    read it)."""
    if "deepspeed_reductions" not in trace.cache:
        trace.cache["deepspeed_reductions"] = _reductions(trace)
    return trace.cache["deepspeed_reductions"]


def _reductions(trace) -> pd.DataFrame:
    colls = with_exposed(trace)
    colls = colls[colls["bucket"].notna() & colls["step"].isin(real_steps(trace))]
    columns = ["rank", "step", "micro", "bucket", "numels", "elements", "bytes", "ms", "exposed_ms", "held_ms"]
    if colls.empty:
        return pd.DataFrame(columns=columns)
    out = colls.groupby(["rank", "step", "micro", "bucket"], sort=True).agg(
        numels=("bucket_numels", "first"), bytes=("bytes", "sum"), ms=("ms", "sum"),
        exposed_ms=("exposed_ms", "sum"), held_us=("bucket_reduce_us", "first")).reset_index()
    out["elements"] = [float(sum(n)) if isinstance(n, tuple) else np.nan for n in out["numels"]]
    out["held_ms"] = out.pop("held_us") / 1e3
    return out[columns]


def in_situ_latency(trace) -> tuple[float, int] | None:
    """What an all-reduce's fixed cost was in this run: the mean time (µs) the run's own
    small all-reduces outside its gradient buckets (``SMALL_ALL_REDUCE_BYTES`` or less: ZeRO's
    gradient norm, every step and rank; an overflow check) held the training thread
    (``exposed_ms``: compute paused), over its real steps and every rank, and how many
    there were; None with fewer than ``MIN_IN_SITU``. Their time is latency alone, taken
    among the run's own compute, threads and ranks: waiting for the last rank to arrive,
    a gloo thread descheduled, what a bucket's reduction meets too; a calibration times
    all-reduces back to back with nothing else running (docs/sharded.md#predictions has
    both against reruns). The mean, not the median: on 2 ranks sharing 2 cores a quarter
    of a BERT's 1-7 KB bucket all-reduces took 2-6 ms, most 0.3-0.5, and a step pays each."""
    colls = with_exposed(trace)
    small = colls[colls["bucket"].isna() & (colls["collective"] == "all_reduce")
                  & (colls["bytes"] <= SMALL_ALL_REDUCE_BYTES) & colls["step"].isin(real_steps(trace))]
    held = small["exposed_ms"].to_numpy(float) * 1e3
    held = held[np.isfinite(held)]
    return (float(held.mean()), len(held)) if len(held) >= MIN_IN_SITU else None


def bucket_cost(trace, table: pd.DataFrame | None = None, *, in_situ: bool = True) -> AllReduceCost | None:
    """A bucket's reduction time (µs) against its bytes: a line through ``reductions``'
    rows (``table``: the trace's where not given) where they give one with a fixed cost a
    reduction (two sizes or more); else, with ``in_situ`` and where the run has them, the
    fixed cost of its own small all-reduces (``in_situ_latency``) and the rows' time beyond
    it per byte; else, where the run folder holds a calibration of these ranks (``ddpscope
    calibrate``), its all-reduce curve scaled by the median of the run's reductions over
    it; else the line through the origin (bandwidth only: fewer buckets cost the same).
    None where the trace lists no bucket sizes or did not time the whole reductions
    (traces before them) or reduced nothing. At the run's own buckets every one of these
    sums to the time they took."""
    table = reductions(trace) if table is None else table
    if not len(table) or not table["numels"].map(lambda n: isinstance(n, tuple)).all():
        return None
    us = table["held_ms"].to_numpy(float) * 1e3
    if not np.isfinite(us).all():  # a trace before the whole reduction was timed
        return None
    nbytes, what = table["bytes"].to_numpy(float), "bucket reductions"
    try:
        own = fit_line(nbytes, us, f"the run's own {len(table)} {what}")
    except ValueError:  # none took time or moved bytes
        return None
    if own.latency_us > 0:
        return own
    anchor = in_situ_latency(trace) if in_situ else None
    if anchor is not None:
        latency, count = anchor
        beyond = float(us.sum() - latency * len(us))
        if beyond > 0 and nbytes.sum() > 0:  # else the buckets took less than the fixed cost: not this line
            return AllReduceCost(latency_us=latency, us_per_byte=beyond / float(nbytes.sum()),
                                 source=f"fixed: the mean of the run's own {count} small all-reduces outside its "
                                        f"buckets (the gradient norm's); per byte: the rest of its {len(table)} {what}")
    calibration = read_calibration(trace.path) if trace.path is not None else None
    if calibration is None or calibration.unlike(trace.run, trace.world_size):
        return own
    # scaled, not shifted: what DeepSpeed does around a collective grows with its bytes (a fixed
    # cost read off one 16 MiB bucket put a 2 KiB one at 11 ms: benchmarks/deepspeed_buckets.py)
    base = calibration.cost()
    scale = float(np.median(us / base.time_us(nbytes)))
    return base.with_scale(scale, f"calibration x {scale:.2f}, the median of the run's {len(table)} {what} over "
                                  "it: their own line had no fixed cost")


def cost_in_words(cost: AllReduceCost, run_dir) -> str:
    """``bucket_cost``'s line as ``whatif`` and the page say it: fixed µs + GB/s and where
    they came from (the calibration's curve where it has one), and, where it has no fixed
    cost a reduction, what would give it one (``run_dir``: the run folder, for the command)."""
    if cost.calibrated:
        return f"the calibration's all-reduce curve ({cost.source})"
    words = f"{cost.in_words()} ({cost.source})"
    if cost.latency_us or cost.overhead_us:
        return words
    return (f"{words}; with no fixed cost a reduction, fewer buckets cost the same: predict from a rerun whose "
            f"buckets differ in size (a smaller --bucket-cap-mb), or `ddpscope calibrate {run_dir}` (its all-reduces "
            "alone: a lower bound)")


def predict_deepspeed_step_ms(trace, bucket_mib: float, cost: AllReduceCost | None = None) -> pd.DataFrame:
    """Per rank at ``reduce_bucket_size`` = ``bucket_mib`` MiB (as ``--bucket-cap-mb``):
    measured_step_ms and predicted_step_ms (medians over real steps, ms), measured_buckets
    and predicted_buckets (reductions a step), measured_bucket_ms (the run's reductions'
    time a step on the training thread, median) and predicted_bucket_ms (the new ones',
    ms). NaN where the trace lists no bucket sizes (a trace before them) or measured no
    step. The cost is ``cost``, or ``bucket_cost``'s over every rank's reductions."""
    elements = bucket_elements(trace, bucket_mib)
    table = reductions(trace)
    steps = real_sharded_steps(trace)
    cost = bucket_cost(trace, table) if cost is None else cost
    rows = []
    for rank in sorted({int(r) for r in steps["rank"].unique()}):
        mine = table[table["rank"] == rank]
        step_ms = steps[steps["rank"] == rank].set_index("step")["step_ms"]
        row = {"rank": rank, "measured_step_ms": float(step_ms.median()) if len(step_ms) else np.nan,
               "predicted_step_ms": np.nan, "measured_buckets": np.nan, "predicted_buckets": np.nan,
               "measured_bucket_ms": np.nan, "predicted_bucket_ms": np.nan}
        if cost is not None and len(mine) and len(step_ms):
            row.update(_predict(mine, step_ms, cost, elements))
        rows.append(row)
    return pd.DataFrame(rows, columns=["rank", "measured_step_ms", "predicted_step_ms", "measured_buckets",
                                       "predicted_buckets", "measured_bucket_ms", "predicted_bucket_ms"])


def _predict(mine: pd.DataFrame, step_ms: pd.Series, cost: AllReduceCost, elements: int) -> dict:
    """One rank's prediction (``predict_deepspeed_step_ms``'s columns but rank and measured_step_ms)."""
    if not mine["elements"].sum() > 0:
        return {}
    per_byte = float(mine["bytes"].sum() / mine["elements"].sum())  # the message per element (dtype)
    predicted, counts, own_counts, own_ms, new_ms = [], [], [], [], []
    for step, in_step in mine.groupby("step"):
        now, new, n_now, n_new = 0.0, 0.0, 0, 0
        for _, micro in in_step.groupby("micro"):
            own = micro["elements"].to_numpy(float)
            cut = np.array(recut((n for t in micro["numels"] for n in t), elements), float)
            now += float(cost.time_us(own * per_byte).sum()) / 1e3
            new += float(cost.time_us(cut * per_byte).sum()) / 1e3
            n_now, n_new = n_now + len(own), n_new + len(cut)
        if step not in step_ms.index:
            continue
        # the whole reduction holds the training thread: the step moves by the difference
        # (parenthesised: at the run's own size new == now and the step is the run's, exactly)
        predicted.append(float(step_ms[step]) + (new - now))
        counts.append(n_new)
        own_counts.append(n_now)
        spent = float(in_step["held_ms"].sum())
        own_ms.append(spent)
        new_ms.append(max(0.0, spent + (new - now)))
    if not predicted:
        return {}
    return {"predicted_step_ms": float(np.median(predicted)), "measured_buckets": float(np.median(own_counts)),
            "predicted_buckets": float(np.median(counts)), "measured_bucket_ms": float(np.median(own_ms)),
            "predicted_bucket_ms": float(np.median(new_ms))}
