"""What a DeepSpeed engine runs with, read through the engine's own accessors (each
guarded: a DeepSpeed version without one leaves its fact out), for run.json; and the
DeepSpeed features ddpscope does not trace, named."""

from __future__ import annotations

import sys
from typing import Any

# bytes per element, by the names DeepSpeed's configs and run.json use
ITEMSIZE = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2, "float64": 8}


def _call(engine, name: str, default: Any = None) -> Any:
    fn = getattr(engine, name, None)
    try:
        return fn() if callable(fn) else default
    except Exception:  # noqa: BLE001 - a fact ddpscope cannot read is left out
        return default


def _device(offload) -> str | None:
    """An offload config's device (``none``, ``cpu``, ``nvme``), None without one."""
    device = getattr(offload, "device", None)
    text = str(getattr(device, "value", device)) if device is not None else None
    return None if text in (None, "none", "None") else text


def engine_facts(engine) -> dict:
    """run.json's facts of a DeepSpeed engine: ``zero_stage``, ``dtype`` (the model's
    training dtype), ``communication_dtype``, ``overlap_comm``, ``contiguous_gradients``,
    ``reduce_bucket_size`` (elements, as DeepSpeed counts it) and ``reduce_bucket_bytes``
    (in the communication dtype), ``gradient_accumulation_steps``, offload devices, the
    engine's class, DeepSpeed's version, ``stage3_persistent_numel`` (``persistent_numel``)
    with the threshold it follows, and at stage 3 this rank's partitions of the parameters
    that do not train (``frozen_partition_numel``)."""
    stage = _call(engine, "zero_optimization_stage")
    dtype = "bfloat16" if _call(engine, "bfloat16_enabled") else "float16" if _call(engine, "fp16_enabled") \
        else "float32"
    try:
        comm = str(engine.communication_data_type).removeprefix("torch.")
    except Exception:  # noqa: BLE001
        comm = dtype
    elements = _call(engine, "zero_reduce_bucket_size")
    facts = {
        "engine": type(engine).__name__,
        "zero_stage": None if stage is None else int(stage),
        "dtype": dtype,
        "communication_dtype": comm,
        "overlap_comm": _call(engine, "zero_overlap_comm"),
        "contiguous_gradients": _call(engine, "zero_contiguous_gradients"),
        "reduce_bucket_size": None if elements is None else int(elements),
        "reduce_bucket_bytes": None if elements is None else int(elements) * ITEMSIZE.get(comm, 4),
        "gradient_accumulation_steps": _call(engine, "gradient_accumulation_steps"),
        "offload_optimizer": _device(_call(engine, "zero_offload_optimizer")),
        "offload_param": _device(_call(engine, "zero_offload_param")),
        "world_size": getattr(engine, "dp_world_size", None),
    }
    threshold = _call(engine, "zero_param_persistence_threshold")
    if threshold is not None:
        facts["stage3_param_persistence_threshold"] = int(threshold)
        try:
            facts["stage3_persistent_numel"] = persistent_numel(engine, facts["zero_stage"])
        except Exception:  # noqa: BLE001 - a fact ddpscope cannot read is left out
            pass
    try:
        if facts["zero_stage"] == 3:
            facts["frozen_partition_numel"] = frozen_partition_numel(engine)
    except Exception:  # noqa: BLE001 - a fact ddpscope cannot read is left out
        pass
    deepspeed = sys.modules.get("deepspeed")  # the script's: ddpscope never imports DeepSpeed itself
    if deepspeed is not None:
        facts["deepspeed_version"] = str(getattr(deepspeed, "__version__", "?"))
    return facts


def persistent_numel(engine, stage: int | None) -> int:
    """Elements of the parameters ZeRO-3 keeps whole on every rank (beside their partition),
    never released after use: at stage 3 those DeepSpeed marked (``ds_persist``); at stages
    1-2 those a rerun at stage 3 would mark, by DeepSpeed's own rule
    (``DeepSpeedZeRoOffload.mark_persistent_parameters``, 0.19.8): in ``named_parameters``
    order, a parameter of at most ``stage3_param_persistence_threshold`` elements, while
    the total stays within ``stage3_model_persistence_threshold``."""
    params = [p for _, p in engine.module.named_parameters(recurse=True)]
    if stage == 3:
        return sum(int(p.ds_numel) for p in params if getattr(p, "ds_persist", False))
    each, model = int(engine.zero_param_persistence_threshold()), int(engine.zero_model_persistence_threshold())
    total = 0
    for p in params:
        n = int(p.numel())
        if n + total <= model and n <= each:
            total += n
    return total


def frozen_partition_numel(engine) -> int:
    """Elements of this rank's stage-3 partitions (``ds_tensor``, padded) of the parameters
    that do not train. A frozen parameter (a LoRA base model's) is in no optimizer group:
    stages 1-2 leave it whole on the module, stage 3 partitions it apart from the groups'
    flat buffers; it has no gradient or optimizer state."""
    return sum(int(p.ds_tensor.numel()) for p in engine.module.parameters()
               if not p.requires_grad and getattr(p, "ds_tensor", None) is not None)


def offloads_in_use(facts: dict) -> dict:
    """Where the engine offloads to, as it acts: ``{"optimizer": "cpu", "param": None}``.
    Stages 1-2 never read ``offload_param`` (stage_1_and_2.py, 0.19.8): set there (a stage-3
    config rerun at stage 2 keeps it), it offloads nothing. ``facts`` keeps the config's own."""
    return {"optimizer": facts.get("offload_optimizer"),
            "param": facts.get("offload_param") if facts.get("zero_stage") == 3 else None}


def untraced_features(engine, facts: dict) -> list[str]:
    """The DeepSpeed features in use whose communication ddpscope does not trace, named
    (each becomes one note; the run goes on)."""
    out = []
    name = type(engine).__name__
    if "Pipeline" in name:
        out.append(f"DeepSpeed's pipeline engine ({name})")
    if "Hybrid" in name:
        out.append(f"DeepSpeed's hybrid engine ({name})")
    for what, to in offloads_in_use(facts).items():  # to the CPU is traced; NVMe swaps states in and out unseen
        if to not in (None, "cpu"):
            out.append(f"{'parameter' if what == 'param' else what} offload to {to}")
    hpz = _call(engine, "zero_hpz_partition_size")
    if isinstance(hpz, int) and hpz > 1:
        out.append(f"ZeRO++ hierarchical partitioning (zero_hpz_partition_size={hpz})")
    if _call(engine, "has_moe_layers") or getattr(engine, "has_moe_layers", False) is True:
        out.append("mixture-of-experts layers")
    return out
