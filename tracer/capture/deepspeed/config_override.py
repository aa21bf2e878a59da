"""A rerun's settings applied to the config a script hands ``deepspeed.initialize``,
before DeepSpeed reads it: ``--bucket-cap-mb`` becomes ``reduce_bucket_size`` (DeepSpeed
counts elements of the communication dtype, ddpscope MiB), ``--zero-stage`` the ZeRO
stage. The config may come as ``config=``, the older ``config_params=`` or
``args.deepspeed_config`` (a dict, a JSON/hjson path or base64, as DeepSpeed takes it);
it is read with DeepSpeed's own reader and replaced by an edited copy; the script's
objects are never changed (``args`` gets its own config back after the call)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

from ddpscope.tracer.capture.deepspeed.engine_facts import ITEMSIZE

MIB = 2**20


@dataclass(kw_only=True)
class Override:
    """What a rerun changes: ``bucket_cap_mb`` (MiB) and ``zero_stage``; None leaves it."""

    bucket_cap_mb: float | None = None
    zero_stage: int | None = None

    def __post_init__(self) -> None:
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"--bucket-cap-mb must be > 0, got {self.bucket_cap_mb}")
        if self.zero_stage is not None and self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"--zero-stage must be 0, 1, 2 or 3, got {self.zero_stage}")

    @property
    def empty(self) -> bool:
        return self.bucket_cap_mb is None and self.zero_stage is None


def comm_dtype(config: dict) -> str:
    """The dtype DeepSpeed reduces gradients in, from the config as DeepSpeed resolves it:
    ``communication_data_type``, else bf16's or fp16's when enabled, else float32."""
    explicit = config.get("communication_data_type")
    if isinstance(explicit, str) and explicit in ITEMSIZE:
        return explicit
    for key, dtype in (("bf16", "bfloat16"), ("bfloat16", "bfloat16"), ("fp16", "float16")):
        section = config.get(key)
        if isinstance(section, dict) and section.get("enabled") is True:
            return dtype
    return "float32"


def edited(config: dict, override: Override, model=None) -> tuple[dict, list[str]]:
    """A copy of ``config`` with the override applied, and what changed, in words (from
    the script's value to the new one; what could not be applied, and why)."""
    notes: list[str] = []
    out = copy.deepcopy(config)
    zero = out.get("zero_optimization")
    if zero is None or zero is False:
        zero = out["zero_optimization"] = {}
    if not isinstance(zero, dict):
        notes.append("the config's zero_optimization is not a section: --bucket-cap-mb/--zero-stage not "
                              "applied")
        return out, notes
    if override.zero_stage is not None and zero.get("stage", 0) != override.zero_stage:
        gathered = model is not None and any(hasattr(p, "ds_id") for p in model.parameters())
        if gathered and override.zero_stage < 3:  # built under zero.Init: already partitioned for stage 3
            notes.append(f"--zero-stage {override.zero_stage} not applied: the model was built partitioned "
                                  "for ZeRO-3 (deepspeed.zero.Init, or Transformers under a stage-3 config)")
        else:
            notes.append(f"ZeRO stage {zero.get('stage', 0)} in the script's config is replaced by "
                                  f"--zero-stage {override.zero_stage}")
            zero["stage"] = override.zero_stage
    if override.bucket_cap_mb is not None:
        dtype = comm_dtype(out)
        elements = max(1, int(override.bucket_cap_mb * MIB) // ITEMSIZE[dtype])
        before = zero.get("reduce_bucket_size")
        said = f"the script's reduce_bucket_size {before}" if before is not None else "DeepSpeed's reduce_bucket_size"
        notes.append(f"{said} is replaced by --bucket-cap-mb {override.bucket_cap_mb:g} "
                              f"({elements} elements of {dtype})")
        zero["reduce_bucket_size"] = elements
    return out, notes


def apply(arguments: dict, override: Override, load: Callable[[Any], dict]) -> tuple[Callable[[], None], list[str]]:
    """Apply ``override`` to ``deepspeed.initialize``'s bound ``arguments`` in place
    (``load`` is DeepSpeed's config reader); returns what puts the script's own objects
    back after the call (``args.deepspeed_config``) and what changed, in words. Nothing
    found to edit: unchanged."""
    if override.empty:
        return (lambda: None), []
    args = arguments.get("args")
    if arguments.get("config") is not None:
        key = "config"
    elif arguments.get("config_params") is not None:
        key = "config_params"
    elif getattr(args, "deepspeed_config", None) is not None:
        original = args.deepspeed_config
        args.deepspeed_config, notes = edited(load(original), override, arguments.get("model"))

        def restore() -> None:
            args.deepspeed_config = original

        return restore, notes
    else:
        return (lambda: None), []  # DeepSpeed says what is missing
    arguments[key], notes = edited(load(arguments[key]), override, arguments.get("model"))
    return (lambda: None), notes
