"""Metrics of a sharded (FSDP2, DeepSpeed) run: per unit, per step, memory, and the model
states beside the ZeRO model's (what was sent: ``comm_volume.py``).

A collective's *exposed* time is the part of it during which its rank computed nothing
(no unit's compute segment overlaps it), plus the waits for it: on gloo every collective
runs on the training thread, so all of it is exposed; on NCCL the all-gathers and
reduce-scatters run on their own streams and only what compute waits for shows.
Times in ms, bytes as bytes. Steps marked warm-up (step 0: FSDP's lazy initialisation
and the optimizer's state appearing) are left out of medians.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd

from ddpscope.tracer import format as fmt
from ddpscope.viz.ddp.compare import median_interval, waited_rows
from ddpscope.viz.sharded.comm_volume import (  # noqa: F401 - moved there; 0.2's viz.sharded_metrics gave them
    accumulation_line,
    comm_honesty_lines,
    compute_comm_volume,
    model_sizes,
)
from ddpscope.viz.sharded.deepspeed_states import compute_deepspeed_stages, measured_states
from ddpscope.viz.sharded.exposed import EMPTY, by_head, exposed_per_step, in_flight_ms, with_exposed
from ddpscope.viz.sharded.trace import params_and_trainable, real_steps, replicas, shard_group_size
from ddpscope.viz.zero.model import frozen_line, model_state_bytes, run_precision

MODEL_STATE_PARTS = {  # the ZeRO model's three parts <- the measured categories
    "params_bytes": ("sharded_params_bytes", "unsharded_params_bytes"),
    "grads_bytes": ("sharded_grads_bytes", "unsharded_grads_bytes"),
    "optimizer_state_bytes": ("optimizer_state_bytes",),
}


NO_UNIT = "(no unit)"  # the unit table's row (and the trace's name) for collectives no unit issued

UNTIMED_UNITS = ("DeepSpeed's compute is timed between collectives and waits, not per module: forward and backward "
                 "are the whole model's, on the root unit's row")


def compute_unit_table(trace) -> pd.DataFrame:
    """One row per unit: its size, and per step (median over ranks and non-warm-up steps)
    its all-gathers and reduce-scatters (count, bytes, ms; all-reduces too, when the run
    had them: HSDP's across replicas, or on the no-unit row the gradient norm's), the compute waiting for its
    all-gathers, its exposed communication, and its forward and backward compute (ms;
    a DeepSpeed run's are the root unit's alone, whole, and NaN elsewhere: its compute is
    not timed per module). Collectives no unit issued (DeepSpeed's gather of the updated
    partitions after the step, the gradient norm's all-reduce, the script's own) get a
    last row, ``NO_UNIT``,
    with no size and no compute, so the rows' exposed times add up to the step's."""
    sh = trace.shards
    # DeepSpeed's tracer cuts compute at collectives and waits, not at modules: the whole
    # model's forward and backward are the root unit's; the other units' are not measured
    per_module_untimed = sh.framework == "deepspeed"
    real = real_steps(trace)
    colls = with_exposed(trace)
    colls = colls[colls["step"].isin(real)]
    waits = sh.waits[sh.waits["step"].isin(real)].assign(ms=lambda d: (d["end_us"] - d["start_us"]) / 1e3)
    segs = sh.segments[sh.segments["step"].isin(real)].assign(ms=lambda d: (d["end_us"] - d["start_us"]) / 1e3)
    kinds = ("all_gather", "reduce_scatter") + (("all_reduce",) if (colls["collective"] == "all_reduce").any() else ())
    # its collectives and the waits for them as time (a gather waited for overlaps its wait;
    # counted once), less what compute covered: the step table's definition, per unit
    exposed = exposed_per_step(colls, waits, segs, by=("unit",))
    # a kind's ms and exposed ms are times too, not sums of spans: a unit's async gathers
    # run side by side (DeepSpeed's post-step gathers: ten of them, 56 ms of spans in 7 ms)
    by_kind = ["unit", "collective", "rank", "step"]
    grouped = colls.groupby(by_kind)
    counts, nbytes = grouped.size(), grouped["bytes"].sum()
    in_flight = pd.Series({k: in_flight_ms(c) for k, c in grouped}, dtype=float)
    kind_exposed = exposed_per_step(colls, waits.iloc[:0], segs, by=("unit", "collective"))
    rows = []
    units = list(sh.units.itertuples())
    if (colls["unit"] == -1).any() or (waits["unit"] == -1).any():
        units.append(SimpleNamespace(unit=-1, name=NO_UNIT, numel=0, sharded_bytes=float("nan"),
                                     unsharded_bytes=float("nan"), reshard_after_forward=None, root=False))
    for u in units:
        row = {"unit": u.name, "params": u.numel, "sharded_bytes": u.sharded_bytes,
               "unsharded_bytes": u.unsharded_bytes, "reshard_after_forward": u.reshard_after_forward}
        per_step = {}
        for kind in kinds:
            per_step[f"{kind}s"] = by_head(counts, (u.unit, kind))
            per_step[f"{kind}_bytes"] = by_head(nbytes, (u.unit, kind))
            per_step[f"{kind}_ms"] = by_head(in_flight, (u.unit, kind))
            per_step[f"{kind}_exposed_ms"] = by_head(kind_exposed, (u.unit, kind))
        per_step["wait_ms"] = waits[waits["unit"] == u.unit].groupby(["rank", "step"])["ms"].sum()
        per_step["exposed_ms"] = exposed[exposed.index.get_level_values("unit") == u.unit] if len(exposed) \
            else exposed
        for phase in ("forward", "backward"):
            s = segs[(segs["unit"] == u.unit) & (segs["phase"] == phase)]
            per_step[f"{phase}_ms"] = s.groupby(["rank", "step"])["ms"].sum()
        for key, series in per_step.items():
            row[key] = float(series.median()) if len(series) else 0.0
        if (per_module_untimed and not u.root) or u.unit == -1:  # not measured, not zero
            row["forward_ms"] = row["backward_ms"] = float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


NOT_RECORDED = "(issuer not recorded)"  # a trace from before the issuers were named


def compute_no_unit_table(trace) -> pd.DataFrame:
    """The unit table's ``NO_UNIT`` row by who issued its collectives: one row per issuer
    and collective (``by``: DeepSpeed's gather after the step, the gradient norm's
    all-reduce, ``clip_grad_norm_``'s, the script's own line; ``NOT_RECORDED`` in traces
    from before they were named) with, per step (medians over ranks and the non-warm-up
    steps that had one, as the unit table's cells), how many, their bytes, the time one was
    in flight and the time no compute covered (ms). Empty where no unit issued any."""
    columns = ["by", "collective", "count", "bytes", "ms", "exposed_ms"]
    real = real_steps(trace)
    colls = with_exposed(trace)
    colls = colls[colls["step"].isin(real) & (colls["unit"] == -1)]
    if not len(colls):
        return pd.DataFrame(columns=columns)
    colls = colls.assign(by=colls["by"].fillna(NOT_RECORDED))
    segs = trace.shards.segments
    exposed = exposed_per_step(colls, EMPTY, segs[segs["step"].isin(real)], by=("by", "collective"))
    rows = []
    for (by, kind), g in colls.groupby(["by", "collective"], sort=False):
        per = g.groupby(["rank", "step"])
        rows.append({"by": by, "collective": kind, "count": float(per.size().median()),
                     "bytes": float(per["bytes"].sum().median()),
                     "ms": float(pd.Series([in_flight_ms(c) for _, c in per]).median()),
                     "exposed_ms": float(by_head(exposed, (by, kind)).median())})
    return pd.DataFrame(rows, columns=columns).sort_values("exposed_ms", ascending=False, ignore_index=True)


def active_units(table: pd.DataFrame) -> pd.DataFrame:
    """The unit table's rows that issued a collective, waited for one, or have compute
    measured; the rest are left out where a table is read (``len(table) - len(active)``
    says how many): at ZeRO stages 1-2 a gradient bucket is named for its first
    parameter's unit, so a BERT's 200 modules have a handful of buckets between them,
    and ZeRO-3 keeps its small parameters gathered."""
    counts = [c for c in ("all_gathers", "reduce_scatters", "all_reduces") if c in table]
    measured = [c for c in ("wait_ms", "forward_ms", "backward_ms") if c in table]
    did = table[counts + measured].fillna(0.0).gt(0).any(axis=1)
    return table[did]


def idle_units_line(hidden: int) -> str:
    """What the summary and the page say of the units ``active_units`` left out."""
    return (f"{hidden} more unit{'s' if hidden != 1 else ''} issued no collective and waited for none in a step "
            "(ZeRO-1/2 names a gradient bucket for its first parameter's unit; ZeRO-3 keeps small parameters "
            "gathered)")


def compute_sharded_steps(trace) -> pd.DataFrame:
    """Per rank and step: step_ms, compute_ms (the units' forward and backward),
    optimizer_ms (the optimizer's step, with what it issued: DeepSpeed's gathers after the
    step), all_gather_ms, reduce_scatter_ms,
    all_reduce_ms (HSDP's across replicas, the gradient norm's, the script's own; 0 without: each the time one of that kind was in
    flight, not a sum of overlapping spans), wait_ms, exposed_ms (the time communication or a
    wait for it ran with no compute beside it) and the step's memory peak (bytes; NaN on
    steps whose memory was not measured)."""
    sh = trace.shards
    colls = with_exposed(trace)
    out = trace.steps[["rank", "step", "warmup", "incomplete"]].copy()
    out["step_ms"] = (trace.steps["end_us"] - trace.steps["start_us"]) / 1e3
    out["optimizer_ms"] = (trace.steps["optimizer_end_us"] - trace.steps["optimizer_start_us"]) / 1e3 \
        if "optimizer_start_us" in trace.steps else np.nan
    key = ["rank", "step"]

    def per(df: pd.DataFrame, col: str) -> pd.Series:
        return df.groupby(key)[col].sum() if len(df) else pd.Series(dtype=float)

    segs = sh.segments.assign(ms=(sh.segments["end_us"] - sh.segments["start_us"]) / 1e3)
    waits = sh.waits.assign(ms=(sh.waits["end_us"] - sh.waits["start_us"]) / 1e3)
    parts = {"compute_ms": per(segs, "ms"), "wait_ms": per(waits, "ms"),
             "peak_bytes": sh.memory.groupby(key)["total_bytes"].max() if len(sh.memory) else pd.Series(dtype=float)}
    idx = pd.MultiIndex.from_frame(out[key])
    for name, series in parts.items():
        out[name] = series.reindex(idx).to_numpy() if len(series) else np.nan
    for name in ("compute_ms", "wait_ms"):
        out[name] = out[name].fillna(0.0)
    # time, not a sum of spans: async collectives run side by side (ZeRO-3's gathers), and a
    # gather being waited for overlaps its wait; each counts once
    by_step = {k: g for k, g in colls.groupby(key)}
    cols = {f"{kind}_ms": [] for kind in ("all_gather", "reduce_scatter", "all_reduce")}
    for k in out[key].itertuples(index=False, name=None):
        c = by_step.get(k, EMPTY)
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            mine = c[c["collective"] == kind] if len(c) else c
            cols[f"{kind}_ms"].append(in_flight_ms(mine))
    for name, values in cols.items():
        out[name] = values
    exposed = exposed_per_step(colls, sh.waits, sh.segments)
    out["exposed_ms"] = exposed.reindex(idx).fillna(0.0).to_numpy() if len(exposed) else 0.0
    order = ["compute_ms", "optimizer_ms", "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "wait_ms", "peak_bytes",
             "exposed_ms"]
    return out[[c for c in out.columns if c not in order] + order].reset_index(drop=True)


def real_sharded_steps(trace) -> pd.DataFrame:
    """``compute_sharded_steps`` of the real steps (``real_steps``); made once per trace (the
    step predictions and the step noise read it for every setting the page shows)."""
    if "sharded_real_steps" not in trace.cache:
        steps = compute_sharded_steps(trace)
        trace.cache["sharded_real_steps"] = steps[steps["step"].isin(real_steps(trace))]
    return trace.cache["sharded_real_steps"]


#: what ``sharded_step_noise_ms`` is, said beside it (``ddpscope whatif`` and the Run page)
STEP_NOISE_MEANING = "its median step's 95 % bootstrap interval, x √2 for the rerun's own"


def sharded_step_noise_ms(trace) -> float:
    """How far (ms) a predicted step may sit from this run's and not be told apart from it:
    √2 x the half-width of the 95 % bootstrap interval of the run's median step (its real
    steps, each the mean of its ranks' times, as Compare reads a run: ``waited_rows``;
    ``viz.ddp.compare.median_interval``), √2 for the rerun's own noise, as DDP's what-if
    counts it (``viz.whatif.advisor.gain_noise_ms``). Ranks pooled, a step whose ranks
    differ (one ends before it launches the next) read as noise between steps that all
    take the same time. NaN with fewer than 2 real steps. Made once per trace (a
    bootstrap; the page asks on every rerun)."""
    if "sharded_step_noise_ms" not in trace.cache:
        steps = waited_rows(real_sharded_steps(trace))
        _, lo, hi = median_interval(steps[["rank", "step", "step_ms"]])
        trace.cache["sharded_step_noise_ms"] = (float(np.sqrt(2.0) * (hi - lo) / 2.0)
                                                if np.isfinite(lo) and np.isfinite(hi) else float("nan"))
    return trace.cache["sharded_step_noise_ms"]


def compute_memory_over_step(trace, rank: int, step: int | None = None) -> pd.DataFrame:
    """The memory samples of one measured step of ``rank`` (default: its last measured
    non-warm-up step), ``t_ms`` from the step's start, with ``peak`` marking the largest."""
    mem = trace.shards.memory
    mine = mem[mem["rank"] == rank]
    if mine.empty:
        return mine.assign(t_ms=[], peak=[])
    if step is None:
        real = real_steps(trace)
        measured = sorted(set(mine["step"].astype(int)) & real) or sorted(set(mine["step"].astype(int)))
        step = measured[-1]
    out = mine[mine["step"] == step].copy()
    start = trace.steps[(trace.steps["rank"] == rank) & (trace.steps["step"] == step)]["start_us"]
    t0 = float(start.iloc[0]) if len(start) else float(out["ts_us"].min())
    out["t_ms"] = (out["ts_us"] - t0) / 1e3
    out["where"] = out["name"] + " " + out["phase"] + " " + out["at"]
    out["peak"] = False
    if len(out):
        out.loc[out["total_bytes"].idxmax(), "peak"] = True
    return out.reset_index(drop=True)


def compute_stage_comparison(trace) -> pd.DataFrame:
    """The run's model states per rank beside the ZeRO model's stages 0-3 for this
    model's parameter count and world size (fp32 AdamW as the run: K = 8, or 12 in stage
    2 where the fp32 shard is the master copy beside the gathered one:
    ``viz.zero.model.run_precision``). Measured as the model counts them, the largest
    over the measured steps: stage 3 holds the sharded parameters (padded), the sharded
    gradients and the optimizer state; stage 2 the gathered parameters (every unit
    gathered at the end of forward), the sharded gradients, and the optimizer state plus
    the fp32 shard; stage 0 (shard groups of one rank) as stage 3, its "shards" whole.
    Rows: ``measured (rank r)`` then ``stage k``; ``working_set_bytes``:
    what the peak held beyond the model (gathered units, unsharded gradients, buffers).
    A DeepSpeed run: its own accounting (``deepspeed_states.compute_deepspeed_stages``)."""
    sh = trace.shards
    if sh.framework == "deepspeed":
        return compute_deepspeed_stages(trace)
    n = shard_group_size(trace)  # HSDP: the ZeRO model holds within one replica's shard group
    params, trained = params_and_trainable(trace)  # frozen parameters: sharded, no gradient or state
    rows = []
    for rank, mine in sh.memory.groupby("rank"):
        peak = mine.loc[mine["total_bytes"].idxmax()]
        if sh.stage == 2:
            p = float(mine["unsharded_params_bytes"].max())
            opt = float(mine["optimizer_state_bytes"].max() + mine["sharded_params_bytes"].max())
        else:
            p = float(mine["sharded_params_bytes"].max())
            opt = float(mine["optimizer_state_bytes"].max())
        g = float(mine["sharded_grads_bytes"].max())
        # stage 0 (shard groups of one rank): the unsharded copy is FSDP2's compute copy (the
        # parameter dtype's), beside the whole parameters the model counts
        working = ["unsharded_grads_bytes", "comm_buffers_bytes"] + (["unsharded_params_bytes"] if sh.stage != 2
                                                                     else [])
        rows.append({"row": f"measured (rank {int(rank)})", "rank": int(rank), "stage": sh.stage,
                     "params_bytes": p, "grads_bytes": g, "optimizer_state_bytes": opt,
                     "working_set_bytes": float(sum(peak[c] for c in working)),
                     "peak_where": f"{peak['name']} {peak['phase']}"})
    for stage in range(4):
        pred = model_state_bytes(params, n, stage, run_precision(stage), trainable=trained)
        rows.append({"row": f"stage {stage}", "rank": None, "stage": stage, **pred})
    out = pd.DataFrame(rows)
    out["model_state_bytes"] = out[list(MODEL_STATE_PARTS)].sum(axis=1)
    own = out[out["row"] == f"stage {sh.stage}"]["model_state_bytes"].iloc[0]
    out["measured/predicted"] = np.where(out["rank"].notna(), out["model_state_bytes"] / own, np.nan)
    return out


def stage_differences(trace) -> list[str]:
    """Why the measured model states differ from the ZeRO model, each in one line."""
    sh = trace.shards
    if sh.framework == "deepspeed":
        from ddpscope.viz.sharded.deepspeed_states import deepspeed_differences

        return deepspeed_differences(trace)
    n = shard_group_size(trace)
    u = sh.units
    unpadded = float(u["numel"].sum()) * 4 / n
    lines = []
    if replicas(trace) > 1 and n == 1:
        lines.append(f"HSDP with shard groups of 1 rank ({replicas(trace)} replicas): nothing is sharded, so the ZeRO "
                     "model is taken with N = 1, where no stage partitions anything: DDP's model states (stage 0); "
                     "each unit's whole gradient is all-reduced across the replicas.")
    elif replicas(trace) > 1:
        lines.append(f"HSDP: {replicas(trace)} replicas of {n} ranks each; the model states shard within a replica, so "
                     f"the ZeRO model is taken with N = {n}, not {trace.world_size}; gradients are then all-reduced "
                     "across replicas.")
    padded = float(u["sharded_bytes"].sum())
    if padded > unpadded * 1.0005:
        lines.append(f"padding: FSDP pads each parameter's first dimension to a multiple of N, so the shards hold "
                     f"{padded / 2**20:.3f} MiB where P/N is {unpadded / 2**20:.3f} MiB "
                     f"(+{(padded / unpadded - 1) * 100:.1f} %).")
    params, trained = params_and_trainable(trace)
    if trained < params:
        lines.append(frozen_line(params - trained, params))
    root = u[u["root"]]
    if len(root) and not bool(root["reshard_after_forward"].iloc[0]):
        lines.append(f"the root unit ({int(root['numel'].iloc[0]):,} parameters) stays gathered from forward to "
                     "backward (FSDP's rule for the root): it adds to the working set, not to the model's P/N.")
    lines.append("the working set at the peak (units gathered for compute, unsharded gradients before their "
                 "reduce-scatter, communication buffers) is outside the ZeRO model, which counts what each rank "
                 "keeps between steps.")
    if trace.run.get("device", "cpu") == "cpu":
        lines.append("on CPU there is no allocator counter: temporaries (gradients of activations, workspace) are "
                     "not counted; activations are the tensors autograd saved for backward.")
    return lines


MEMORY_LABELS = {
    "sharded_params_bytes": "sharded parameters", "unsharded_params_bytes": "unsharded (gathered) parameters",
    "sharded_grads_bytes": "sharded gradients", "unsharded_grads_bytes": "unsharded gradients",
    "optimizer_state_bytes": "optimizer state", "activations_bytes": "activations (saved for backward)",
    "comm_buffers_bytes": "communication buffers", "other_bytes": "other (allocator, CUDA)",
}
assert set(MEMORY_LABELS) == set(fmt.MEMORY_CATEGORIES)


def reshard_setting(trace) -> str | None:
    """FSDP2's ``reshard_after_forward`` as the run ran it, as the Run page names it
    (``"true"``, ``"false"``, a rank count, or ``"mixed"`` where the units differ): its
    non-root units' (the root's follows FSDP's own rule), not what a rerun asked for (a
    script's own setting asks nothing). None for DeepSpeed, which has no such setting
    (its stage says it), and for a run with no unit."""
    sh = trace.shards
    if sh is None or sh.framework == "deepspeed" or not len(sh.units):
        return None
    u = sh.units
    own = u.loc[~u["root"].astype(bool), "reshard_after_forward"]
    values = {str(v).lower() for v in (own if len(own) else u["reshard_after_forward"]) if v is not None}
    return values.pop() if len(values) == 1 else "mixed" if values else None


def compute_sharded_run_comparison(traces: dict) -> pd.DataFrame:
    """One row per sharded run (``{label: RunTrace}``; runs without shards left out): its
    framework, ZeRO stage, ``reshard_after_forward`` (``reshard_setting``), DeepSpeed's
    ``reduce_bucket_size`` in MiB of its communication dtype (``reduce_bucket_MiB``; None
    for FSDP2, whose reduce-scatters are per unit), the medians over non-warm-up steps of
    step time and exposed communication (ms; each step the rank it waited for, its step
    the mean over ranks: ``viz.ddp.compare.waited_rows``), the largest peak over those steps
    (``peak_MiB``, MiB) and, for DeepSpeed, the largest rank's measured model states
    (``model_states_MiB``, MiB; None for FSDP2)."""
    rows = []
    for label, t in traces.items():
        if t.shards is None:
            continue
        steps = compute_sharded_steps(t)
        real = steps[~steps["warmup"] & ~steps["incomplete"]]
        waited = waited_rows(real)
        deepspeed = t.shards.framework == "deepspeed"
        states = measured_states(t) if deepspeed else None
        bucket = (t.run.get("deepspeed") or {}).get("reduce_bucket_bytes") if deepspeed else None
        rows.append({"run": label, "framework": t.shards.framework, "stage": t.shards.stage,
                     "reshard_after_forward": reshard_setting(t),
                     "reduce_bucket_MiB": bucket / 2**20 if isinstance(bucket, (int, float)) else None,
                     "step_ms": waited["step_ms"].median(), "exposed_ms": waited["exposed_ms"].median(),
                     # the steps the Run page's prediction replays (the warm-up allocates the optimizer's state)
                     "peak_MiB": real["peak_bytes"].max() / 2**20,
                     "model_states_MiB": states["persistent_bytes"].max() / 2**20
                     if states is not None and len(states) else None})
    return pd.DataFrame(rows, columns=["run", "framework", "stage", "reshard_after_forward", "reduce_bucket_MiB",
                                       "step_ms", "exposed_ms", "peak_MiB", "model_states_MiB"])
