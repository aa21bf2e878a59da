"""Loading run folders: alignment, and clear one-line errors for everything else."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pytest

from ddpscope.viz.run_files import clock_params
from ddpscope.viz.trace import TraceError, load_run
from tests.conftest import KINETO


def _meta(rank, world=2, offset=None, **kw):
    return {"format": "ddpscope-trace", "version": 1, "status": "complete", "rank": rank, "world_size": world,
            "param_names": ["w", "b"], "clock_offset": offset or {"start": None, "end": None}, **kw}


def _step_events(rank, step, t0):
    return [
        {"ph": "X", "cat": "step", "name": f"step {step}", "pid": rank, "tid": 1, "ts": t0, "dur": 100.0,
         "args": {"step": step, "warmup": step == 0}},
        {"ph": "X", "cat": "forward", "name": "forward", "pid": rank, "tid": 1, "ts": t0, "dur": 20.0, "args": {"step": step}},
        {"ph": "X", "cat": "backward", "name": "backward", "pid": rank, "tid": 1, "ts": t0 + 25, "dur": 40.0, "args": {"step": step}},
        {"ph": "X", "cat": "optimizer", "name": "optimizer.step", "pid": rank, "tid": 1, "ts": t0 + 80, "dur": 20.0, "args": {"step": step}},
        {"ph": "i", "s": "t", "cat": "grad_ready", "name": "b", "pid": rank, "tid": 2, "ts": t0 + 40, "args": {"step": step, "param": 1}},
        {"ph": "X", "cat": "allreduce", "name": "bucket 0", "pid": rank, "tid": 100, "ts": t0 + 45, "dur": 30.0,
         "args": {"step": step, "bucket": 0, "bytes": 4096, "params": ["b", "w"]}},
    ]


def write_run(folder, ranks, run=None):
    folder.mkdir(parents=True, exist_ok=True)
    for r, (meta, events) in ranks.items():
        (folder / f"rank-{r}.json").write_text(json.dumps({"traceEvents": events, "otherData": {"ddpscope": meta}}))
    if run is not None:
        (folder / "run.json").write_text(json.dumps(run))
    return folder


def test_offsets_align_ranks_with_drift(tmp_path):
    # the offset moved 10 µs, more than its estimates' bounds (half of each 4 µs round trip) allow: drift
    drift = {"start": {"offset_us": -1000.0, "rtt_us": 4, "at_us": 0.0},
             "end": {"offset_us": -1010.0, "rtt_us": 4, "at_us": 10_000.0}}
    run = write_run(tmp_path / "r", {
        0: (_meta(0), _step_events(0, 0, 1000.0) + _step_events(0, 1, 6000.0)),
        1: (_meta(1, offset=drift), _step_events(1, 0, 2000.0) + _step_events(1, 1, 7005.0)),
    }, run={"format": "ddpscope-trace", "world_size": 2, "status": "complete"})
    t = load_run(run)
    steps = t.steps.set_index(["rank", "step"])
    assert steps.loc[(1, 0), "start_us"] == pytest.approx(2000 - 1000 - 2)  # offset interpolated at t=2000
    assert steps.loc[(1, 1), "start_us"] == pytest.approx(7005 - 1000 - 7.005)
    assert steps.loc[(1, 0), "end_us"] == pytest.approx(2100 - 1000 - 2.1)  # the end gets its own offset
    assert list(t.steps.warmup) == [True, False, True, False]
    assert t.buckets.params.iloc[0] == ["b", "w"] and t.grads.name.iloc[0] == "b"


def test_an_offset_that_moved_less_than_its_estimates_bounds_is_one_offset_without_drift(tmp_path):
    """Each estimate is exact to half its round trip: one of -1000 ± 25 µs and one of -1010 ±
    25 µs allow every offset in [-1025, -985] and no drift can be told from them (ranks on
    one host; a short run): the middle, -1005, and no slope, so spans keep their lengths."""
    noise = {"start": {"offset_us": -1000.0, "rtt_us": 50, "at_us": 0.0},
             "end": {"offset_us": -1010.0, "rtt_us": 50, "at_us": 10_000.0}}
    assert clock_params({"clock_offset": noise}) == (-1005.0, 0.0, 0.0)
    run = write_run(tmp_path / "r", {
        0: (_meta(0), _step_events(0, 0, 1000.0) + _step_events(0, 1, 6000.0)),
        1: (_meta(1, offset=noise), _step_events(1, 0, 2000.0) + _step_events(1, 1, 7005.0)),
    }, run={"format": "ddpscope-trace", "world_size": 2, "status": "complete"})
    steps = load_run(run).steps.set_index(["rank", "step"])
    assert steps.loc[(1, 1), "start_us"] == 7005 - 1005 and steps.loc[(1, 1), "end_us"] == 7105 - 1005
    # a trace from before round trips were kept (none said): any move is drift, as it was read then
    old = {k: {"offset_us": v["offset_us"], "at_us": v["at_us"]} for k, v in noise.items()}
    assert clock_params({"clock_offset": old}) == (-1000.0, -1e-3, 0.0)
    bad = {"start": {**noise["start"], "rtt_us": -5.0}, "end": noise["end"]}  # a round trip below 0
    write_run(tmp_path / "bad", {0: (_meta(0), _step_events(0, 0, 1000.0)),
                                 1: (_meta(1, offset=bad), _step_events(1, 0, 2000.0))},
              run={"format": "ddpscope-trace", "world_size": 2, "status": "complete"})
    with pytest.raises(TraceError, match="clock offset is not a finite"):
        load_run(tmp_path / "bad")


@pytest.mark.parametrize("setup, message", [
    ("not_a_folder", "is not a folder"),
    ("empty", "holds no rank-<r>.json"),
    ("truncated", "is not valid JSON (truncated"),
    ("binary", "is not UTF-8 text"),
    ("other_tool", "is not a ddpscope trace"),
    ("missing_rank", "rank 1 of 2 are missing"),
    ("future_version", "trace format version 99"),
    ("bad_event", "malformed trace event"),
    ("wrong_rank", "rank 3"),  # says it is rank 3, outside a job of 2
])
def test_bad_input_raises_one_line_trace_error(tmp_path, setup, message):
    folder = tmp_path / "r"
    good = {0: (_meta(0), _step_events(0, 0, 0.0)), 1: (_meta(1), _step_events(1, 0, 0.0))}
    if setup == "not_a_folder":
        folder.write_text("x")
    elif setup == "empty":
        folder.mkdir()
    else:
        write_run(folder, good)
        target = folder / "rank-1.json"
        if setup == "truncated":
            target.write_text(target.read_text()[:-40])
        elif setup == "binary":
            target.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe")
        elif setup == "other_tool":
            target.write_text(json.dumps({"traceEvents": [], "deviceProperties": []}))
        elif setup == "missing_rank":
            target.unlink()
        elif setup == "future_version":
            write_run(folder, {1: (_meta(1, version=99), [])})
        elif setup == "bad_event":
            write_run(folder, {1: (_meta(1), [{"ph": "X", "cat": "step", "ts": "soon", "args": {"step": 0}}])})
        elif setup == "wrong_rank":
            write_run(folder, {1: (_meta(3), [])})
    with pytest.raises(TraceError) as e:
        load_run(folder)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_missing_ranks_can_be_allowed(tmp_path):
    folder = write_run(tmp_path / "r", {0: (_meta(0), _step_events(0, 0, 0.0))})
    trace = load_run(folder, allow_missing_ranks=True)
    assert trace.steps["rank"].tolist() == [0]
    assert trace.status == "incomplete" and "rank 1 are missing" in trace.unfinished


RUN = {"format": "ddpscope-trace", "version": 1, "world_size": 2, "status": "complete"}


@pytest.mark.parametrize("rank1, run, status, reason", [
    ({}, RUN, "complete", None),
    # its last write never came: the file holds the steps written whole before
    ({"status": "running", "steps": 1}, RUN, "incomplete", "rank 1 after step 1"),
    ({"status": "failed", "error": "RuntimeError: boom"}, RUN, "failed", "rank 1 failed: RuntimeError: boom"),
    ({}, {**RUN, "status": "running"}, "incomplete", "run.json was not finished"),
    ({}, {**RUN, "status": "incomplete", "error": "the trace is incomplete (rank 1 ...)"}, "incomplete",
     "the trace is incomplete (rank 1 ...)"),
    ({"status": "running"}, {**RUN, "status": "failed", "error": "rank 0 was killed"}, "failed", "rank 0 was killed"),
])
def test_status_is_complete_only_when_every_file_says_so(tmp_path, rank1, run, status, reason):
    folder = write_run(tmp_path / "r", {0: (_meta(0), _step_events(0, 0, 0.0)),
                                        1: (_meta(1, **rank1), _step_events(1, 0, 0.0))}, run)
    trace = load_run(folder)
    assert trace.status == status
    assert trace.unfinished is None if reason is None else reason in trace.unfinished


@pytest.mark.skipif(not KINETO.exists(), reason="../shared/data/kineto is absent")
def test_a_real_pytorch_profiler_trace_is_recognised_as_another_tools(tmp_path):
    folder = tmp_path / "kineto"
    folder.mkdir()
    with gzip.open(KINETO / "hta-sampled-2rank" / "rank-0.json.gz") as src, open(folder / "rank-0.json", "wb") as dst:
        shutil.copyfileobj(src, dst)
    with pytest.raises(TraceError, match="not a ddpscope trace"):
        load_run(folder)


@pytest.mark.parametrize("make, message", [
    (lambda p, src: os.mkfifo(p), "not a regular file"),  # opening it would block the reader
    (lambda p, src: p.symlink_to(src), "is a link"),
])
def test_fifos_and_links_among_rank_files_are_refused_not_opened(tmp_path, make, message):
    from tests.conftest import SAMPLES

    folder = tmp_path / "run"
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", folder)
    (folder / "rank-1.json").unlink()
    make(folder / "rank-1.json", SAMPLES / "mlp-2rank-cap1mb" / "rank-1.json")
    with pytest.raises(TraceError, match=message):
        load_run(folder)


def test_a_step_line_repeated_in_a_summary_is_one_line(tmp_path, mlp_run):
    """Every per-step table is keyed by (rank, step): a repeated step line in a summary (an
    edited folder, two runs in one) failed later on the page ("cannot handle a non-unique
    multi-index"); the loader says what is wrong."""
    run = tmp_path / "run"
    shutil.copytree(mlp_run[0], run, ignore=shutil.ignore_patterns("live", "logs"))
    (run / "rank-1.json").unlink()  # rank 1 is read from its summary
    path = run / "rank-1.summary.jsonl"
    lines = path.read_text().splitlines()
    lines.append(next(line for line in lines if line.startswith('{"step":2,')))
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"rank 1 records step 2 more than once \(in its summary\)"):
        load_run(run, events_for=[0])
