"""Summary-first loading (tracer/step_summary.py, the writer's summaries, load_run's
``events_for``, viz/parallel.py): each rank's summary, written by the rank as it
trains, gives the viewer the very step table its events give; a viewer of many ranks
reads summaries, and events only for the ranks it shows. On a real 3-rank DDP run
(gloo), and runs of 12 ranks synthesised from it by the benchmark's synthesiser, which
writes each rank through the tracer's own writer."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from benchmarks.many_ranks import synthesise
from ddpscope.tracer import format as fmt
from ddpscope.tracer.writer import TraceWriter
from ddpscope.viz import parallel
from ddpscope.viz.ddp.rank_overview import compute_rank_overview, compute_slow_ranks
from ddpscope.viz.intervals import covered, merge_intervals
from ddpscope.viz.run_files import TraceError, read_rank_file, read_summary_file
from ddpscope.viz.sources.rank_events import select_ranks, with_events
from ddpscope.viz.trace import load_run
from tests.conftest import ROOT, run_cli

RANKS, STEPS, BIG, SLOW = 3, 8, 12, 7


@pytest.fixture(scope="module")
def real_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("summary") / "real"
    proc = run_cli("run", "--demo", "mlp", "--nproc", str(RANKS), "--steps", str(STEPS), "--out", str(out), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def twelve_ranks(real_run, tmp_path_factory):
    runs = tmp_path_factory.mktemp("twelve") / "runs"
    synthesise(real_run, runs / "twelve", BIG, SLOW)
    return runs / "twelve"


@pytest.mark.ddp
def test_each_rank_writes_a_summary_that_gives_the_steps_its_events_give(real_run):
    assert sorted(p.name for p in real_run.glob("*.summary.jsonl")) == [fmt.summary_file(r) for r in range(RANKS)]
    full, summary = load_run(real_run), load_run(real_run, events_for=())
    assert full.event_ranks is None and summary.event_ranks == () and len(summary.buckets) == 0
    pd.testing.assert_frame_equal(full.steps, summary.steps)  # exactly: one fold, one alignment
    pd.testing.assert_frame_equal(full.memory, summary.memory)
    assert len(full.steps) == RANKS * STEPS and full.memory["rss_bytes"].gt(0).all()
    pd.testing.assert_frame_equal(compute_rank_overview(full), compute_rank_overview(summary))
    for r in range(RANKS):  # what the summary leaves out of the metadata, run.json holds
        assert {k: v for k, v in full.ranks[r].items() if k not in fmt.SUMMARY_META_LEFT_OUT} == \
            {k: v for k, v in summary.ranks[r].items() if k != "summary_version"}


@pytest.mark.ddp
def test_a_summarys_communication_figures_match_the_bucket_intervals(real_run):
    """Against numpy's union of the parsed bucket and backward intervals (viz.ddp.overlap's
    own, not the summary's fold), on rank 0's clock: the same to 0.01 ms."""
    trace = load_run(real_run, events_for=())
    full = load_run(real_run)
    for (rank, step), b in full.buckets.groupby(["rank", "step"]):
        row = trace.steps[(trace.steps["rank"] == rank) & (trace.steps["step"] == step)].iloc[0]
        merged = merge_intervals(b["launch_us"].to_numpy(), b["done_us"].to_numpy())
        p = full.passes[(full.passes["rank"] == rank) & (full.passes["step"] == step)]
        # backward compute: to each pass's last gradient (the span may run on, waiting)
        inside = sum(covered(merged, lo, hi) for lo, hi in zip(p["backward_start_us"], p["compute_end_us"]))
        assert (p["compute_end_us"] <= p["backward_end_us"]).all()
        assert row["num_buckets"] == len(b) and row["bucket_bytes"] == b["bytes"].sum()
        assert row["comm_us"] == pytest.approx(covered(merged, -np.inf, np.inf), abs=10)
        assert row["overlapped_us"] == pytest.approx(inside, abs=10)
        assert row["first_launch_us"] == pytest.approx(b["launch_us"].min(), abs=10)
        assert row["last_done_us"] == pytest.approx(b["done_us"].max(), abs=10)


@pytest.mark.ddp
def test_the_viewer_reads_events_only_for_the_ranks_it_shows(real_run):
    full = load_run(real_run)
    one = load_run(real_run, events_for=[2])
    assert one.event_ranks == (2,) and set(one.buckets["rank"]) == {2} and set(one.grads["rank"]) == {2}
    assert not one.all_events
    two = with_events(one, [0, 2])
    assert two.event_ranks == (0, 2) and set(two.buckets["rank"]) == {0, 2}
    for name in ("buckets", "grads", "passes"):
        want = getattr(full, name)
        pd.testing.assert_frame_equal(getattr(two, name), want[want["rank"].isin([0, 2])].reset_index(drop=True))
    cut = select_ranks(two, two.event_ranks)
    assert sorted(cut.ranks) == [0, 2] and set(cut.steps["rank"]) == {0, 2} and cut.world_size == RANKS
    assert with_events(full, [1]) is full  # every rank's events are there already


def test_the_writer_appends_the_summary_at_every_flush_and_a_torn_line_is_dropped(real_run, tmp_path):
    meta, events = read_rank_file(real_run / fmt.rank_file(0))
    by_step: dict[int, list] = {}
    for e in events:
        if "step" in (e.get("args") or {}):
            by_step.setdefault(e["args"]["step"], []).append(e)
    path, spath = tmp_path / fmt.rank_file(0), tmp_path / fmt.summary_file(0)
    writer = TraceWriter(path, {**meta, "status": fmt.RUNNING}, 0.0, summary_path=spath)
    try:
        assert read_summary_file(spath, 0)[1] == []  # made whole before the first step
        for n, step in enumerate(sorted(by_step)[:3], start=1):
            writer.add(by_step[step])
            writer._flush()  # what the writer's thread does at its next wake-up
            got, rows = read_summary_file(spath, 0)
            assert [r.step for r in rows] == sorted(by_step)[:n] and got["status"] == fmt.RUNNING
            assert got["steps"] == n  # a running rank counts its rows
    finally:
        writer.close(status=fmt.COMPLETE, steps=3)
    meta_end, rows = read_summary_file(spath, 0)
    assert meta_end["status"] == fmt.COMPLETE and len(rows) == 3
    with open(spath, "ab") as f:  # a write cut short
        f.write(b'{"step":3,"start_us":1')
    assert len(read_summary_file(spath, 0)[1]) == 3
    writer.unlink()
    assert not path.exists() and not spath.exists()


@pytest.mark.ddp
@pytest.mark.parametrize("bad, message", [
    (b"\x00\xff garbage\n", "is not JSON lines"),
    (b'{"step":"three","start_us":1,"end_us":2}\n', "Expected `int"),
    (b'{"step":1}\n', "neither a step"),
    (b'{"meta":{"format":"ddpscope-trace","version":2,"rank":1,"world_size":3,"summary_version":1}}\n', "says it is rank 1"),
    (b'{"meta":{"format":"ddpscope-trace","version":2,"rank":0,"world_size":3,"summary_version":9}}\n', "summary version 9"),
    (b'{"meta":{"format":"other"}}\n', "not a ddpscope summary"),
])
def test_a_bad_summary_is_one_line_and_the_events_stand_in(real_run, tmp_path, bad, message):
    run = tmp_path / "run"
    shutil.copytree(real_run, run)
    (run / fmt.summary_file(0)).write_bytes(bad)
    with pytest.raises(TraceError, match=message) as e:
        read_summary_file(run / fmt.summary_file(0), 0)
    assert "\n" not in str(e.value)
    pd.testing.assert_frame_equal(load_run(run, events_for=()).steps, load_run(real_run).steps)
    only = tmp_path / "only"  # the summaries alone: nothing stands in
    only.mkdir()
    for p in [run / fmt.RUN_FILE, *run.glob("*.summary.jsonl")]:
        shutil.copy(p, only / p.name)
    proc = run_cli("summary", str(only))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and message.split("`")[0] in proc.stderr


@pytest.mark.ddp
def test_a_folder_of_summaries_alone_gives_the_same_summary(real_run, tmp_path):
    only = tmp_path / "only"
    only.mkdir()
    for p in [real_run / fmt.RUN_FILE, *real_run.glob("*.summary.jsonl")]:
        shutil.copy(p, only / p.name)
    full, alone = (json.loads(run_cli("summary", "--json", str(p)).stdout) for p in (real_run, only))
    assert alone["ranks"] == full["ranks"] and alone["status"] == "complete"
    assert "stragglers" in full and "stragglers" not in alone  # who each bucket waited for needs the buckets
    trace = load_run(only, events_for=())
    with pytest.raises(TraceError, match="events of rank 1 are not in the folder"):
        with_events(trace, [1])
    assert with_events(trace, [1], missing_ok=True) is trace
    shutil.copy(real_run / fmt.rank_file(1), only / fmt.rank_file(1))  # one rank's events brought beside them
    assert with_events(trace, [0, 1], missing_ok=True).event_ranks == (1,)


@pytest.mark.breadth
def test_parsing_many_big_files_uses_other_processes(monkeypatch):
    assert parallel.map_on_cores(os.getpid, [()] * 3, [1] * 3) == [os.getpid()] * 3  # small: here
    if parallel.cores() < 2:
        pytest.skip("one core: nothing to spread over")
    monkeypatch.setattr(parallel, "MIN_PARALLEL_BYTES", 0)
    pids = parallel.map_on_cores(os.getpid, [()] * 4, [1, 4, 2, 3])
    assert len(pids) == 4 and os.getpid() not in pids
    with pytest.raises(ZeroDivisionError):
        parallel.map_on_cores(divmod, [(1, 1), (1, 0)], [1, 1])


@pytest.mark.ddp
def test_every_core_parses_the_same_tables(real_run, monkeypatch):
    serial = load_run(real_run)
    monkeypatch.setattr(parallel, "MIN_PARALLEL_BYTES", 0)
    spread = load_run(real_run)
    for name in ("steps", "buckets", "grads", "passes", "memory"):
        pd.testing.assert_frame_equal(getattr(serial, name), getattr(spread, name))


@pytest.mark.ddp
def test_twelve_ranks_open_from_summaries_with_the_slow_rank_named(twelve_ranks, monkeypatch):
    trace = load_run(twelve_ranks, events_for=())
    slow = compute_slow_ranks(compute_rank_overview(trace))
    assert int(slow["rank"].iloc[0]) == SLOW and slow["launch_delay_ms"].iloc[0] > 20
    proc = run_cli("summary", str(twelve_ranks))
    assert proc.returncode == 0 and f"slowest rank: {SLOW}" in proc.stdout
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(twelve_ranks.parent))
    st_config.set_option("server.address", "127.0.0.1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and at.sidebar.selectbox(key="trace").value == "run: twelve"
    assert any(f"Slowest rank: {SLOW}" in w.value for w in at.warning)
    shown = at.multiselect(key="ranks").value
    assert 0 in shown and SLOW in shown and len(shown) == 4  # rank 0 and the three slowest
    assert any("opened from their summaries" in c.value for c in at.caption)
    assert _gantt_ranks(at) == shown
    at.multiselect(key="ranks").set_value(sorted({*shown, 11})).run()  # another rank: its events read now
    assert not at.exception and _gantt_ranks(at) == sorted({*shown, 11})


def _gantt_ranks(at) -> list[int]:
    """The ranks with an all-reduce lane in the Timeline's Gantt (after the heatmap and
    the spread)."""
    gantt = json.loads(at.get("plotly_chart")[2].proto.spec)
    return sorted(int(t.split()[1]) for t in gantt["layout"]["yaxis"]["ticktext"] if t.endswith("all-reduce"))


@pytest.mark.ddp
def test_the_timeline_opens_a_folder_of_summaries_with_one_ranks_events(twelve_ranks, tmp_path, monkeypatch):
    """A job's traces gathered without their events (rank 0's brought beside them): the
    overview names the slow rank, the Gantt draws what it has, adding a rank without
    events says how to see it."""
    runs = tmp_path / "runs"
    (runs / "gathered").mkdir(parents=True)
    for p in [twelve_ranks / fmt.RUN_FILE, twelve_ranks / fmt.rank_file(0), *twelve_ranks.glob("*.summary.jsonl")]:
        shutil.copy(p, runs / "gathered" / p.name)
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    st_config.set_option("server.address", "127.0.0.1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and at.sidebar.selectbox(key="trace").value == "run: gathered"
    assert any(f"Slowest rank: {SLOW}" in w.value for w in at.warning) and not at.error
    shown = at.multiselect(key="ranks").value
    assert 0 in shown and SLOW in shown
    absent = ", ".join(str(r) for r in shown if r != 0)
    assert any(f"Only the summary of rank {absent} is in this folder" in i.value for i in at.info)
    assert _gantt_ranks(at) == shown  # their steps drawn from the summaries
