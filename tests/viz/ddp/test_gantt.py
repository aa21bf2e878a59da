"""The timeline figure's contents, checked against the metrics it must agree with."""

import numpy as np
import pytest

from ddpscope.viz.ddp.buckets import bus_bandwidth_factor, compute_bucket_events, compute_bucket_table
from ddpscope.viz.ddp.gantt import make_timeline_figure
from ddpscope.viz.ddp.overlap import compute_step_breakdown
from ddpscope.viz.lanes import comm_lane, compute_lane, lane_position
from ddpscope.viz.trace import load_run
from tests.conftest import SAMPLES


@pytest.fixture(scope="module")
def trace():
    return load_run(SAMPLES / "gpt-2rank-cap1mb")


def _trace(fig, name):
    return next(t for t in fig.data if t.name.startswith(name))


def test_one_trace_per_category_with_every_bar(trace):
    fig = make_timeline_figure(trace)  # all non-warm-up steps
    names = [t.name for t in fig.data]
    assert len(names) == len(set(names)) <= 7  # 6 kinds of bars and the "launched last" markers
    shown = trace.steps[~trace.steps.warmup]
    buckets = _trace(fig, "bucket all-reduce")
    assert len(buckets.x) == len(trace.buckets.merge(shown[["rank", "step"]]))
    assert set(buckets.y) == {lane_position(fig, comm_lane(0)), lane_position(fig, comm_lane(1))}
    assert len(_trace(fig, "forward").x) == len(shown)
    assert set(_trace(fig, "backward").y) == {lane_position(fig, compute_lane(r)) for r in (0, 1)}
    assert lane_position(fig, compute_lane(0)) > lane_position(fig, comm_lane(0)) > lane_position(fig, compute_lane(1))
    # buckets are coloured by index
    from ddpscope.viz.lanes import BUCKET_PALETTE

    index = trace.buckets.merge(shown[["rank", "step"]])["bucket"]
    assert list(buckets.marker.color) == [BUCKET_PALETTE[b % len(BUCKET_PALETTE)] for b in index]  # a colour a bucket
    assert "colorbar" not in buckets.marker.to_plotly_json()  # categories, not a scale


def test_single_step_times_are_ms_from_its_start_and_hover_has_bandwidth(trace):
    fig = make_timeline_figure(trace, steps=[4], ranks=[0])
    s = trace.steps.query("rank == 0 and step == 4").iloc[0]
    fwd = _trace(fig, "forward")
    assert fwd.base[0] == pytest.approx(0.0)
    assert fwd.x[0] == pytest.approx((s.forward_end_us - s.forward_start_us) / 1e3)
    b = _trace(fig, "bucket all-reduce")
    assert set(b.y) == {lane_position(fig, comm_lane(0))} and len(b.x) == 20
    ev = compute_bucket_events(trace).query("rank == 0 and step == 4").sort_values("bucket")
    assert np.allclose(b.x, ev["duration_ms"]) and np.allclose(b.base, (ev["launch_us"] - s.start_us) / 1e3)
    row = b.customdata[0]
    assert "busbw" in b.hovertemplate and row[6] == pytest.approx(row[5] * bus_bandwidth_factor(2))
    assert row[1] == pytest.approx(ev["duration_ms"].iloc[0]) and row[2] == 0
    assert b.hovertext[0] == ", ".join(ev["params"].iloc[0][:4]) + ("" if len(ev["params"].iloc[0]) <= 4 else b.hovertext[0][-9:])


def test_exposed_bars_equal_exposed_communication(trace):
    fig = make_timeline_figure(trace)
    ex = _trace(fig, "exposed")
    per_lane = {}
    for lane, dur, (step, _) in zip(ex.y, ex.x, ex.customdata):
        per_lane[(lane, int(step))] = per_lane.get((lane, int(step)), 0.0) + dur
    pos = {r: lane_position(fig, comm_lane(r)) for r in (0, 1)}
    b = compute_step_breakdown(trace)
    for r in b.itertuples():
        assert per_lane.get((pos[r.rank], r.step), 0.0) == pytest.approx(r.exposed_ms, abs=1e-6)


def test_bucket_table(trace):
    t = compute_bucket_table(trace)
    assert list(t["bucket"]) == list(range(20))
    assert (t["mib"] > 0.9).all() and (t["duration_ms"] > 0).all() and (t["algbw_gbps"] > 0).all()
    assert t["num_params"].sum() == len(trace.run["param_names"])


def test_nothing_to_show_gives_an_empty_figure(trace):
    fig = make_timeline_figure(trace, steps=[999])
    assert len(fig.data) == 0 and "no finished steps" in fig.layout.title.text


def test_big_views_switch_to_webgl_segments_with_the_same_numbers():
    from benchmarks.gantt import synthetic_trace

    big = synthetic_trace(ranks=4, steps=30, buckets=20, params=40)
    fig = make_timeline_figure(big, include_warmup=True, webgl=True)
    # SVG: bars, and the markers of who launched each bucket last
    assert {type(t).__name__ for t in make_timeline_figure(big, include_warmup=True, webgl=False).data} == {"Bar",
                                                                                                           "Scatter"}
    auto = make_timeline_figure(synthetic_trace(ranks=8, steps=40, buckets=30, params=60), include_warmup=True)
    assert {type(t).__name__ for t in auto.data} == {"Scattergl"}
    assert {type(t).__name__ for t in fig.data} == {"Scattergl"}
    lines = [t for t in fig.data if t.name == "bucket all-reduce" and t.mode == "lines"]
    assert len(lines) == 12 and sum(t.showlegend for t in lines) == 1  # bucket colours in 12 bands
    assert sum(np.isfinite(t.x).sum() for t in lines) == 2 * len(big.buckets)  # start and end of each
    hover = next(t for t in fig.data if t.name == "bucket all-reduce" and t.mode == "markers")
    assert len(hover.x) == len(big.buckets) and "busbw" in hover.hovertemplate
    seg = next(t for t in fig.data if t.name.startswith("backward") and t.mode == "lines")
    seg_hover = next(t for t in fig.data if t.name.startswith("backward") and t.mode == "markers")
    starts, ends = seg.x[0::3], seg.x[1::3]
    assert np.allclose(ends - starts, seg_hover.customdata[:, 1], atol=1e-3)  # hover durations = drawn segments
    assert np.allclose((starts + ends) / 2, seg_hover.x, atol=1e-3)


def test_on_nccl_a_bucket_launched_behind_another_is_queued_and_its_bandwidth_counts_its_run(trace):
    """NCCL runs a group's all-reduces in order: a bucket launched while an earlier one of
    its step still runs waits, and starts when every earlier one has ended. Gloo runs
    several at once: no queue. With the backend's own kernel time, that gives the start.
    (The sample is a gloo run; its ranks are relabelled NCCL to read the same spans so.)"""
    import dataclasses

    gloo = compute_bucket_events(trace)
    assert (gloo["queued_ms"] == 0).all() and np.allclose(gloo["run_ms"], gloo["duration_ms"])
    nccl = dataclasses.replace(trace, ranks={r: {**m, "backend": "nccl"} for r, m in trace.ranks.items()}, cache={})
    ev = compute_bucket_events(nccl)
    queued = 0
    for _, g in ev.groupby(["rank", "step"]):
        g = g.sort_values("launch_us")
        before = g["done_us"].cummax().shift().to_numpy()
        start = np.minimum(np.fmax(g["launch_us"].to_numpy(), before), g["done_us"])  # gloo's can end out of order
        assert np.allclose(g["queued_ms"], (start - g["launch_us"]) / 1e3)
        queued += int((g["queued_ms"] > 0).sum())
    assert queued > 0  # the 1 MiB sample launches buckets faster than gloo reduces them
    assert np.allclose(ev["queued_ms"] + ev["run_ms"], ev["duration_ms"])
    ran = ev["run_ms"] > 0
    assert np.allclose(ev["algbw_gbps"][ran], (ev["bytes"] / (ev["run_ms"] * 1e-3) / 1e9)[ran])
    assert ev["algbw_gbps"][~ran].isna().all()  # no running time, no bandwidth (never infinite)
    assert (ev["busbw_gbps"][ran] >= gloo["busbw_gbps"][ran] - 1e-9).all()  # never read lower for the wait
    table = compute_bucket_table(nccl)
    assert (table["queued_ms"] >= 0).all() and table["queued_ms"].max() > 0
    fig = make_timeline_figure(nccl, steps=[4])
    hatch = _trace(fig, "queued behind earlier buckets")
    shown = ev[(ev["step"] == 4) & (ev["queued_ms"] > 0)]
    assert len(hatch.x) == len(shown) and np.allclose(sorted(hatch.x), sorted(shown["queued_ms"]))
    # the backend timed the kernel (TORCH_NCCL_ENABLE_TIMING=1): its start is the end less that
    b = nccl.buckets.assign(kernel_us=(nccl.buckets["done_us"] - nccl.buckets["launch_us"]) / 4)
    timed = compute_bucket_events(dataclasses.replace(nccl, buckets=b, cache={}))
    assert np.allclose(timed["run_ms"], timed["duration_ms"] / 4)
