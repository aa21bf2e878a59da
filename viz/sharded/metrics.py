"""Metrics of a sharded (FSDP2) run: per unit, per step, memory, and communication volume.

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
from ddpscope.viz.sharded.exposed import EMPTY, by_head, exposed_per_step, in_flight_ms, with_exposed
from ddpscope.viz.sharded.trace import real_steps
from ddpscope.viz.zero.model import model_state_bytes, run_precision

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
    its all-gathers and reduce-scatters (count, bytes, ms; HSDP's all-reduces across
    replicas too, when the run had them), the compute waiting for its
    all-gathers, its exposed communication, and its forward and backward compute (ms;
    a DeepSpeed run's are the root unit's alone, whole, and NaN elsewhere: its compute is
    not timed per module). Collectives no unit issued (DeepSpeed's gather of the updated
    partitions after the step, its gradient norm's all-reduce) get a last row, ``NO_UNIT``,
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


def compute_sharded_steps(trace) -> pd.DataFrame:
    """Per rank and step: step_ms, compute_ms, all_gather_ms, reduce_scatter_ms,
    all_reduce_ms (HSDP's across replicas; 0 without: each the time one of that kind was in
    flight, not a sum of overlapping spans), wait_ms, exposed_ms (the time communication or a
    wait for it ran with no compute beside it) and the step's memory peak (bytes; NaN on
    steps whose memory was not measured)."""
    sh = trace.shards
    colls = with_exposed(trace)
    out = trace.steps[["rank", "step", "warmup", "incomplete"]].copy()
    out["step_ms"] = (trace.steps["end_us"] - trace.steps["start_us"]) / 1e3
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
    order = ["compute_ms", "all_gather_ms", "reduce_scatter_ms", "all_reduce_ms", "wait_ms", "peak_bytes", "exposed_ms"]
    return out[[c for c in out.columns if c not in order] + order].reset_index(drop=True)


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
    the fp32 shard. Rows: ``measured (rank r)`` then ``stage k``; ``working_set_bytes``:
    what the peak held beyond the model (gathered units, unsharded gradients, buffers).
    A DeepSpeed run: its own accounting (``deepspeed_states.compute_deepspeed_stages``)."""
    sh = trace.shards
    if sh.framework == "deepspeed":
        from ddpscope.viz.sharded.deepspeed_states import compute_deepspeed_stages

        return compute_deepspeed_stages(trace)
    n = shard_group_size(trace)  # HSDP: the ZeRO model holds within one replica's shard group
    params = int(sh.units["numel"].sum())
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
        working = ["unsharded_grads_bytes", "comm_buffers_bytes"] + (["unsharded_params_bytes"] if sh.stage == 3
                                                                     else [])
        rows.append({"row": f"measured (rank {int(rank)})", "rank": int(rank), "stage": sh.stage,
                     "params_bytes": p, "grads_bytes": g, "optimizer_state_bytes": opt,
                     "working_set_bytes": float(sum(peak[c] for c in working)),
                     "peak_where": f"{peak['name']} {peak['phase']}"})
    for stage in range(4):
        pred = model_state_bytes(params, n, stage, run_precision(stage))
        rows.append({"row": f"stage {stage}", "rank": None, "stage": stage, **pred})
    out = pd.DataFrame(rows)
    out["model_state_bytes"] = out[list(MODEL_STATE_PARTS)].sum(axis=1)
    own = out[out["row"] == f"stage {sh.stage}"]["model_state_bytes"].iloc[0]
    out["measured/predicted"] = np.where(out["rank"].notna(), out["model_state_bytes"] / own, np.nan)
    return out


def shard_group_size(trace) -> int:
    """The ranks a unit is sharded over: N, or under HSDP N / replicas."""
    u = trace.shards.units
    size = int(u["shard_size"].max()) if "shard_size" in u and len(u) else 0
    return size if size > 0 else trace.world_size


def replicas(trace) -> int:
    """HSDP's replicas (1: plain FSDP)."""
    u = trace.shards.units
    return int(u["replicate_size"].max()) if "replicate_size" in u and len(u) else 1


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
    if replicas(trace) > 1:
        lines.append(f"HSDP: {replicas(trace)} replicas of {n} ranks each; the model states shard within a replica, so "
                     f"the ZeRO model is taken with N = {n}, not {trace.world_size}; gradients are then all-reduced "
                     "across replicas.")
    padded = float(u["sharded_bytes"].sum())
    if padded > unpadded * 1.0005:
        lines.append(f"padding: FSDP pads each parameter's first dimension to a multiple of N, so the shards hold "
                     f"{padded / 2**20:.3f} MiB where P/N is {unpadded / 2**20:.3f} MiB "
                     f"(+{(padded / unpadded - 1) * 100:.1f} %).")
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


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


def model_sizes(trace) -> tuple[float, float]:
    """(D as gathered, D as reduced) in bytes: the model's parameters in ``param_dtype``
    (what all-gathers carry) and in ``reduce_dtype`` (what reduce-scatters carry: under
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` twice the
    gathered bytes). Without a recorded ``reduce_dtype`` gradients reduce as gathered."""
    sh = trace.shards
    gathered = float(sh.units["unsharded_bytes"].sum()) or 1.0
    sharding = trace.run.get("sharding") or {}
    param, reduce = _DTYPE_BYTES.get(str(sharding.get("param_dtype"))), _DTYPE_BYTES.get(str(sharding.get("reduce_dtype")))
    reduced = gathered * reduce / param if param and reduce else gathered
    return gathered, reduced


def compute_comm_volume(trace) -> pd.DataFrame:
    """Per collective kind, per rank and step (median over non-warm-up steps): the
    messages FSDP issued (bytes), what this backend sent per rank, what a ring would
    send ((G-1)/G x M for an all-gather or reduce-scatter of M bytes among G ranks,
    2(G-1)/G x M for an all-reduce; G = N, or under HSDP the shard group for those two
    and the replicas for its all-reduce), and all in units of D, the model's size in the collective's own dtype
    (all-gathers: ``param_dtype``; reduce-scatters: ``reduce_dtype``; ``model_sizes``),
    as the ZeRO model counts it: DDP sends 2D (an all-reduce), stage 2 2D (one
    all-gather, one reduce-scatter), stage 3 3D (the all-gather again in backward)."""
    sh = trace.shards
    n = trace.world_size
    frac = (n - 1) / n
    d_gathered, d_reduced = model_sizes(trace)
    real = real_steps(trace)
    colls = sh.colls[sh.colls["step"].isin(real)]
    deepspeed = sh.framework == "deepspeed"
    if deepspeed:  # ZeRO's own: the buckets and the gathers (not the gradient norm's few bytes)
        colls = colls[colls["issued_by"].isin(["grad_bucket", "param_fetch", "param_allgather"])]
    rows = []
    kinds = [("all_gather", d_gathered), ("reduce_scatter", d_reduced)]
    if (colls["collective"] == "all_reduce").any():  # HSDP: the reduced shard, across replicas; DeepSpeed 1-2
        kinds.append(("all_reduce", d_reduced))
    copies, shards = replicas(trace), shard_group_size(trace)
    for kind, d in kinds:
        c = colls[colls["collective"] == kind]
        per = c.groupby(["rank", "step"])["bytes"].sum()
        message = float(per.median()) if len(per) else 0.0
        sent_as = c["sent_as"].dropna().iloc[0] if c["sent_as"].notna().any() else kind
        group = copies if kind == "all_reduce" and not deepspeed else shards  # the ranks each runs among
        part = (group - 1) / group if group > 0 else frac
        sent = message * (2 * part if sent_as == "all_reduce" else part)
        ring = message * (2 * part if kind == "all_reduce" else part)
        rows.append({"collective": kind, "ran_as": sent_as, "D_bytes": d, "message_bytes": message, "sent_bytes": sent,
                     "ring_bytes": ring, "message_D": message / d, "sent_D": sent / d, "ring_D": ring / d})
    out = pd.DataFrame(rows)
    total = {"collective": "total", "ran_as": "", "D_bytes": np.nan,
             **{k: out[k].sum() for k in out.columns if k not in ("collective", "ran_as", "D_bytes")}}
    out = pd.concat([out, pd.DataFrame([total])], ignore_index=True)
    out.attrs["D_bytes"] = d_gathered
    out.attrs["D_reduce_bytes"] = d_reduced
    out.attrs["zero_model_D"] = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}
    return out


def comm_honesty_lines(trace) -> list[str]:
    """What was really sent, what NCCL would send, and ZeRO's volume, in words."""
    vol = compute_comm_volume(trace)
    sh = trace.shards
    n = trace.world_size
    d, d_reduce = vol.attrs["D_bytes"], vol.attrs["D_reduce_bytes"]
    total = vol[vol["collective"] == "total"].iloc[0]
    lines = [f"D = {d / 2**20:.3f} MiB of gathered parameters; N = {n} ranks; ZeRO stage {sh.stage} "
             f"({sh.stage_reason})."]
    if d_reduce != d:
        sharding = trace.run.get("sharding") or {}
        lines.append(f"Mixed precision: parameters are gathered in {sharding.get('param_dtype')} and gradients reduced "
                     f"in {sharding.get('reduce_dtype')}, so a reduce-scatter's D is {d_reduce / 2**20:.3f} MiB: "
                     "each collective is counted in D of its own dtype, as the ZeRO model counts it.")
    if sh.framework == "deepspeed" and sh.stage < 3:
        lines.append("DeepSpeed reduces each gradient bucket at stages 1-2 with an all-reduce (each rank then keeps its "
                     "partition), 2(N-1)/N D where the ZeRO model counts a reduce-scatter's (N-1)/N D, and gathers the "
                     "updated partitions after the step, (N-1)/N D: 3D x (N-1)/N for a step that reduces once, against "
                     "the model's 2D.")
    micro = accumulation_line(trace, vol)
    if micro:
        lines.append(micro)
    gathered = vol[vol["collective"] == "all_gather"]
    if sh.framework == "deepspeed" and sh.stage == 3 and len(gathered) and gathered["message_D"].iloc[0] < 1.95:
        colls = sh.colls[sh.colls["step"].isin(real_steps(trace))]
        why = ["a parameter used again within stage3_max_reuse_distance stays gathered"] \
            if (colls["issued_by"] == "param_fetch").any() else []
        after = colls[colls["issued_by"] == "param_allgather"].groupby(["rank", "step"])["bytes"].sum()
        if len(after):  # the persistent parameters: whole all along, refreshed once after each step
            why.append(f"the parameters under stage3_param_persistence_threshold ({float(after.median()) / d:.2f} D) "
                       "are kept whole on every rank (beside their partitions) and gathered once, after the step")
        lines.append(f"DeepSpeed gathered {gathered['message_D'].iloc[0]:.2f} D of parameters a step where the ZeRO "
                     f"model counts 2D (forward, then again for backward): {'; '.join(why)}.")
    devices = sorted({str(m.get("device")) for m in trace.ranks.values() if str(m.get("device", "cpu")) != "cpu"})
    if sh.framework == "deepspeed" and devices:  # tracer/capture/deepspeed/tracer.py: host times everywhere
        lines.append(f"On {', '.join(devices)} DeepSpeed's collectives run on its own streams; ddpscope timed them on "
                     "the host (issued, waited for, seen done), not on the device: a collective's span holds the time "
                     "it queued behind earlier work, and exposed time is what the host waited for it, not what the "
                     "compute stream waited.")
    if sh.reduce_scatter_sent_as == "all_reduce":
        lines.append("gloo has no reduce-scatter: PyTorch ran each one as an all-reduce of the whole gradient, "
                     "then kept this rank's shard, so each rank sent 2(N-1)/N of it, not (N-1)/N.")
    s, r = shard_group_size(trace), replicas(trace)
    k = 2 if sh.stage < 3 else 3
    model = f"The ZeRO model: {k}D x (N-1)/N = {k * (n - 1) / n:.2f} D (DDP: 2D x (N-1)/N)."
    if r > 1:  # HSDP: ZeRO within each shard group, then an all-reduce of each shard across replicas
        model = (f"The ZeRO model within a shard group of S = {s}: {k}D x (S-1)/S = {k * (s - 1) / s:.2f} D, plus "
                 f"the all-reduce of this rank's gradient shard across R = {r} replicas, 2(R-1)/R x D/S = "
                 f"{2 * (r - 1) / r / s:.2f} D: {k * (s - 1) / s + 2 * (r - 1) / r / s:.2f} D (DDP: 2D x (N-1)/N).")
    lines.append(f"Per step each rank sent {total['sent_bytes'] / 2**20:.3f} MiB ({total['sent_D']:.2f} D); "
                 f"rings (the ZeRO paper's count) would send {total['ring_bytes'] / 2**20:.3f} MiB "
                 f"({total['ring_D']:.2f} D). " + model)
    return lines


def accumulation_line(trace, vol: pd.DataFrame) -> str | None:
    """With gradient accumulation (a step of several micro-batches, median over non-warm-up
    steps), how often the gradients were reduced and how much was gathered a step, in D
    (``compute_comm_volume``), and why: the ZeRO model counts one forward and backward a
    step, and ZeRO-2/-3 (and FSDP2 unless the script turns gradient sync off) reduce every
    micro-batch's gradients. None for one micro-batch a step."""
    steps = trace.steps
    real = steps[steps["step"].isin(real_steps(trace))]
    micro = int(real["micro_batches"].median()) if len(real) else 1
    if micro <= 1:
        return None
    sh = trace.shards
    deepspeed = sh.framework == "deepspeed"
    kind = "all_reduce" if deepspeed and sh.stage < 3 else "reduce_scatter"
    by = vol.set_index("collective")["message_D"]
    reduced, gathered = float(by.get(kind, 0.0)), float(by.get("all_gather", 0.0))
    if deepspeed:
        why = ("ZeRO-1 reduces the accumulated gradients once, at the step's end" if sh.stage == 1 else
               "ZeRO-2 and -3 reduce each micro-batch's gradients into this rank's partition as they come")
    else:
        why = ("FSDP2 reduce-scatters each micro-batch's gradients unless the script turns gradient sync off "
               "(set_requires_gradient_sync(False)) for all but the last")
    return (f"A step here is {micro} micro-batches (gradient accumulation): its gradients were reduced {reduced:.2f} "
            f"times a step (D each) and {gathered:.2f} D of parameters gathered, where the ZeRO model below counts "
            f"one forward and backward a step: {why}.")


MEMORY_LABELS = {
    "sharded_params_bytes": "sharded parameters", "unsharded_params_bytes": "unsharded (gathered) parameters",
    "sharded_grads_bytes": "sharded gradients", "unsharded_grads_bytes": "unsharded gradients",
    "optimizer_state_bytes": "optimizer state", "activations_bytes": "activations (saved for backward)",
    "comm_buffers_bytes": "communication buffers", "other_bytes": "other (allocator, CUDA)",
}
assert set(MEMORY_LABELS) == set(fmt.MEMORY_CATEGORIES)
