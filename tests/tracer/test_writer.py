"""The trace writer: readable after every flush, appended to (never rewritten), closed
into a valid Chrome trace; small files written atomically."""

from __future__ import annotations

import json
import time

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.tracer.writer import TraceWriter, write_json_atomic
from ddpscope.viz.run_files import read_rank_file
from ddpscope.viz.trace import TraceError
from tests.chrome_trace import check_chrome_trace


def _wait_for(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return False


def _events(step):
    return [{"ph": "X", "cat": "step", "name": f"step {step}", "pid": 0, "tid": 1, "ts": step * 100.0,
             "dur": 50.0, "args": {"step": step}}]


META = {"format": fmt.FORMAT, "version": fmt.VERSION, "status": fmt.RUNNING, "rank": 0, "world_size": 1}


def _steps(path):
    return [e["args"]["step"] for e in read_rank_file(path)[1] if e.get("cat") == "step"]


def test_file_is_readable_after_each_flush_appended_to_and_closed_valid(tmp_path):
    path = tmp_path / "rank-0.json"
    w = TraceWriter(path, META, min_interval_s=0.0)
    assert read_rank_file(path) == ({**META, "steps": 0}, [])  # exists before any step
    before = path.read_bytes()
    for step in range(5):
        w.add(_events(step))
        assert _wait_for(lambda: len(_steps(path)) == step + 1)
        now = path.read_bytes()
        assert now.startswith(before)  # appended: what was written is never rewritten
        before = now
    assert read_rank_file(path)[0]["steps"] == 5  # a running rank's steps are counted from its events
    w.close(status=fmt.COMPLETE, steps=5)
    doc = json.loads(path.read_text())  # closed: strict JSON (array form)
    meta, events = read_rank_file(path)
    assert meta["status"] == fmt.COMPLETE and meta["steps"] == 5
    assert [e["args"]["step"] for e in events] == list(range(5))
    assert check_chrome_trace(doc) == []
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]  # no temporary files left


def test_the_metadata_is_appended_only_when_it_changes(tmp_path):
    path = tmp_path / "rank-0.json"
    w = TraceWriter(path, META, min_interval_s=0.0)
    for step in range(20):
        w.add(_events(step))
    assert _wait_for(lambda: len(_steps(path)) == 20)
    w.set_meta(bucket_layouts=[{"from_step": 1, "buckets": [[0, 1]]}])
    assert _wait_for(lambda: read_rank_file(path)[0].get("bucket_layouts"))
    w.close(status=fmt.COMPLETE)
    metas = [e for e in json.loads(path.read_text()) if e.get("name") == fmt.META_EVENT]
    assert len(metas) == 3  # at the start, the change, the end: not one per flush


def test_steps_handed_over_within_the_interval_go_out_in_one_flush(tmp_path):
    # the writer sleeps its interval out after a flush: a step's hand-over does not wake
    # it (that would cost the training thread a flush per step); close() does
    path = tmp_path / "rank-0.json"
    w = TraceWriter(path, META, min_interval_s=30.0)
    w.add(_events(0))
    assert _wait_for(lambda: _steps(path) == [0])  # idle: the first hand-over is written at once
    for step in range(1, 20):
        w.add(_events(step))
        time.sleep(0.005)
    time.sleep(0.2)
    assert _steps(path) == [0]  # the rest wait for the interval ...
    start = time.monotonic()
    w.close(status=fmt.COMPLETE)
    assert time.monotonic() - start < 5  # ... or for close, which does not wait it out
    assert _steps(path) == list(range(20))


def test_a_writer_that_is_never_closed_or_cut_mid_line_leaves_the_steps_it_wrote(tmp_path):
    path = tmp_path / "rank-1.json"
    w = TraceWriter(path, {**META, "rank": 1, "world_size": 2}, min_interval_s=0.0)
    w.add(_events(0) + _events(1))
    assert _wait_for(lambda: len(_steps(path)) == 2)
    meta, _ = read_rank_file(path)
    assert meta["status"] == fmt.RUNNING
    with open(path, "ab") as f:  # a write torn by a full disk or a kill: half an event, no newline
        f.write(b',\n{"ph":"X","cat":"step","name":"step 2","pid":0,"tid":1,"ts":2')
    assert _steps(path) == [0, 1] and read_rank_file(path)[0]["status"] == fmt.RUNNING


def test_write_errors_surface_at_close_not_during_training_and_nothing_is_recreated(tmp_path):
    path = tmp_path / "gone" / "rank-0.json"
    (tmp_path / "gone").mkdir()
    w = TraceWriter(path, META, min_interval_s=0.0)
    path.unlink()
    w.add(_events(0))  # does not raise
    assert _wait_for(lambda: w.error is not None)
    with pytest.raises(OSError, match="could not write trace"):
        w.close(status=fmt.COMPLETE)
    assert not path.exists()  # not recreated holding only the last piece


def test_garbage_is_still_one_clear_error(tmp_path):
    for name, raw in (("a", b"[\n{\"ph\": oops"), ("b", b"[1, 2]"), ("c", b"{}")):
        path = tmp_path / f"rank-{name}.json"
        path.write_bytes(raw)
        with pytest.raises(TraceError):
            read_rank_file(path)


def test_atomic_json_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "run.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
