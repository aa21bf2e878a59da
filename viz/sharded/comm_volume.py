"""What a sharded (FSDP2, DeepSpeed) run sent, against what a ring would send and what the
ZeRO model counts, all in D, the model's size in each collective's own dtype: the table
(``compute_comm_volume``) and the lines that say it (``comm_honesty_lines``: gloo's
reduce-scatter run as an all-reduce, DeepSpeed's own collectives, mixed precision,
gradient accumulation, HSDP)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sharded.trace import params_and_trainable, real_steps, replicas, shard_group_size

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "float64": 8, "double": 8,
                "float8_e4m3fn": 1, "float8_e5m2": 1}


def model_sizes(trace) -> tuple[float, float]:
    """(D as gathered, D as reduced) in bytes: the model's parameters in ``param_dtype``
    (what all-gathers carry) and in ``reduce_dtype`` (what reduce-scatters carry: under
    ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` twice the
    gathered bytes). Without a recorded ``reduce_dtype`` gradients reduce as gathered. Only
    the parameters that train have gradients: with frozen ones (a LoRA base model) the
    gradients' D is that share of the model (``params_and_trainable``)."""
    sh = trace.shards
    gathered = float(sh.units["unsharded_bytes"].sum()) or 1.0
    sharding = trace.run.get("sharding") or {}
    param, reduce = _DTYPE_BYTES.get(str(sharding.get("param_dtype"))), _DTYPE_BYTES.get(str(sharding.get("reduce_dtype")))
    reduced = gathered * reduce / param if param and reduce else gathered
    params, trained = params_and_trainable(trace)
    if 0 < trained < params:
        reduced *= trained / params
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
    else:  # FSDP's own: not the gradient norm's all-reduce or the script's (no unit's, ``other_sent_line``)
        colls = colls[colls["issued_by"] != "other"]
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
    params, trained = params_and_trainable(trace)
    frozen = 0 < trained < params
    if frozen:
        lines.append(f"{params - trained:,.0f} of the {params:,.0f} parameters are frozen: gathered with the rest, "
                     f"never reduced (they have no gradient), so the gradients' D (a reduce-scatter's, an "
                     f"all-reduce's) is the {trained:,.0f} that train: {d_reduce / 2**20:.3f} MiB.")
    if abs(d_reduce * (params / trained if frozen else 1) - d) > 1e-6 * d:
        sharding = trace.run.get("sharding") or {}
        lines.append(f"Mixed precision: parameters are gathered in {sharding.get('param_dtype')} and gradients reduced "
                     f"in {sharding.get('reduce_dtype')}, so the gradients' D (a reduce-scatter's, an all-reduce's) is "
                     f"{d_reduce / 2**20:.3f} MiB: "
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
    other = other_sent_line(trace)
    if other:
        lines.append(other)
    if sh.reduce_scatter_sent_as == "all_reduce":
        lines.append("gloo has no reduce-scatter: PyTorch ran each one as an all-reduce of the whole gradient, "
                     "then kept this rank's shard, so each rank sent 2(N-1)/N of it, not (N-1)/N.")
    s, r = shard_group_size(trace), replicas(trace)
    k = 2 if sh.stage < 3 else 3
    model = f"The ZeRO model: {k}D x (N-1)/N = {k * (n - 1) / n:.2f} D (DDP: 2D x (N-1)/N)."
    if r > 1 and s == 1:  # shard groups of one rank: no all-gather, no reduce-scatter; DDP's all-reduce
        model = (f"Shard groups of 1 rank: no all-gather or reduce-scatter, only the all-reduce of each unit's whole "
                 f"gradient across R = {r} replicas, 2(R-1)/R x D = {2 * (r - 1) / r:.2f} D: DDP's volume "
                 "(2D x (N-1)/N).")
    elif r > 1:  # HSDP: ZeRO within each shard group, then an all-reduce of each shard across replicas
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
    # DeepSpeed 1-2 reduce by all-reduce, and so does FSDP2 on shard groups of one rank (nothing
    # sharded: read off the units, as the volume and the memory replay read it)
    alone = not deepspeed and shard_group_size(trace) == 1
    kind = "all_reduce" if (deepspeed and sh.stage < 3) or alone else "reduce_scatter"
    by = vol.set_index("collective")["message_D"]
    reduced, gathered = float(by.get(kind, 0.0)), float(by.get("all_gather", 0.0))
    if deepspeed:
        why = ("ZeRO-1 reduces the accumulated gradients once, at the step's end" if sh.stage == 1 else
               "ZeRO-2 and -3 reduce each micro-batch's gradients into this rank's partition as they come")
    else:
        reduces = "all-reduces" if alone else "reduce-scatters"
        why = (f"FSDP2 {reduces} each micro-batch's gradients unless the script turns gradient sync off "
               "(set_requires_gradient_sync(False)) for all but the last")
    return (f"A step here is {micro} micro-batches (gradient accumulation): its gradients were reduced {reduced:.2f} "
            f"times a step (D each) and {gathered:.2f} D of parameters gathered, where the ZeRO model below counts "
            f"one forward and backward a step: {why}.")


def other_sent_line(trace) -> str | None:
    """What a run's collectives of no unit carried, left out of the volume above, or None:
    FSDP2's (``clip_grad_norm_``'s all-reduce of the gradient norm, the script's own) and
    DeepSpeed's other than ZeRO's buckets and gathers (its gradient norm's and overflow
    check's all-reduces, the script's own), each named for who issued it (a trace from
    before the issuers were named: by its collective)."""
    sh = trace.shards
    colls = sh.colls[sh.colls["step"].isin(real_steps(trace)) & (sh.colls["issued_by"] == "other")]
    if not len(colls):
        return None
    per = colls.groupby(["rank", "step"])
    by = colls["by"].where(colls["by"].notna(), colls["collective"] + " (issuer not recorded)")
    who = ", ".join(f"{name} ({n:g} a step)" for name, n in by.groupby(by).size().div(per.ngroups).round(2).items())
    own = "ZeRO's" if sh.framework == "deepspeed" else "FSDP's"
    return (f"Besides {own} own, {float(per['bytes'].sum().median()):,.0f} bytes a step in collectives no unit "
            f"issued, not counted above: {who}.")
