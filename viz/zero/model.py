"""The ZeRO memory model (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
Trillion Parameter Models", SC'20, section 3 and Figure 1).

Per device, for P parameters on N data-parallel ranks, with ``p`` bytes per parameter
(compute copy), ``g`` bytes per gradient and ``K`` bytes of optimizer state per parameter
(mixed-precision Adam: p = g = 2, K = 12: fp32 master weights, momentum and variance):

=========  ==================  =========================
stage 0    (p + g + K) P       DDP: everything replicated
stage 1    (p + g) P + K P/N   optimizer state partitioned
stage 2    p P + (g + K) P/N   + gradients partitioned
stage 3    (p + g + K) P/N     + parameters partitioned
=========  ==================  =========================

The paper trains every parameter. A frozen one (``requires_grad=False``: the base model
of a LoRA fine-tune) is held as the others are (partitioned at stage 3) but has no
gradient or optimizer state: the g and K terms count the P_t parameters that train.

Communication per rank and step, in parameters' worth of gradient bytes: 2P for stages
0-2 (all-reduce, or reduce-scatter + all-gather) and 3P for stage 3 (parameters are
all-gathered again for backward); exactly, with ring algorithms, x (N-1)/N.

Bytes are plain bytes; ``GB`` in this module is 10^9 bytes (the paper's unit) and
``GiB`` 2^30.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

STAGE_NAMES = {0: "stage 0 (DDP)", 1: "stage 1 (P_os)", 2: "stage 2 (P_os+g)", 3: "stage 3 (P_os+g+p)"}
COMM_FACTOR = {0: 2.0, 1: 2.0, 2: 2.0, 3: 3.0}  # x P, as N grows
GB, GIB = 1e9, 2**30


@dataclass(frozen=True, kw_only=True)
class Precision:
    """Bytes per parameter: compute copy ``param``, gradient ``grad``, optimizer state ``k``."""

    name: str
    param: float
    grad: float
    k: float

    def __post_init__(self) -> None:
        for field_name in ("param", "grad", "k"):
            if not getattr(self, field_name) >= 0:
                raise ValueError(f"{field_name} bytes per parameter must be >= 0, got {getattr(self, field_name)}")


MIXED = Precision(name="mixed precision Adam (fp16/bf16 + fp32 states, K=12)", param=2, grad=2, k=12)
FP32 = Precision(name="fp32 Adam (K=8: two fp32 moments)", param=4, grad=4, k=8)
PRECISIONS = {"mixed": MIXED, "fp32": FP32}

# Well-known sizes for the projection presets (parameters).
PRESETS = {"GPT-2 XL (1.5B)": 1.5e9, "ZeRO paper Fig. 1 (7.5B)": 7.5e9, "Llama 2 7B": 6.74e9,
           "Llama 2 13B": 13.0e9, "Llama 2 70B": 69.0e9, "GPT-3 (175B)": 175e9}


def model_state_bytes(params: float, n: int, stage: int, precision: Precision = MIXED,
                      trainable: float | None = None) -> dict[str, float]:
    """Per-device bytes of parameters, gradients and optimizer state for ``stage``.
    ``trainable``: the parameters that train (``requires_grad``; all of them when None):
    only they have gradients and optimizer state, while every parameter is held (and, at
    stage 3, partitioned), so a model fine-tuned with most of it frozen (LoRA) keeps
    ``p P`` of parameters but ``(g + K) P_trainable`` of the rest."""
    if stage not in STAGE_NAMES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if n < 1:
        raise ValueError(f"N (ranks) must be >= 1, got {n}")
    if params < 0:
        raise ValueError(f"parameter count must be >= 0, got {params}")
    trained = params if trainable is None else trainable
    if not 0 <= trained <= params:
        raise ValueError(f"trainable parameters must be between 0 and the {params:g} parameters, got {trained}")
    p, g, k = params * precision.param, trained * precision.grad, trained * precision.k
    return {
        "params_bytes": p / n if stage >= 3 else p,
        "grads_bytes": g / n if stage >= 2 else g,
        "optimizer_state_bytes": k / n if stage >= 1 else k,
    }


def bytes_per_param(n: int, stage: int, precision: Precision = MIXED) -> float:
    """Model-state bytes per parameter on one device."""
    return sum(model_state_bytes(1.0, n, stage, precision).values())


def transformer_activation_bytes(*, layers: int, hidden: int, seq: int, micro_batch: int,
                                 heads: int | None = None, bytes_per_value: float = 2.0) -> float:
    """Activations kept for backward by a GPT-style transformer without recomputation
    (Korthikanti et al. 2022, eq. 2): ``s b h (34 + 5 a s / h)`` bytes per layer with
    16-bit activations; ``bytes_per_value`` 4 doubles it for fp32. ``heads`` defaults
    to hidden / 64. Embedding and loss activations are left out."""
    for name, v in (("layers", layers), ("hidden", hidden), ("seq", seq), ("micro_batch", micro_batch)):
        if not v >= 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    a = heads or max(1, hidden // 64)
    per_layer = seq * micro_batch * hidden * (34 + 5 * a * seq / hidden)
    return layers * per_layer * bytes_per_value / 2.0


def compute_zero_memory(params: float, n: int, precision: Precision = MIXED,
                        activations_bytes: float = 0.0) -> pd.DataFrame:
    """One row per stage: stage, name, params_bytes, grads_bytes, optimizer_state_bytes,
    activations_bytes, model_state_bytes, total_bytes, comm_bytes (per rank and step, ring,
    gradient precision) and comm_P (the paper's 2P / 3P)."""
    rows = []
    for stage, name in STAGE_NAMES.items():
        ms = model_state_bytes(params, n, stage, precision)
        model_states = sum(ms.values())
        rows.append({"stage": stage, "name": name, **ms, "activations_bytes": activations_bytes,
                     "model_state_bytes": model_states, "total_bytes": model_states + activations_bytes,
                     "comm_bytes": COMM_FACTOR[stage] * (n - 1) / n * params * precision.grad,
                     "comm_P": COMM_FACTOR[stage]})
    return pd.DataFrame(rows)


def largest_model(device_bytes: float, n: int, precision: Precision = MIXED,
                  activations_bytes: float = 0.0) -> pd.DataFrame:
    """Per stage, the most parameters whose model states (plus ``activations_bytes``) fit
    in ``device_bytes`` on each of N devices."""
    free = max(0.0, device_bytes - activations_bytes)
    return pd.DataFrame([{"stage": s, "name": name, "max_params": free / bytes_per_param(n, s, precision)}
                         for s, name in STAGE_NAMES.items()])


def run_precision(stage: int) -> Precision:
    """The precision a measured ``ddpscope zero`` run uses at ``stage``: fp32
    Adam, the parameters being the optimizer's own copy (K = 8, two moments), except in
    stage 2, where FSDP computes with an unsharded copy held from forward to backward
    while the optimizer updates the fp32 shard, which then plays the master copy's role
    (K = 8 + 4)."""
    return Precision(name="fp32 (run)", param=4, grad=4, k=12 if stage == 2 else 8)


def frozen_line(frozen: float, params: float) -> str:
    """One line saying how ``frozen`` of ``params`` parameters that do not train are counted."""
    return (f"{frozen:,.0f} of the {params:,.0f} parameters are frozen (requires_grad=False, "
            f"{frozen / max(params, 1) * 100:.0f} %: a LoRA or partial fine-tune): held as the others are "
            f"(partitioned at stage 3) with no gradient or optimizer state, so every stage's gradients and "
            f"optimizer state count the {params - frozen:,.0f} that train.")
