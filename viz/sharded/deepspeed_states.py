"""A DeepSpeed run's model states beside the ZeRO model and beside DeepSpeed's own
estimators, and the model states of another stage predicted from this trace.

DeepSpeed keeps, per rank, the model's parameters in its training dtype (``b`` bytes:
whole at stages 1-2, this rank's partition at 3), an fp32 *master* partition the
optimizer updates (also in fp32 training: a copy), Adam's two fp32 moments of that
partition, and gradients. As the ZeRO paper counts them (its K = 12: master, momentum,
variance), the model is (``model_state_bytes`` with ``p = g = b``, ``K = 12``):

- stage 1: b P + b P + 12 P/N;  stage 2: b P + (b + 12) P/N;  stage 3: (2 b + 12) P/N.

Measured from the trace's memory samples (per rank, the largest over the measured steps):
parameters are the whole model-dtype parameters (stages 1-2) or the model-dtype
partitions (stage 3: ``sharded_params_bytes`` holds them and the master, b : 4); the
optimizer state is the moments plus the master partition (the master counted as ZeRO
counts it); gradients are what holds them (at stage 1 the whole gradients and the
averaged partition, at 2-3 the partition's buffer: a storage DeepSpeed's averaged
gradients are views of, which may be larger than P/N; said where it is).

At stage 3 DeepSpeed also keeps some parameters whole on every rank, beside their
partitions, never released after use (each of at most ``stage3_param_persistence_threshold``
elements, 100,000 by default: the biases and norms of a large model, all of a small
one): ``b`` bytes per element of run.json's ``stage3_persistent_numel`` more, measured
(they are in the trace's unsharded parameters from the first step on) and predicted
(a stage 1-2 trace says which parameters stage 3 would keep whole), which the ZeRO
model does not count.

A frozen parameter (``requires_grad=False``, a LoRA base model's) is in no optimizer
group: held as the model dtype's (whole at stages 1-2, partitioned at 3, beside the
groups' flat buffers) with no master, moment or gradient. The model's gradient and
optimizer terms count run.json's ``trainable_params``; at stage 3 ``frozen_partition_numel``
is what of the measured partitions is theirs.

The *persistent* states (parameters, master and moments: everything but gradients,
which live from backward to the step in buffers whose size follows the bucket layout)
are what a prediction for another stage is checked on.

With ZeRO-Offload (``offload_optimizer: cpu``) the master and moments live in host memory
(the trace's ``offloaded`` bytes, added back here so that each figure is the whole state
wherever it is), and at stages 1-2 DeepSpeed keeps a model-dtype staging copy of the
partition there too (b P/N more parameters); ``host_persistent_bytes`` is what of the
persistent states is in host memory, measured and predicted (a rerun keeps the script's
offload). With ``offload_param`` (stage 3) the model-dtype partitions are there as well.

DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs``,
``estimate_zero3_model_states_mem_needs``, without offload; their arithmetic, read from
DeepSpeed 0.19.8, repeated here so that ddpscope's figures need no DeepSpeed): stage 2
``2 P + 18 P/N``, stage 3 ``4 L + 18 P/N`` (L: the largest layer's parameters): mixed
precision (2-byte parameters and gradients) whatever the run trains in.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sharded.trace import params_and_trainable, real_steps
from ddpscope.viz.zero.model import Precision, frozen_line, model_state_bytes

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
PERSISTENT = ("params_bytes", "optimizer_state_bytes")


def precision(trace) -> Precision:
    """The run's bytes per parameter as DeepSpeed keeps them: its training dtype's for the
    parameters and gradients, K = 12 (fp32 master, momentum, variance)."""
    dtype = str((trace.run.get("deepspeed") or {}).get("dtype") or "float32")
    b = _BYTES.get(dtype, 4)
    return Precision(name=f"DeepSpeed {dtype} (p = g = {b} B, K = 12: fp32 master, momentum, variance)",
                     param=b, grad=b, k=12)


def persistent_numel(trace) -> int:
    """Elements of the parameters DeepSpeed keeps whole at stage 3 (run.json's
    ``stage3_persistent_numel``; 0 for a trace that does not say)."""
    return int((trace.run.get("deepspeed") or {}).get("stage3_persistent_numel") or 0)


def frozen_partition(trace) -> float:
    """Elements of one rank's partitions of the frozen parameters at stage 3: measured
    (run.json's ``frozen_partition_numel``) on a stage-3 trace, else (P - P_t) / N."""
    ds = trace.run.get("deepspeed") or {}
    if trace.shards.stage == 3 and isinstance(ds.get("frozen_partition_numel"), int):
        return float(ds["frozen_partition_numel"])
    params, trained = params_and_trainable(trace)
    return (params - trained) / trace.world_size


def offload(trace) -> dict:
    """The run's offload devices: ``{"optimizer": "cpu", "param": None}`` (run.json's)."""
    ds = trace.run.get("deepspeed") or {}
    return {"optimizer": ds.get("offload_optimizer"), "param": ds.get("offload_param")}


def _whole(mem: pd.DataFrame, cat: str) -> pd.Series:
    """A category's bytes wherever they are: the device's plus what is offloaded."""
    host = mem["offloaded"].map(lambda d: (d or {}).get(cat, 0)) if "offloaded" in mem else 0
    return mem[cat] + host


PERSISTENT_CATEGORIES = ("sharded_params_bytes", "unsharded_params_bytes", "optimizer_state_bytes")
GRADIENT_CATEGORIES = ("sharded_grads_bytes", "unsharded_grads_bytes")


def _host(mem: pd.DataFrame, cats: tuple[str, ...]) -> float:
    """The most bytes of ``cats`` a sample kept in host memory (0 without offload)."""
    if "offloaded" not in mem or not len(mem):
        return 0.0
    return float(mem["offloaded"].map(lambda d: sum(v for k, v in (d or {}).items() if k in cats)).max())


def measured_states(trace) -> pd.DataFrame:
    """Per rank: params_bytes, grads_bytes, optimizer_state_bytes (moments + master),
    master_bytes, model_state_bytes, persistent_bytes and host_persistent_bytes (see the
    module's docstring), each whole wherever it is kept. Steps from 1 on (the optimizer's
    state appears at the first step)."""
    sh = trace.shards
    b = precision(trace).param
    mem = sh.memory[sh.memory["step"] >= 1] if (sh.memory["step"] >= 1).any() else sh.memory
    staging = bool(offload(trace)["optimizer"]) and sh.stage < 3  # the model-dtype copy of the partition
    rows = []
    for rank, mine in mem.groupby("rank"):
        sharded = float(_whole(mine, "sharded_params_bytes").max())
        if sh.stage == 3:
            frozen = min(sharded, b * frozen_partition(trace))  # no master beside these (a count past it: a bad file)
            params, master = (sharded - frozen) * b / (b + 4) + frozen, (sharded - frozen) * 4 / (b + 4)
            params += b * persistent_numel(trace)  # whole on every rank, beside their partitions
            grads = float(_whole(mine, "sharded_grads_bytes").max())
        else:
            master = sharded * 4 / (b + 4) if staging else sharded
            params = float(_whole(mine, "unsharded_params_bytes").max()) + sharded - master
            grads = float((_whole(mine, "sharded_grads_bytes") + _whole(mine, "unsharded_grads_bytes")).max()) \
                if sh.stage == 1 else float(_whole(mine, "sharded_grads_bytes").max())
        opt = float(_whole(mine, "optimizer_state_bytes").max()) + master
        rows.append({"row": f"measured (rank {int(rank)})", "rank": int(rank), "stage": sh.stage,
                     "params_bytes": params, "grads_bytes": grads, "optimizer_state_bytes": opt,
                     "master_bytes": master, "host_persistent_bytes": _host(mine, PERSISTENT_CATEGORIES),
                     "host_bytes": _host(mine, PERSISTENT_CATEGORIES + GRADIENT_CATEGORIES)})
    out = pd.DataFrame(rows)
    if len(out):
        out["model_state_bytes"] = out[["params_bytes", "grads_bytes", "optimizer_state_bytes"]].sum(axis=1)
        out["persistent_bytes"] = out[list(PERSISTENT)].sum(axis=1)
    return out


def predict_states(trace, stage: int, measured: pd.DataFrame | None = None) -> dict:
    """The model states a rerun of this trace at ``stage`` would keep (bytes per rank):
    the ZeRO model with DeepSpeed's precision, P from the trace's units and P/N as this
    trace's padded partition (its master partition, when measured). ``measured``: this
    trace's ``measured_states``, when the caller has it."""
    n = trace.world_size
    params, trained = params_and_trainable(trace)
    prec = precision(trace)
    pred = model_state_bytes(params, n, stage, prec, trainable=trained)
    measured = measured_states(trace) if measured is None else measured
    frozen = frozen_partition(trace)
    if len(measured) and measured["master_bytes"].iloc[0] > 0:
        part = float(measured["master_bytes"].iloc[0]) / 4  # elements in this rank's padded partition
        pred = {"params_bytes": prec.param * (params if stage < 3 else part + frozen),
                "grads_bytes": prec.grad * (trained if stage < 2 else part),
                "optimizer_state_bytes": prec.k * (trained if stage < 1 else part)}
    if stage == 3:  # the parameters DeepSpeed keeps whole there
        pred["params_bytes"] += prec.param * persistent_numel(trace)
    part = pred["optimizer_state_bytes"] / prec.k  # elements of this rank's partition (P at stage 0)
    where, host = offload(trace), 0.0
    # master and moments in host memory, at 1-2 a model-dtype staging copy too (stage 0 has no offload)
    if where["optimizer"] and stage > 0:
        host = pred["optimizer_state_bytes"]
        if stage < 3:
            pred["params_bytes"] += prec.param * part
            host += prec.param * part
    if where["param"] and stage == 3:  # the model-dtype partitions too, the frozen parameters' with them
        host += prec.param * (part + frozen)
    pred["model_state_bytes"] = sum(pred.values())
    pred["persistent_bytes"] = pred["params_bytes"] + pred["optimizer_state_bytes"]
    pred["host_persistent_bytes"] = host
    return pred


def deepspeed_estimate(params: float, largest_layer: float, n: int, stage: int, *, offload_optimizer: bool = False,
                       offload_param: bool = False) -> float | None:
    """DeepSpeed's own estimate of the model states per GPU (bytes; with ZeRO-Offload,
    what stays on the GPU: its ``cpu_offload`` / ``cpu_offload_params`` branches), or None
    for a stage it has no estimator for (0, 1)."""
    if stage == 2:
        return 2 * params if offload_optimizer else 2 * params + int(18 * params / n)
    if stage == 3:
        if offload_optimizer:
            return 4 * largest_layer + (0 if offload_param else int(2 * params / n))
        return 4 * largest_layer + int(18 * params / n)
    return None


def compute_deepspeed_stages(trace) -> pd.DataFrame:
    """Rows ``measured (rank r)``, ``stage 0..3`` (the ZeRO model with this run's P, N and
    DeepSpeed's precision) and ``DeepSpeed estimate (stage k)`` for stages 2 and 3;
    ``measured/predicted`` against the run's own stage, on all model states and on the
    persistent ones. The stage-3 row counts the parameters DeepSpeed keeps whole there
    (``persistent_numel``), as a rerun at stage 3 keeps them."""
    sh = trace.shards
    n = trace.world_size
    params = float(sh.units["numel"].sum())
    largest = float(sh.units["numel"].max()) if len(sh.units) else 0.0
    where = offload(trace)
    measured = measured_states(trace)
    rows = measured.to_dict("records")
    for stage in range(4):
        rows.append({"row": f"stage {stage}", "rank": None, "stage": stage, **predict_states(trace, stage, measured)})
    for stage in (2, 3):
        rows.append({"row": f"DeepSpeed estimate (stage {stage})", "rank": None, "stage": stage,
                     "model_state_bytes": float(deepspeed_estimate(
                         params, largest, n, stage, offload_optimizer=bool(where["optimizer"]),
                         offload_param=bool(where["param"])))})
    out = pd.DataFrame(rows)
    own = out[out["row"] == f"stage {sh.stage}"].iloc[0]
    measured = out["rank"].notna()
    out["measured/predicted"] = np.where(measured, out["model_state_bytes"] / own["model_state_bytes"], np.nan)
    out["persistent measured/predicted"] = np.where(measured, out["persistent_bytes"] / own["persistent_bytes"], np.nan)
    return out


def deepspeed_differences(trace) -> list[str]:
    """Why the measured model states differ from the ZeRO model and from DeepSpeed's
    estimators, each in one line, with by how much."""
    sh = trace.shards
    table = compute_deepspeed_stages(trace)
    own = table[table["row"] == f"stage {sh.stage}"].iloc[0]
    prec = precision(trace)
    params = float(sh.units["numel"].sum()) or 1.0
    lines = [f"DeepSpeed keeps an fp32 master partition beside the {prec.param:g}-byte parameters, so its optimizer "
             f"state is K = 12 bytes per parameter of the partition (master, momentum, variance), as the ZeRO paper "
             f"counts mixed-precision Adam" + (", also when it trains in float32 (a second fp32 copy)."
                                                 if prec.param >= 4 else ".")]
    where = offload(trace)
    why = ("with ZeRO-Offload DeepSpeed keeps the fp32 gradient partition in host memory and, beside it, staging "
           "buffers of its largest parameter's size (one on the host, one on the device)"
           if where["optimizer"] and sh.stage < 3 else
           "with ZeRO-Offload DeepSpeed keeps two copies of the gradient partition in host memory (the partitions' "
           "flat buffer and the fp32 partition's own gradient)" if where["optimizer"] else
           "the averaged gradients are views of a buffer DeepSpeed sizes by its bucket layout, alive from backward "
           "to the step")
    for r in table[table["rank"].notna()].itertuples():
        grads = own["grads_bytes"]
        if grads and abs(r.grads_bytes / grads - 1) > 0.05:
            lines.append(f"rank {int(r.rank)}: gradients held {r.grads_bytes / 2**20:.3f} MiB where the model counts "
                         f"{grads / 2**20:.3f} MiB ({(r.grads_bytes / grads - 1) * 100:+.0f} %): {why}.")
    estimate = table[table["row"] == f"DeepSpeed estimate (stage {sh.stage})"]
    measured = table[table["rank"].notna()]
    if len(estimate) and len(measured) and where["optimizer"]:
        est = float(estimate["model_state_bytes"].iloc[0])
        got = float((measured["model_state_bytes"] - measured["host_bytes"]).max())
        against = f"{(est / got - 1) * 100:+.0f} % against " if got > 0 else ""
        lines.append(f"DeepSpeed's estimator with offload says {est / 2**20:.3f} MiB stay on the device for stage "
                     f"{sh.stage} ({against}the measured {got / 2**20:.3f} MiB there; "
                     f"{float(measured['host_bytes'].max()) / 2**20:.3f} MiB of model states in host memory): it "
                     "assumes 2-byte parameters" + (", and 4 bytes per parameter of the largest layer gathered"
                                                    if sh.stage == 3 else "")
                     + (f"; this run trains in {(trace.run.get('deepspeed') or {}).get('dtype')}"
                        if prec.param != 2 else "") + ".")
    elif len(estimate) and len(measured):
        est, got = float(estimate["model_state_bytes"].iloc[0]), float(measured["model_state_bytes"].max())
        lines.append(f"DeepSpeed's estimator says {est / 2**20:.3f} MiB for stage {sh.stage} "
                     f"({(est / got - 1) * 100:+.0f} % against the measured {got / 2**20:.3f} MiB): it assumes 2-byte "
                     "parameters and gradients and a 4-byte gradient partition (18 bytes per parameter over N)"
                     + (", and 4 bytes per parameter of the largest layer gathered" if sh.stage == 3 else "")
                     + (f"; this run trains in {(trace.run.get('deepspeed') or {}).get('dtype')}"
                        if prec.param != 2 else "") + ".")
    if (trained := params_and_trainable(trace)[1]) < params:
        lines.append(frozen_line(params - trained, params))
    persist = persistent_numel(trace)
    if persist:
        threshold = (trace.run.get("deepspeed") or {}).get("stage3_param_persistence_threshold")
        threshold = f"{threshold:,}" if isinstance(threshold, int) else "?"
        lines.append(f"at stage 3 DeepSpeed keeps {persist:,} elements of parameters ({persist / params * 100:.0f} % of "
                     f"the model: those of at most stage3_param_persistence_threshold = {threshold} elements) whole on "
                     f"every rank beside their partitions: {prec.param * persist / 2**20:.3f} MiB more than the ZeRO "
                     "model counts, in the stage-3 row" + (" and measured" if sh.stage == 3 else "") + ".")
    lines.append("outside the model states: activations, the gradient buckets (communication buffers) and, at stage "
                 "3, the parameters gathered for compute; on CPU temporaries are not counted.")
    if (peak := peak_buffers_line(trace)) is not None:
        lines.append(peak)
    return lines


def peak_buffers_line(trace) -> str | None:
    """Where communication buffers are a quarter or more of the step's peak (a ZeRO-3
    reduce bucket allocated whole: reduce_bucket_size elements, whatever the model's size),
    one line saying how much, and which setting sizes them; None otherwise."""
    mem = trace.shards.memory
    mem = mem[mem["step"].isin(real_steps(trace))] if len(mem) else mem
    if not len(mem) or not mem["total_bytes"].notna().any():
        return None
    at = mem.loc[mem["total_bytes"].idxmax()]
    total, comm = float(at["total_bytes"]), float(at.get("comm_buffers_bytes") or 0.0)
    if not total or comm != comm or comm < 0.25 * total:
        return None
    line = (f"at the step's peak ({total / 2**20:.1f} MiB, rank {int(at['rank'])}) communication buffers hold "
            f"{comm / 2**20:.1f} MiB ({comm / total * 100:.0f} %)")
    ds = trace.run.get("deepspeed") or {}
    bucket = ds.get("reduce_bucket_bytes")
    if isinstance(bucket, (int, float)) and bucket and comm >= 0.9 * bucket:
        line += (f": DeepSpeed's reduce bucket, allocated whole, reduce_bucket_size = {ds.get('reduce_bucket_size'):,} "
                 f"elements ({bucket / 2**20:.1f} MiB) whatever the model's size; `ddpscope run --bucket-cap-mb` "
                 "(or reduce_bucket_size in the config) sets it")
    return line + "."
