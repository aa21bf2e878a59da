"""The trace writer: complete, valid files after every hand-over, written atomically."""

from __future__ import annotations

import json
import time

import pytest

from tests.chrome_trace import check_chrome_trace
from tracer.writer import TraceWriter, write_json_atomic


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


def test_file_is_valid_after_each_step_and_final_meta_lands(tmp_path):
    path = tmp_path / "rank-0.json"
    w = TraceWriter(path, {"format": "x", "status": "running"}, min_interval_s=0.0)
    assert json.loads(path.read_text())["traceEvents"] == []  # exists before any step
    for step in range(5):
        w.add(_events(step))
        assert _wait_for(lambda: len(json.loads(path.read_text())["traceEvents"]) == step + 1)
    w.close(status="complete")
    doc = json.loads(path.read_text())
    assert doc["otherData"]["ddpscope"]["status"] == "complete"
    assert [e["args"]["step"] for e in doc["traceEvents"]] == list(range(5))
    assert check_chrome_trace(doc) == []
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]  # no temporary files left


def test_a_writer_that_is_never_closed_leaves_the_steps_it_was_given(tmp_path):
    path = tmp_path / "rank-1.json"
    w = TraceWriter(path, {"status": "running"}, min_interval_s=0.0)
    w.add(_events(0) + _events(1))
    assert _wait_for(lambda: len(json.loads(path.read_text())["traceEvents"]) == 2)
    assert json.loads(path.read_text())["otherData"]["ddpscope"]["status"] == "running"


def test_write_errors_surface_at_close_not_during_training(tmp_path):
    path = tmp_path / "gone" / "rank-0.json"
    (tmp_path / "gone").mkdir()
    w = TraceWriter(path, {}, min_interval_s=0.0)
    (tmp_path / "gone" / "rank-0.json").unlink()
    (tmp_path / "gone").rmdir()
    w.add(_events(0))  # does not raise
    with pytest.raises(OSError, match="could not write trace"):
        w.close()


def test_atomic_json_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "run.json"
    write_json_atomic(path, {"a": 1})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["run.json"]
