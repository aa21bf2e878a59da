"""viz/zero/model.py: the ZeRO paper's memory model, communication and projections."""

from __future__ import annotations

from decimal import ROUND_HALF_UP, Decimal

import pytest

from ddpscope.viz.zero.figures import make_zero_projection_figure
from ddpscope.viz.zero.model import (
    FP32,
    MIXED,
    Precision,
    bytes_per_param,
    compute_zero_memory,
    largest_model,
    model_state_bytes,
    run_precision,
    transformer_activation_bytes,
)


def _one_decimal(x: float) -> float:
    return float(Decimal(repr(x)).quantize(Decimal("0.1"), rounding=ROUND_HALF_UP))


def test_reproduces_the_zero_paper_figure_1():
    """7.5B parameters, N = 64, K = 12, mixed precision: 120, 31.4, 16.6, 1.9 GB."""
    mem = compute_zero_memory(7.5e9, 64, MIXED)
    gb = (mem["model_state_bytes"] / 1e9).tolist()
    assert gb == [120.0, 31.40625, 16.640625, 1.875]  # exact, before the paper's rounding
    assert [_one_decimal(x) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_formulas_per_stage():
    P, N = 1000.0, 8
    p = Precision(name="t", param=2, grad=2, k=12)
    assert sum(model_state_bytes(P, N, 0, p).values()) == (2 + 2 + 12) * P
    assert sum(model_state_bytes(P, N, 1, p).values()) == 2 * P + 2 * P + 12 * P / N
    assert sum(model_state_bytes(P, N, 2, p).values()) == 2 * P + (2 + 12) * P / N
    assert sum(model_state_bytes(P, N, 3, p).values()) == (2 + 2 + 12) * P / N
    assert model_state_bytes(P, 1, 3, p) == model_state_bytes(P, 1, 0, p)  # one rank: nothing to shard


def test_communication_volume_per_stage():
    mem = compute_zero_memory(1e9, 4, MIXED)
    assert mem["comm_P"].tolist() == [2.0, 2.0, 2.0, 3.0]
    assert mem["comm_bytes"].tolist() == pytest.approx([2 * 0.75 * 2e9] * 3 + [3 * 0.75 * 2e9])


def test_largest_model_is_the_inverse_of_the_memory_model():
    fits = largest_model(80 * 2**30, 64, MIXED)
    for stage, max_params in zip(fits["stage"], fits["max_params"]):
        assert max_params * bytes_per_param(64, stage, MIXED) == pytest.approx(80 * 2**30)
    assert fits["max_params"].is_monotonic_increasing
    with_act = largest_model(80 * 2**30, 64, MIXED, activations_bytes=10 * 2**30)
    assert (with_act["max_params"] < fits["max_params"]).all()


def test_activation_estimate_follows_korthikanti():
    # one layer, s = 2048, b = 1, h = 4096, a = 32: s*b*h*(34 + 5*a*s/h) bytes
    one = transformer_activation_bytes(layers=1, hidden=4096, seq=2048, micro_batch=1, heads=32)
    assert one == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096)
    assert transformer_activation_bytes(layers=24, hidden=4096, seq=2048, micro_batch=2, heads=32) == 48 * one
    assert transformer_activation_bytes(layers=1, hidden=4096, seq=2048, micro_batch=1, heads=32,
                                        bytes_per_value=4) == 2 * one
    default_heads = transformer_activation_bytes(layers=1, hidden=4096, seq=2048, micro_batch=1)
    assert default_heads == 2048 * 4096 * (34 + 5 * 64 * 2048 / 4096)  # a = hidden / 64
    with pytest.raises(ValueError, match="seq"):
        transformer_activation_bytes(layers=1, hidden=64, seq=0, micro_batch=1)


def test_run_precision_matches_fp32_adam():
    assert run_precision(0) == Precision(name="fp32 (run)", param=4, grad=4, k=8)
    assert run_precision(2).k == 12 and run_precision(3).k == FP32.k


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="stage"):
        model_state_bytes(1, 2, 4)
    with pytest.raises(ValueError, match="N"):
        model_state_bytes(1, 0, 1)
    with pytest.raises(ValueError, match="k bytes"):
        Precision(name="bad", param=2, grad=2, k=-1)
    with pytest.raises(ValueError, match="unit"):
        make_zero_projection_figure(compute_zero_memory(1e9, 2), unit="kB")


def test_projection_figure_stacks_each_stage_in_the_chosen_unit():
    mem = compute_zero_memory(7.5e9, 64, MIXED, activations_bytes=2e9)
    fig = make_zero_projection_figure(mem, "GB", device_bytes=80e9)
    bars = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert set(bars) == {"parameters", "gradients", "optimizer state", "activations"}
    totals = [sum(v[i] for v in bars.values()) for i in range(4)]
    assert totals == pytest.approx([122.0, 33.40625, 18.640625, 3.875])
    assert fig.layout.yaxis.title.text == "per device (GB)"
    gib = make_zero_projection_figure(mem, "GiB")
    assert next(t for t in gib.data if t.name == "parameters").y[0] == pytest.approx(15e9 / 2**30)


def test_frozen_parameters_are_held_and_sharded_with_no_gradient_or_optimizer_state():
    """A LoRA fine-tune: 1000 parameters held, 50 of them trained, 4 ranks, fp32 Adam."""
    fp32 = FP32
    for stage in range(4):
        every = model_state_bytes(1000, 4, stage, fp32)
        lora = model_state_bytes(1000, 4, stage, fp32, trainable=50)
        assert lora["params_bytes"] == every["params_bytes"]  # held (and sharded at 3) all the same
        assert lora["grads_bytes"] == every["grads_bytes"] / 20
        assert lora["optimizer_state_bytes"] == every["optimizer_state_bytes"] / 20
    assert model_state_bytes(1000, 4, 3, fp32, trainable=50) == {"params_bytes": 1000.0, "grads_bytes": 50.0,
                                                                 "optimizer_state_bytes": 100.0}
    for bad in (-1, 1001):
        with pytest.raises(ValueError, match="trainable parameters must be between 0 and the 1000 parameters"):
            model_state_bytes(1000, 4, 0, fp32, trainable=bad)
