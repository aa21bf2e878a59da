"""ZeRO stages 0 and 1 on a DDP run: DDP alone (stage 0) or DDP stepped by
``ZeroRedundancyOptimizer`` (ZeRO-1), measured beside the ZeRO model.

- ``compute_param_sync``: ZeRO-1's parameter broadcasts per rank and step (ms, bytes);
- ``compute_ddp_stage_comparison``: the run's model states per rank beside stages 0-3
  for its parameter count and world size, in the columns of the sharded comparison
  (``viz.sharded.metrics.compute_stage_comparison``), so one figure draws both;
- ``ddp_stage_differences`` and ``ddp_comm_lines``: why measured and model differ, and
  the communication volume in units of D, in words.

The ZeRO model's optimizer bytes per parameter K comes from the run's optimizer class
(Adam-like: two fp32 moments, K = 8; SGD with momentum and the like: K = 4); for an
optimizer ddpscope does not know, K is read off the measurement and said so.
Bytes as bytes; MiB = 2^20 bytes.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sharded.metrics import MODEL_STATE_PARTS
from ddpscope.viz.zero.model import Precision, frozen_line, model_state_bytes

# Optimizer state bytes per fp32 parameter, by class (PyTorch's implementations; Adam's
# per-parameter ``step`` is a scalar tensor, a few bytes per tensor, not per parameter).
_K_BY_OPTIMIZER = {"Adam": 8, "AdamW": 8, "Adamax": 8, "NAdam": 8, "RAdam": 8, "Adagrad": 4, "Adadelta": 8,
                   "RMSprop": 4, "ASGD": 4}


def ddp_stage(trace) -> dict:
    """run.json's ``sharding`` of a DDP run (stage 0 when it does not say)."""
    return trace.run.get("sharding") or {"framework": "ddp", "stage": 0, "stage_reason": "DDP"}


def optimizer_k(trace) -> tuple[float | None, str]:
    """(K, where it comes from) for the run's optimizer; K None when unknown."""
    facts = ddp_stage(trace)
    name = facts.get("optimizer")
    if name == "SGD":
        return (4.0, "SGD with momentum: one fp32 buffer") if facts.get("momentum") else (0.0, "SGD: no state")
    if name in _K_BY_OPTIMIZER:
        return float(_K_BY_OPTIMIZER[name]), f"{name}: {_K_BY_OPTIMIZER[name] // 4} fp32 value(s) per parameter"
    return None, f"{name or 'the optimizer'}: K unknown to ddpscope, read off the measurement"


def compute_param_sync(trace) -> pd.DataFrame:
    """ZeRO-1's parameter broadcasts: rank, step, sync_ms, bytes (every rank's partition),
    own_bytes (this rank's: what it sends), pct_of_step and pct_of_optimizer (%).
    Empty for a run without them."""
    cols = ["rank", "step", "sync_ms", "bytes", "own_bytes", "pct_of_step", "pct_of_optimizer"]
    s = trace.steps
    if "param_sync_start_us" not in s or s["param_sync_start_us"].isna().all():
        return pd.DataFrame(columns=cols)
    s = s.dropna(subset=["param_sync_start_us", "param_sync_end_us"])
    sync = (s["param_sync_end_us"] - s["param_sync_start_us"]) / 1e3
    step = (s["end_us"] - s["start_us"]) / 1e3
    opt = (s["optimizer_end_us"] - s["optimizer_start_us"]) / 1e3
    return pd.DataFrame({"rank": s["rank"], "step": s["step"], "sync_ms": sync,
                         "bytes": s["param_sync_bytes"].astype("int64"),
                         "own_bytes": s["param_sync_own_bytes"].astype("int64"),
                         "pct_of_step": 100 * sync / step, "pct_of_optimizer": 100 * sync / opt},
                        columns=cols).reset_index(drop=True)


def param_sync_medians(trace, sync: pd.DataFrame | None = None) -> dict | None:
    """ZeRO-1's parameter broadcasts in one line's numbers, the same wherever shown (the
    Timeline, ``ddpscope summary``): medians over non-warm-up steps (every step where all
    are warm-up) of ``sync_ms``, ``pct_of_step`` and ``bytes``; None without them. ``sync``:
    ``compute_param_sync(trace)`` where the caller has it."""
    sync = compute_param_sync(trace) if sync is None else sync
    warm = set(trace.steps.loc[trace.steps["warmup"].astype(bool), "step"]) if "warmup" in trace.steps else set()
    real = sync[~sync["step"].isin(warm)]
    sync = real if len(real) else sync
    if not len(sync):
        return None
    return {"sync_ms": float(sync["sync_ms"].median()), "pct_of_step": float(sync["pct_of_step"].median()),
            "bytes": int(sync["bytes"].median())}


def frozen_params(trace) -> int:
    """Parameters of the DDP model that do not train (run.json's ``frozen_params``; 0 for
    a trace from before ddpscope recorded them, or one that says no count): held, never
    reduced."""
    n = trace.run.get("frozen_params")
    return int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) and 0 <= n < 2**62 else 0


def _params_and_width(trace) -> tuple[int, float, float]:
    """(parameters that train: those DDP reduces, bytes per parameter as held, bytes per
    trained parameter) of the DDP model. The measured ``params_bytes`` hold the frozen ones
    too (``frozen_params``), which may be of another dtype (a bf16 base model beside PEFT's
    fp32 adapters): the trained ones' width is their own (run.json's ``param_bytes``)."""
    params = int(trace.run.get("model_params") or 0)
    if params <= 0:
        raise ValueError("run.json has no model_params: the ZeRO model needs the parameter count")
    mem = trace.memory
    held = params + frozen_params(trace)
    width = float(mem["params_bytes"].max()) / held if "params_bytes" in mem and len(mem) else 4.0
    own = trace.run.get("param_bytes")
    ok = isinstance(own, list) and own and all(isinstance(b, (int, float)) and b > 0 for b in own)
    return params, width, (float(sum(own)) / params if ok else width)


def compute_ddp_stage_comparison(trace) -> pd.DataFrame:
    """Rows ``measured (rank r)`` (the largest over measured steps, at each step's end)
    then ``stage 0``-``stage 3``: params_bytes, grads_bytes, optimizer_state_bytes,
    working_set_bytes (DDP's bucket buffers: a second copy of the gradients outside the
    model), model_state_bytes and measured/predicted against the run's own stage."""
    facts = ddp_stage(trace)
    stage, n = int(facts.get("stage", 0)), trace.world_size
    params, width, trained_width = _params_and_width(trace)
    mem = trace.memory
    rows = []
    for rank, mine in mem.groupby("rank") if len(mem) else []:
        rows.append({"row": f"measured (rank {int(rank)})", "rank": int(rank), "stage": stage,
                     "params_bytes": float(mine["params_bytes"].max()),
                     "grads_bytes": float(mine["grads_bytes"].max()),
                     "optimizer_state_bytes": float(mine["optimizer_state_bytes"].max()),
                     "working_set_bytes": float(mine.get("bucket_buffers_bytes", pd.Series([0.0])).max()),
                     "peak_where": "end of step"})
    k, _ = optimizer_k(trace)
    if k is None:  # read off the measurement: the state each rank holds, as a whole model's
        measured = [r["optimizer_state_bytes"] for r in rows]
        k = (float(np.median(measured)) * (n if stage >= 1 else 1) / params) if measured else 0.0
    precision = Precision(name="the run's", param=width, grad=trained_width, k=k)
    for st in range(4):  # every parameter held (sharded at 3), gradients and state of those that train
        rows.append({"row": f"stage {st}", "rank": None, "stage": st,
                     **model_state_bytes(params + frozen_params(trace), n, st, precision, trainable=params)})
    out = pd.DataFrame(rows)
    out["model_state_bytes"] = out[list(MODEL_STATE_PARTS)].sum(axis=1)
    own = out.loc[out["row"] == f"stage {stage}", "model_state_bytes"].iloc[0]
    out["measured/predicted"] = np.where(out["rank"].notna(), out["model_state_bytes"] / own, np.nan)
    return out


def ddp_stage_differences(trace) -> list[str]:
    """Why the measured model states differ from the ZeRO model, each in one line."""
    facts = ddp_stage(trace)
    n = trace.world_size
    _, why = optimizer_k(trace)
    lines = [f"K (optimizer bytes per parameter): {why}."]
    if facts.get("stage") == 1:
        sync = compute_param_sync(trace)
        if len(sync):
            own = sync.groupby("rank")["own_bytes"].first()
            total = float(sync["bytes"].iloc[0]) or 1.0
            shares = ", ".join(f"rank {int(r)} {100 * b / total:.1f} %" for r, b in own.items())
            lines.append(f"ZeroRedundancyOptimizer partitions whole parameters (greedily, largest first), not equal "
                         f"slices: each rank updates {shares} of the parameters, where the model says "
                         f"{100 / n:.1f} %; its optimizer state follows.")
    lines.append("each Adam-like optimizer also keeps a scalar step count per parameter tensor (a few bytes each), "
                 "outside the model's K.")
    if frozen := frozen_params(trace):
        lines.append(frozen_line(frozen, frozen + int(trace.run.get("model_params") or 0)))
    if "bucket_buffers_bytes" in trace.memory and trace.memory["bucket_buffers_bytes"].max() > 0:
        lines.append("DDP's gradient buckets are a second copy of the gradients (unless gradient_as_bucket_view): "
                     "shown as the working set, outside the ZeRO model.")
    return lines


def ddp_comm_lines(trace) -> list[str]:
    """Per step and rank, what DDP (and ZeRO-1's broadcasts) sent, in units of D."""
    facts = ddp_stage(trace)
    n = trace.world_size
    params, width, trained_width = _params_and_width(trace)
    d = params * trained_width  # the gradients DDP reduces
    frac = (n - 1) / n
    b = trace.buckets
    ar = float(b.groupby(["rank", "step"])["bytes"].sum().median()) if len(b) else 0.0
    frozen = frozen_params(trace)
    lines = [f"D = {d / 2**20:.3f} MiB of parameters{' that train' if frozen else ''}; N = {n} ranks; ZeRO stage "
             f"{facts.get('stage', 0)} ({facts.get('stage_reason', 'DDP')})"
             + (f"; the {frozen:,} frozen parameters ({((params + frozen) * width - d) / 2**20:.3f} MiB) are never "
                "sent." if frozen else "."),
             f"All-reduce of the gradients: {ar / 2**20:.3f} MiB a step ({ar / d:.2f} D); a ring all-reduce "
             f"sends 2(N-1)/N of it per rank: {2 * frac * ar / d:.2f} D."]
    if facts.get("stage") == 1:
        sync = compute_param_sync(trace)
        m = float(sync["bytes"].median()) if len(sync) else d
        lines.append(f"Parameter broadcast after the update: {m / 2**20:.3f} MiB ({m / d:.2f} D), each rank the "
                     f"source of its partition; by rings each rank sends (N-1)/N of it on average: "
                     f"{frac * m / d:.2f} D. In all {2 * frac * ar / d + frac * m / d:.2f} D, where the ZeRO paper's "
                     f"stage 1 sends 2D x (N-1)/N = {2 * frac:.2f} D (a reduce-scatter, then an all-gather): "
                     "ZeroRedundancyOptimizer keeps DDP's full all-reduce and adds the broadcast.")
    return lines
