"""What a sharded run predicted for its rerun, beside what the rerun measured: the live
loop's last step (predict another setting, rerun it, compare) for FSDP2 and DeepSpeed.

The setting is read from the rerun as it ran (its trace), never from what was asked:
DeepSpeed's ZeRO stage and ``reduce_bucket_size`` (run.json ``deepspeed``); FSDP2's
``reshard_after_forward`` (its units', ``reshard_setting``) and the prefetch depths the
rerun was started with (run.json ``sharding_requested``; unset: FSDP's defaults, 0 ahead
in forward, 1 in backward, as the Run page's sliders start). The prediction is the one
the Run page and ``ddpscope whatif`` show for that setting, made from the source trace
by the same functions; the measurement is the rerun's own, read by the same functions
(their ``measured_*`` columns), so both sides mean the same thing: rank 0, medians over
non-warm-up steps, the largest memory sample of those steps.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sharded.deepspeed_buckets import predict_deepspeed_step_ms
from ddpscope.viz.sharded.deepspeed_states import measured_states, predict_states
from ddpscope.viz.sharded.metrics import reshard_setting
from ddpscope.viz.sharded.predict import (
    at_rank,
    own_prefetch,
    predict_deepspeed_peak,
    predict_peak,
    predict_step_ms,
    setting_name,
)

MIB = 2**20
COLUMNS = ["quantity", "predicted", "measured", "error_pct"]


def rerun_setting(rerun) -> dict:
    """The rerun's setting as it ran: ``{"framework", "stage", "reduce_bucket_bytes"}``
    (DeepSpeed) or ``{"framework", "reshard_after_forward", "forward_prefetch",
    "backward_prefetch"}`` (FSDP2; ``reshard_after_forward`` None where its units ran
    different ones), and ``"words"``: the setting said in one line."""
    sh = rerun.shards
    if sh.framework == "deepspeed":
        size = (rerun.run.get("deepspeed") or {}).get("reduce_bucket_bytes")
        size = float(size) if isinstance(size, (int, float)) and size > 0 else None
        words = f"ZeRO stage {sh.stage}" + (f", reduce_bucket_size {size / MIB:.4g} MiB" if size else "")
        return {"framework": "deepspeed", "stage": sh.stage, "reduce_bucket_bytes": size, "words": words}
    if "forward_prefetch" in (rerun.run.get("sharding") or {}):  # what its units ran with
        fwd, bwd = own_prefetch(rerun)
    else:  # a trace before that was recorded: what the rerun asked for, else FSDP's defaults
        asked = rerun.run.get("sharding_requested") or {}
        fwd, bwd = (asked.get(k) for k in ("forward_prefetch", "backward_prefetch"))
        fwd = int(fwd) if isinstance(fwd, int) and fwd >= 0 else 0
        bwd = int(bwd) if isinstance(bwd, int) and bwd >= 1 else 1
    name = reshard_setting(rerun)
    setting = {"true": True, "false": False}.get(name, int(name) if name and name.isdigit() else None)
    words = (f"reshard_after_forward {setting_name(setting) if setting is not None else name or 'unknown'}, "
             f"prefetch {fwd} ahead in forward and {bwd} in backward")
    return {"framework": sh.framework, "reshard_after_forward": setting, "forward_prefetch": fwd,
            "backward_prefetch": bwd, "words": words}


def compute_rerun_check(source, rerun) -> pd.DataFrame:
    """One row per quantity both sides have (``COLUMNS``: quantity with its unit, predicted
    from ``source`` at ``rerun``'s setting, measured in ``rerun``, error_pct = predicted /
    measured - 1 in %): DeepSpeed at the source's stage: buckets a step, step (ms), peak
    (MiB); at another stage: the model states kept (parameters, master, moments; MiB),
    the only thing predicted there. FSDP2: step (ms) and peak (MiB), none where the
    rerun's units ran different settings. ``ValueError`` where the two are not one job:
    not both sharded, other frameworks, or another world size."""
    if source.shards is None or rerun.shards is None:
        raise ValueError("both runs must be sharded (FSDP2 or DeepSpeed) to set a prediction beside a rerun")
    if source.shards.framework != rerun.shards.framework:
        raise ValueError(f"the rerun ran {rerun.shards.framework}, the run it came from "
                         f"{source.shards.framework}: nothing was predicted for it")
    if source.world_size != rerun.world_size:
        raise ValueError(f"the rerun ran on {rerun.world_size} ranks, the run it came from on "
                         f"{source.world_size}: nothing was predicted for it")
    setting = rerun_setting(rerun)
    rows = _deepspeed_rows(source, rerun, setting) if setting["framework"] == "deepspeed" \
        else _fsdp_rows(source, rerun, setting)
    out = pd.DataFrame([r for r in rows if np.isfinite(r[1]) and np.isfinite(r[2])], columns=COLUMNS[:3])
    out["error_pct"] = (out["predicted"] / out["measured"].where(out["measured"] != 0) - 1) * 100
    return out[COLUMNS]


def _rank0(table: pd.DataFrame, column: str) -> float:
    """Rank 0's ``column`` of a per-rank prediction table (NaN where rank 0 has no row)."""
    return at_rank(table.set_index("rank") if "rank" in table else None, 0, column)


def _deepspeed_rows(source, rerun, setting: dict) -> list[tuple]:
    if setting["stage"] != source.shards.stage:  # another stage: the model states alone are predicted
        kept = measured_states(rerun)
        predicted = predict_states(source, setting["stage"])["persistent_bytes"]
        return [("model states kept (MiB)", predicted / MIB, _rank0(kept, "persistent_bytes") / MIB)]
    size, own = setting["reduce_bucket_bytes"], (source.run.get("deepspeed") or {}).get("reduce_bucket_bytes")
    if size is None or not isinstance(own, (int, float)) or own <= 0:
        return []
    predicted = predict_deepspeed_step_ms(source, size / MIB)
    measured = predict_deepspeed_step_ms(rerun, size / MIB)  # at its own size: the measured columns
    rows = [("buckets a step", _rank0(predicted, "predicted_buckets"), _rank0(measured, "measured_buckets")),
            ("step (ms)", _rank0(predicted, "predicted_step_ms"), _rank0(measured, "measured_step_ms"))]
    if len(source.shards.memory) and len(rerun.shards.memory):
        rows.append(("peak (MiB)", _rank0(predict_deepspeed_peak(source, size), "predicted_peak_bytes") / MIB,
                     _rank0(predict_deepspeed_peak(rerun, size), "measured_peak_bytes") / MIB))
    return rows


def _fsdp_rows(source, rerun, setting: dict) -> list[tuple]:
    reshard = setting["reshard_after_forward"]
    if reshard is None:  # the rerun's units ran different settings: no one prediction is its
        return []
    rows = []
    if len(source.steps) and len(rerun.steps):
        rows.append(("step (ms)", _rank0(predict_step_ms(source, reshard), "predicted_step_ms"),
                     _rank0(predict_step_ms(rerun), "measured_step_ms")))
    if len(source.shards.memory) and len(rerun.shards.memory):
        kw = {"reshard_after_forward": reshard, "forward_prefetch": setting["forward_prefetch"],
              "backward_prefetch": setting["backward_prefetch"]}
        rows.append(("peak (MiB)", _rank0(predict_peak(source, **kw), "predicted_peak_bytes") / MIB,
                     _rank0(predict_peak(rerun), "measured_peak_bytes") / MIB))
    return rows
