"""Overlap metrics on hand-made traces with known answers."""

import json

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


def test_a_backward_span_past_its_last_gradient_is_waiting_and_an_all_reduce_over_it_exposed(tmp_path):
    """The span's compute ends at its last gradient (``compute_us``): the rest of the span
    (autograd finishing, DDP's finalize waiting for a late rank) hides no communication."""
    from ddpscope.viz.ddp.gantt import exposed_segments, make_timeline_figure

    events = _step_events(0, 0, 0.0) + _step_events(0, 1, 1000.0)
    for e in events:
        if e["cat"] == "backward" and e["args"]["step"] == 1:
            e["args"]["compute_us"] = 15.0  # compute [1025, 1040]; the span runs on to 1065
    events.append({"ph": "X", "cat": "allreduce", "name": "bucket 1", "pid": 0, "tid": 101, "ts": 1050.0,
                   "dur": 40.0, "args": {"step": 1, "bucket": 1, "bytes": 8, "params": ["w"]}})
    events.append({"ph": "X", "cat": "grad_sync", "name": "wait for all-reduce", "pid": 0, "tid": 1, "ts": 1065.0,
                   "dur": 25.0, "args": {"step": 1}})
    t = load_run(write_run(tmp_path / "r", {0: (_meta(0, world=1), events)}))
    row = compute_step_breakdown(t).iloc[0]
    assert row.comm_ms == pytest.approx(0.045) and row.overlapped_ms == pytest.approx(0.0)
    assert row.exposed_ms == pytest.approx(0.045) and row.overlap_pct == pytest.approx(0.0)
    step = t.steps[t.steps["step"] == 1].iloc[0]
    assert step["compute_end_us"] == pytest.approx(1040.0) and step["backward_end_us"] == pytest.approx(1065.0)
    shown = t.steps[t.steps["step"] == 1]
    ex = exposed_segments(t, shown)
    assert ex[["start_us", "end_us"]].values.tolist() == [[1045.0, 1090.0]]  # all of it hatched
    fig = make_timeline_figure(t, steps=[1])
    wait = next(d for d in fig.data if d.name == "waiting for all-reduce")
    assert list(wait.x) == pytest.approx([0.050])  # 1040 -> 1090: from the last gradient, not the span's end


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


@pytest.mark.ddp
@pytest.mark.breadth
def test_a_delayed_ranks_peer_waiting_inside_backward_counts_its_all_reduce_exposed(tmp_path):
    """From a real run where rank 1 is 60 ms late each forward: rank 0's all-reduces wait
    for it. Rank 0's backward span of one step is made to run on to its last all-reduce's
    end (DDP's finalize waiting there: seen in the wild, 27.9 ms past the last gradient).
    Its all-reduce after the last gradient is then exposed and hatched, as its span's end
    no longer decides; before, it was counted overlapped, drawn over a blank compute lane."""
    from ddpscope.viz.ddp.gantt import exposed_segments
    from tests.conftest import run_cli

    out = tmp_path / "late"
    proc = run_cli("run", "--nproc", "2", "--demo", "mlp", "--steps", "5", "--bucket-cap-mb", "1", "--out", str(out),
                   env={"DDPSCOPE_TEST_DELAY_FORWARD": "1:60"})
    assert proc.returncode == 0, proc.stderr
    before = load_run(out)
    step = 3
    done = float(before.buckets.query("rank == 0 and step == @step")["done_us"].max())
    last_grad = float(before.grads.query("rank == 0 and step == @step")["ready_us"].max())
    assert done - last_grad > 30_000  # rank 0 waited for rank 1 after its last gradient
    path = out / "rank-0.json"
    lines = path.read_text().splitlines()
    for n, line in enumerate(lines):  # one step's events a line: stretch its backward span to `done`
        if '"cat":"backward"' in line and f'"step":{step},' in line:
            doc = json.loads("[" + line.rstrip(",") + "]")
            for e in doc:
                if e.get("cat") == "backward" and e["args"]["step"] == step:
                    stretch = (done - before.steps.query("rank == 0 and step == @step")["backward_end_us"].iloc[0])
                    e["dur"] = round(e["dur"] + stretch, 3)
            lines[n] = json.dumps(doc, separators=(",", ":"))[1:-1] + ("," if line.endswith(",") else "")
    path.write_text("\n".join(lines) + "\n")
    for s in out.glob("*.summary.jsonl"):
        s.unlink()  # the summary was folded from the unstretched events
    t = load_run(out)
    row = t.steps.query("rank == 0 and step == @step").iloc[0]
    assert row["backward_end_us"] == pytest.approx(done, abs=1)  # the stretched span
    assert row["compute_end_us"] == pytest.approx(last_grad, abs=1)  # compute still ends at the last gradient
    b = compute_step_breakdown(t).query("rank == 0 and step == @step").iloc[0]
    assert b.exposed_ms * 1e3 >= done - last_grad - 1_000  # the wait after the last gradient is exposed
    ex = exposed_segments(t, t.steps.query("rank == 0 and step == @step"))
    assert ex["end_us"].max() == pytest.approx(done, abs=1) and ex["start_us"].min() <= last_grad + 1_000
