"""Offset estimation math (the real two-node run is in test_runner.py)."""

import pytest

from ddpscope.tracer.capture.offsets import best_offset


def test_best_offset_uses_the_fastest_round_trip():
    true_offset = -400_000.0  # rank 0's clock = this rank's clock + offset
    samples = []
    for t0, out_delay, back_delay in [(0, 900, 100), (5_000, 50, 60), (9_000, 10, 4_000)]:
        ref = t0 + out_delay + true_offset
        samples.append((t0, ref, t0 + out_delay + back_delay))
    est = best_offset(samples)
    assert est.rtt_us == 110
    assert abs(est.offset_us - true_offset) <= est.rtt_us / 2
    assert est.at_us == 5_055


def test_best_offset_needs_samples():
    with pytest.raises(ValueError):
        best_offset([])
