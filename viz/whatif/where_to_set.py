"""Where a setting goes in the user's own code: a DDP bucket setting for whatever built the
traced DDP model (run.json's ``ddp_built_by``, from the stack when DDP was constructed),
FSDP2's ``reshard_after_forward`` for whatever trained the FSDP2 model (``fsdp_trained_by``).

``ddpscope run --bucket-cap-mb`` / ``--bucket-cap-mb-list`` set it for a traced run only;
to keep it, the user changes the call that builds DDP, and each framework takes it its own
way: the Hugging Face Trainer ``TrainingArguments(ddp_bucket_cap_mb=...)`` (one cap, an
``int`` field: a fraction of a MiB only from Python), Accelerate a
``DistributedDataParallelKwargs`` handler (one cap), Lightning and Fabric
``DDPStrategy(...)`` (its keyword arguments go to DDP as they are: a list too), a script
its own ``DistributedDataParallel(...)`` call."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from ddpscope.viz.whatif.layout import Cap, is_cap_list

_ONE_CAP = {  # frameworks that pass one bucket_cap_mb to DDP and no list
    "transformers": "the Hugging Face Trainer",
    "accelerate": "Accelerate",
}


def _number(v: float) -> str:
    return f"{float(v):g}"


def _list(caps: tuple[float, ...]) -> str:
    return "[" + ", ".join(_number(c) for c in caps) + "]"


def _built_by(run: dict, key: str = "ddp_built_by") -> tuple[str, dict] | None:
    """(framework, run.json's ``key`` record), or None where the run does not say (traced
    before ddpscope recorded it, by ``DDPTracer`` from Python, a hand-edited file) or is
    ddpscope's own demo."""
    built = run.get(key)
    if not isinstance(built, dict) or run.get("demo") or not isinstance(built.get("framework"), str):
        return None
    return built["framework"], built


def _ddp_kwargs(framework: str, built: dict, kw: str) -> str:
    """``kw`` (DDP's own keyword) where ``framework`` takes DDP's keyword arguments."""
    if framework == "accelerate":
        return f"in your code: Accelerator(kwargs_handlers=[DistributedDataParallelKwargs({kw})])"
    if framework in ("lightning", "fabric"):
        name = "Trainer" if framework == "lightning" else "Fabric"
        return f"in your code: {name}(strategy=DDPStrategy({kw})) ({framework.title()} passes it to DDP)"
    at = f"{Path(str(built.get('file', '?'))).name}:{built.get('line', '?')}"
    if framework == "script":
        return f"in your code: DistributedDataParallel(..., {kw}) at {at}"
    return f"in your code: {kw} where {built.get('module', '?')} builds DistributedDataParallel ({at})"


def where_to_set(run: dict, setting: Cap, candidates: pd.DataFrame | None = None) -> str | None:
    """One line saying how the user's code sets ``setting`` (``bucket_cap_mb`` in MiB, a
    ``bucket_cap_mb_list`` tuple, or None: DDP's default), or None where the run does not
    say who built its DDP model (``_built_by``). ``candidates``: the advisor's (``kind``,
    ``setting``, ``step_ms``), whose fastest uniform cap is named where the framework
    cannot take a list."""
    if (who := _built_by(run)) is None:
        return None
    framework, built = who
    if setting is None:
        arg = {"transformers": "leave ddp_bucket_cap_mb unset in TrainingArguments",
               "accelerate": "leave bucket_cap_mb unset in DistributedDataParallelKwargs",
               "lightning": "leave bucket_cap_mb out of DDPStrategy(...)",
               "fabric": "leave bucket_cap_mb out of DDPStrategy(...)"}.get(framework, "leave bucket_cap_mb out of "
                                                                                     "DistributedDataParallel(...)")
        return f"in your code: {arg} (DDP's default)"
    if is_cap_list(setting):
        if framework in _ONE_CAP:
            return (f"in your code: {_ONE_CAP[framework]} passes one bucket_cap_mb to DDP and no "
                    f"bucket_cap_mb_list: this list can be run traced (`ddpscope run --bucket-cap-mb-list "
                    f"{','.join(_number(c) for c in setting)}`) but not set there; "
                    + _best_single(candidates))
        return _ddp_kwargs(framework, built, f"bucket_cap_mb_list={_list(setting)}")
    if framework == "transformers":
        whole = float(setting) == int(float(setting))
        return (f"in your code: TrainingArguments(ddp_bucket_cap_mb={_number(setting)})" +
                (f", or --ddp_bucket_cap_mb {int(float(setting))} on the command line" if whole else
                 " (from Python: the command line's --ddp_bucket_cap_mb takes whole MiB only)"))
    return _ddp_kwargs(framework, built, f"bucket_cap_mb={_number(setting)}")


def _best_single(candidates: pd.DataFrame | None) -> str:
    """The fastest uniform cap among the advisor's candidates, in words."""
    uniform = candidates[candidates["kind"] == "uniform"] if candidates is not None and len(candidates) else None
    if uniform is None or not len(uniform):
        return "a single cap is what it can keep"
    row = uniform.sort_values("step_ms", kind="stable").iloc[0]
    cap, ms = _number(row["setting"]), row["step_ms"]
    return f"the fastest single cap searched is bucket_cap_mb={cap} ({ms:.1f} ms a step)"


def flag_in_code(run: dict, flag: str, value: bool) -> str | None:
    """One line saying how the user's code sets DDP's ``flag`` (``find_unused_parameters``)
    to ``value``, or None where the run does not say who built its DDP model."""
    if (who := _built_by(run)) is None:
        return None
    framework, built = who
    if framework == "transformers":  # TrainingArguments names DDP's flags ddp_<flag>
        return (f"in your code: TrainingArguments(ddp_{flag}={value}), or --ddp_{flag} {str(value).lower()} on the "
                "command line")
    return _ddp_kwargs(framework, built, f"{flag}={value}")


def reshard_in_code(run: dict) -> str | None:
    """One line saying how the user's code sets FSDP2's ``reshard_after_forward`` (true,
    false or N ranks) for whatever trained the run (run.json's ``fsdp_trained_by``), or
    None where the run does not say."""
    if (who := _built_by(run, "fsdp_trained_by")) is None:
        return None
    framework = who[0]
    if framework == "torchtitan":
        return ("in your code: torchtitan's --parallelism.fsdp_reshard_after_forward always (true) or never (false); "
                "N ranks is fully_shard's own (reshard_after_forward=N), not a torchtitan option")
    if framework == "transformers":
        return ('in your code: TrainingArguments(fsdp_config={"reshard_after_forward": true|false}); N ranks is '
                "fully_shard's own, not the Trainer's")
    if framework == "accelerate":
        return ("in your code: FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True|False); "
                "N ranks is fully_shard's own, not Accelerate's")
    return "in your code: fully_shard(module, reshard_after_forward=True|False|N) for each unit"


def deepspeed_bucket_elements(run: dict, mib: float) -> int | None:
    """``zero_optimization.reduce_bucket_size`` for a ``mib`` MiB gradient bucket: elements
    of the communication dtype (its size from the run's own bytes over elements), converted
    as a rerun's ``--bucket-cap-mb`` is (``config_override.edited``); None where the run did
    not record its own size in both units."""
    ds = run.get("deepspeed") if isinstance(run.get("deepspeed"), dict) else {}
    elements, size = ds.get("reduce_bucket_size"), ds.get("reduce_bucket_bytes")
    if not all(isinstance(v, (int, float)) and v > 0 for v in (elements, size)):
        return None
    return max(1, int(mib * 2**20) // max(1, round(size / elements)))


def bucket_elements_in_code(run: dict, mib: float) -> str | None:
    """One line: the DeepSpeed config value that sets a ``mib`` MiB gradient bucket
    (``deepspeed_bucket_elements``), or None where the run cannot say."""
    if (elements := deepspeed_bucket_elements(run, mib)) is None:
        return None
    ds = run["deepspeed"]
    dtype = ds.get("communication_dtype") or f"{round(ds['reduce_bucket_bytes'] / ds['reduce_bucket_size'])}-byte " \
        "gradients"
    return (f"in your code: the DeepSpeed config's zero_optimization.reduce_bucket_size = {elements} "
            f"({_number(mib)} MiB in elements of {dtype})")
