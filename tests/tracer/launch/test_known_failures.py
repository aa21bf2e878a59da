"""The failures whose message does not say what to change (``tracer.launch.known_failures``)."""

from __future__ import annotations

from ddpscope.tracer.launch.known_failures import known_cause


def test_a_known_error_line_gets_what_to_change_and_any_other_none():
    line = "AssertionError: First bucket should be smaller/equal to other buckets to get comms warmed up ASAP"
    assert "bucket_cap_mb" in known_cause(line) and "at least 1" in known_cause(line)
    assert known_cause("RuntimeError: CUDA out of memory") is None
    assert known_cause(None) is None and known_cause("") is None
