"""ZeRO runs (``ddpscope zero``): loaded, and set beside the analytic model.

``load_zero(path)`` returns a ``ZeroTrace``: ``stages`` (one row per rank and stage:
the bytes that rank held and sent; see ``tracer/zero.py`` for how each is measured) and
``comm`` (one row per rank, stage and collective). Bytes throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ddpscope.tracer import format as fmt
from ddpscope.viz.run_files import read_run_folder
from ddpscope.viz.trace import TraceError, frame_of
from ddpscope.viz.zero.model import model_state_bytes, run_precision, transformer_activation_bytes

_STAGE_FIELDS = ("params", "params_bytes", "grads_bytes", "optimizer_state_bytes", "model_state_bytes",
                 "step_start_bytes", "peak_bytes", "comm_volume_bytes", "step_ms")


@dataclass(frozen=True)
class ZeroTrace:
    path: Path
    run: dict
    stages: pd.DataFrame
    comm: pd.DataFrame

    @property
    def world_size(self) -> int:
        return int(self.run.get("world_size") or self.stages["rank"].nunique())

    @property
    def params(self) -> int:
        return int(self.stages["params"].iloc[0])


def _amount(value, what: str) -> float:
    """A measured amount (bytes, ms, a count): a finite number >= 0, never text."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**62:
        raise ValueError(f"{what} {value!r} is not a finite amount >= 0")
    return float(value)


def load_zero(path: str | Path) -> ZeroTrace:
    """Load a ZeRO run folder; ``TraceError`` (one line) if it is not one or is malformed."""
    path = Path(path)
    run, files, _ = read_run_folder(path, fmt.KIND_ZERO)
    rows, comm = [], []
    for rank, (meta, _) in files.items():
        stages = meta.get("stages")
        if not isinstance(stages, list):
            raise TraceError(f"rank-{rank}.json holds no ZeRO stage measurements")
        try:
            for s in stages:
                stage = s["stage"]
                if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
                    raise ValueError(f"stage {stage!r} is not a ZeRO stage (0-3)")
                rows.append({"rank": rank, "stage": stage, "name": str(s["name"]),
                             **{k: float("nan") if s[k] is None else _amount(s[k], k) for k in _STAGE_FIELDS}})
                for coll, c in (s.get("comm") or {}).items():
                    comm.append({"rank": rank, "stage": stage, "collective": str(coll),
                                 "calls": int(_amount(c["calls"], "calls")),
                                 "message_bytes": _amount(c["message_bytes"], "message_bytes"),
                                 "volume_bytes": _amount(c["volume_bytes"], "volume_bytes")})
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise TraceError(f"rank-{rank}.json: malformed stage measurement ({type(e).__name__}: {str(e)[:200]})") \
                from None
    if not rows:
        raise TraceError(f"{path.name} holds no finished ZeRO stage")
    cfg = run.get("model_config")
    if run.get("model") == "gpt" and cfg:
        keys = ("layers", "embd", "block", "batch", "heads")
        if not isinstance(cfg, dict) or not all(isinstance(cfg.get(k), int) and 1 <= cfg[k] <= 10**7 for k in keys):
            raise TraceError(f"{path.name}/run.json: model_config needs whole numbers >= 1 for {', '.join(keys)}")
    return ZeroTrace(path=path, run=run, stages=frame_of(rows, ["stage", "rank"]),
                     comm=frame_of(comm, ["stage", "rank", "collective"]))


def compute_zero_comparison(trace: ZeroTrace) -> pd.DataFrame:
    """Per stage and rank: measured model-state bytes beside the model's prediction for
    the run (same P, N, fp32 and K as the run: ``run_precision``), and their ratio; plus
    the measured peak, the bytes sent per step and, for the demo GPT, the activation
    estimate (``predicted_activations_bytes``)."""
    n = trace.world_size
    out = trace.stages[["stage", "rank", "name", "params_bytes", "grads_bytes", "optimizer_state_bytes",
                        "model_state_bytes", "peak_bytes", "comm_volume_bytes"]].copy()
    pred = [model_state_bytes(trace.params, n, int(s), run_precision(int(s))) for s in out["stage"]]
    for key in ("params_bytes", "grads_bytes", "optimizer_state_bytes"):
        out[f"predicted_{key}"] = [p[key] for p in pred]
    out["predicted_model_state_bytes"] = [sum(p.values()) for p in pred]
    out["measured/predicted"] = out["model_state_bytes"] / out["predicted_model_state_bytes"]
    out["predicted_activations_bytes"] = predicted_activations(trace)
    return out.reset_index(drop=True)


def predicted_activations(trace: ZeroTrace) -> float:
    """The transformer activation estimate for the run's demo GPT (fp32), or 0 when the
    run's model is not a transformer or its configuration was not recorded."""
    cfg = trace.run.get("model_config") or {}
    if trace.run.get("model") != "gpt" or not cfg:
        return 0.0
    return transformer_activation_bytes(layers=int(cfg["layers"]), hidden=int(cfg["embd"]), seq=int(cfg["block"]),
                                        micro_batch=int(cfg["batch"]), heads=int(cfg["heads"]), bytes_per_value=4)
