"""Overlap metrics on hand-made traces with known answers."""

import numpy as np
import pytest

from ddpscope.viz.ddp.overlap import compute_ddp_logging_view, compute_step_breakdown
from ddpscope.viz.intervals import covered, merge_intervals, merge_sorted_runs
from ddpscope.viz.trace import load_run
from tests.viz.test_trace import _meta, _step_events, write_run


def test_merge_and_cover():
    m = merge_intervals(np.array([5.0, 0.0, 2.0, 10.0]), np.array([6.0, 3.0, 4.0, 12.0]))
    assert m.tolist() == [[0.0, 4.0], [5.0, 6.0], [10.0, 12.0]]
    assert covered(m, -np.inf, np.inf) == 7.0
    assert covered(m, 3.0, 11.0) == 3.0
    assert merge_intervals(np.array([]), np.array([])).shape == (0, 2)


def test_step_breakdown_and_ddp_view(tmp_path):
    # step 1 at t0 = 1000 µs: forward [0, 20], backward [25, 65], bucket [45, 75], optimizer [80, 100]
    events = _step_events(0, 0, 0.0) + _step_events(0, 1, 1000.0)
    events.append({"ph": "X", "cat": "allreduce", "name": "bucket 1", "pid": 0, "tid": 101, "ts": 1050.0,
                   "dur": 40.0, "args": {"step": 1, "bucket": 1, "bytes": 8, "params": ["w"]}})
    t = load_run(write_run(tmp_path / "r", {0: (_meta(0, world=1), events)}))
    b = compute_step_breakdown(t)
    assert b["step"].tolist() == [1]  # warm-up left out
    row = b.iloc[0]
    # buckets [1045, 1075] and [1050, 1090]: union 45 µs; backward [1025, 1065]: 20 µs overlapped
    assert row.comm_ms == pytest.approx(0.045) and row.overlapped_ms == pytest.approx(0.020)
    assert row.exposed_ms == pytest.approx(0.025) and row.overlap_pct == pytest.approx(100 * 20 / 45)
    assert row.step_ms == pytest.approx(0.1) and row.buckets == 2
    assert len(compute_step_breakdown(t, include_warmup=True)) == 2
    d = compute_ddp_logging_view(t).iloc[0]
    assert d.forward_compute_ms == pytest.approx(0.020)
    assert d.backward_compute_ms == pytest.approx(0.045)  # forward end (1020) -> backward end (1065)
    assert d.backward_comm_ms == pytest.approx(0.045)  # 1045 -> 1090
    assert d.backward_compute_comm_overlap_ms == pytest.approx(0.020)  # 1045 -> 1065


def test_grouped_merge_equals_merging_each_group_alone():
    rng = np.random.default_rng(0)
    groups = [np.sort(rng.uniform(0, 100, size=k)) for k in (1, 5, 12, 3)]
    starts = np.concatenate(groups)
    ends = starts + np.concatenate([rng.uniform(0, 15, size=len(g)) for g in groups])
    first = np.concatenate([np.r_[True, np.zeros(len(g) - 1, bool)] for g in groups])
    idx, merged_ends = merge_sorted_runs(first, starts, ends)
    bounds = np.cumsum([0] + [len(g) for g in groups])
    expected = np.concatenate([merge_intervals(starts[a:b], ends[a:b]) for a, b in zip(bounds, bounds[1:])])
    assert np.array_equal(np.column_stack([starts[idx], merged_ends]), expected)
