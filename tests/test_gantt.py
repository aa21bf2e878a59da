"""The timeline figure's contents, checked against the metrics it must agree with."""

import numpy as np
import pytest

from tests.conftest import SAMPLES
from viz.buckets import bus_bandwidth_factor, compute_bucket_events, compute_bucket_table
from viz.gantt import comm_lane, compute_lane, make_timeline_figure
from viz.overlap import compute_step_breakdown
from viz.trace import load_run


@pytest.fixture(scope="module")
def trace():
    return load_run(SAMPLES / "gpt-2rank-cap1mb")


def _trace(fig, name):
    return next(t for t in fig.data if t.name.startswith(name))


def test_one_trace_per_category_with_every_bar(trace):
    fig = make_timeline_figure(trace)  # all non-warm-up steps
    names = [t.name for t in fig.data]
    assert len(names) == len(set(names)) <= 6
    shown = trace.steps[~trace.steps.warmup]
    buckets = _trace(fig, "bucket all-reduce")
    assert len(buckets.x) == len(trace.buckets.merge(shown[["rank", "step"]]))
    assert set(buckets.y) == {comm_lane(0), comm_lane(1)}
    assert len(_trace(fig, "forward").x) == len(shown)
    assert set(_trace(fig, "backward").y) == {compute_lane(0), compute_lane(1)}
    # buckets are coloured by index
    assert list(buckets.marker.color) == list(trace.buckets.merge(shown[["rank", "step"]])["bucket"])


def test_single_step_times_are_ms_from_its_start_and_hover_has_bandwidth(trace):
    fig = make_timeline_figure(trace, steps=[4], ranks=[0])
    s = trace.steps.query("rank == 0 and step == 4").iloc[0]
    fwd = _trace(fig, "forward")
    assert fwd.base[0] == pytest.approx(0.0)
    assert fwd.x[0] == pytest.approx((s.forward_end_us - s.forward_start_us) / 1e3)
    b = _trace(fig, "bucket all-reduce")
    assert set(b.y) == {comm_lane(0)} and len(b.x) == 20
    ev = compute_bucket_events(trace).query("rank == 0 and step == 4").sort_values("bucket")
    assert np.allclose(b.x, ev["duration_ms"]) and np.allclose(b.base, (ev["launch_us"] - s.start_us) / 1e3)
    row = b.customdata[0]
    assert "busbw" in b.hovertemplate and float(row[6]) == pytest.approx(float(row[5]) * bus_bandwidth_factor(2))


def test_exposed_bars_equal_exposed_communication(trace):
    fig = make_timeline_figure(trace)
    ex = _trace(fig, "exposed")
    per_lane = {}
    for lane, dur, step in zip(ex.y, ex.x, ex.customdata):
        per_lane[(lane, int(step))] = per_lane.get((lane, int(step)), 0.0) + dur
    b = compute_step_breakdown(trace)
    for r in b.itertuples():
        assert per_lane.get((comm_lane(r.rank), r.step), 0.0) == pytest.approx(r.exposed_ms, abs=1e-6)


def test_bucket_table(trace):
    t = compute_bucket_table(trace)
    assert list(t["bucket"]) == list(range(20))
    assert (t["mib"] > 0.9).all() and (t["duration_ms"] > 0).all() and (t["algbw_gbps"] > 0).all()
    assert t["num_params"].sum() == len(trace.run["param_names"])


def test_nothing_to_show_gives_an_empty_figure(trace):
    fig = make_timeline_figure(trace, steps=[999])
    assert len(fig.data) == 0 and "no finished steps" in fig.layout.title.text
