"""Seeing a DeepSpeed engine being built: ``deepspeed.initialize`` is replaced on the
``deepspeed`` module as the script imports it (the only place the config can be edited
before DeepSpeed reads it; Accelerate and the Hugging Face Trainer call it through the
module), with its signature and return value; the engine it returns is handed to the
session. The engine's ``step`` is wrapped on the instance to count optimizer steps
(gradient-accumulation boundaries) for ``--steps``."""

from __future__ import annotations

import functools
import importlib
import inspect

from ddpscope.tracer.capture.deepspeed.config_override import Override, apply

DEEPSPEED_MODULE = "deepspeed"


def _loader():
    """DeepSpeed's own config reader (a dict, an hjson/JSON path or base64), from the
    DeepSpeed the script imported (ddpscope does not depend on DeepSpeed); an ImportError
    where this DeepSpeed keeps it elsewhere (then nothing is overridden, said)."""
    return importlib.import_module("deepspeed.runtime.tensor_parallel.init_utils").load_ds_config


def patch_deepspeed(session, module) -> None:
    original = getattr(module, "initialize", None)
    if original is None or getattr(original, "_ddpscope", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:  # DeepSpeed's own error, as the script would have had it
            return original(*args, **kwargs)
        override = Override(bucket_cap_mb=session.config.bucket_cap_mb, zero_stage=session.config.zero_stage)
        restore, notes = (lambda: None), []
        try:
            restore, notes = apply(bound.arguments, override, _loader())
        except Exception as e:  # noqa: BLE001 - the script's own config, untouched
            session.note(f"--bucket-cap-mb / --zero-stage not applied to DeepSpeed's config ({type(e).__name__}: {e})")
            bound = signature.bind(*args, **kwargs)
        try:
            result = original(*bound.args, **bound.kwargs)  # DeepSpeed's errors reach the script as they are
        finally:
            restore()
        for text in notes + not_for_deepspeed(session.config):
            session.note(text)
        try:
            session.on_deepspeed_engine(result[0] if isinstance(result, tuple) else result)
        except Exception as e:  # noqa: BLE001 - training goes on
            session.note(f"DeepSpeed's engine was built but ddpscope could not read it ({type(e).__name__}: {e}); "
                         "the script runs untraced")
        return result

    initialize._ddpscope = True
    module.initialize = initialize


def not_for_deepspeed(config) -> list[str]:
    """What a rerun asked for that DeepSpeed has no use for, each said once."""
    out = []
    if config.bucket_cap_mb_list is not None:
        out.append("--bucket-cap-mb-list applies to DDP: DeepSpeed has one reduce_bucket_size (--bucket-cap-mb); "
                   "the script's stays")
    fsdp = [flag for flag, v in (("--reshard-after-forward", config.reshard_after_forward),
                                 ("--forward-prefetch", config.forward_prefetch),
                                 ("--backward-prefetch", config.backward_prefetch)) if v is not None]
    if fsdp:
        out.append(f"{', '.join(fsdp)} apply to FSDP2: this script runs DeepSpeed (--zero-stage sets its stage)")
    return out


def count_steps(engine, on_step) -> None:
    """``on_step(n)`` after each of ``engine``'s optimizer steps (a ``step()`` at a
    gradient-accumulation boundary; the boundary is read before DeepSpeed's step moves
    its micro-step counter). An instance attribute shadows the class's method."""
    original = engine.step  # the bound method
    if getattr(original, "_ddpscope", False):
        return
    done = [0]

    @functools.wraps(original)
    def step(*args, **kwargs):
        try:
            boundary = bool(engine.is_gradient_accumulation_boundary())
        except Exception:  # noqa: BLE001 - counted as a step
            boundary = True
        result = original(*args, **kwargs)
        if boundary:
            done[0] += 1
            on_step(done[0])
        return result

    step._ddpscope = True
    engine.step = step
