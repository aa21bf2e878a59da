"""Steps' events built and encoded beside the next backward (``backward_encoder.py``): not
on the training thread, nothing built before backward begins, the file's order kept, a
failure said on the training thread, what is left built at the end; and where it is used.
The real multi-process runs that use it are the stand-in device's
(``test_device_path.py``: every DDP run there encodes beside backward)."""

from __future__ import annotations

import os
import threading

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture import backward_encoder
from ddpscope.tracer.capture.backward_encoder import BackwardEncoder, worth_it
from ddpscope.tracer.writer import TraceWriter
from ddpscope.viz.run_files import read_rank_file

META = {"format": fmt.FORMAT, "version": fmt.VERSION, "status": fmt.RUNNING, "rank": 0, "world_size": 1}


def _steps(step: int, built: list, fail: bool = False):
    """A lazy hand-over, as the recorder's: a step's events made when consumed, noting
    which thread made them."""
    built.append((step, threading.current_thread().name))
    if fail:
        raise ValueError("a bug of ours")
    yield {"ph": "X", "cat": "step", "name": f"step {step}", "pid": 0, "tid": 1, "ts": step * 100.0,
           "dur": 50.0, "args": {"step": step}}


def _wait_for(pred, timeout=5.0) -> bool:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if pred():
            return True
        done.wait(0.01)
    return False


def _written(path) -> list[int]:
    return [e["args"]["step"] for e in read_rank_file(path)[1] if e.get("cat") == "step"]


@pytest.fixture
def writer(tmp_path):
    w = TraceWriter(tmp_path / "rank-0.json", META, min_interval_s=0.0)
    yield w
    if w._thread.is_alive():
        w.close(status=fmt.COMPLETE)


def test_steps_are_built_on_the_encoders_thread_once_backward_begins_and_written_in_order(writer):
    built: list = []
    enc = BackwardEncoder(writer)
    enc.add(_steps(0, built))
    enc.add(_steps(1, built))  # no backward since step 0's: worked at once, by the encoder
    assert _wait_for(lambda: len(built) == 2)
    enc.backward_began()  # an empty queue: nothing to do
    enc.add(_steps(2, built))
    threading.Event().wait(0.1)
    assert len(built) == 2  # lazy: nothing built on the training thread, nor before backward
    enc.backward_began()
    assert _wait_for(lambda: len(built) == 3)
    enc.add(_steps(3, built))
    enc.drain()  # the last ones: here, after the encoder's
    assert [s for s, _ in built] == [0, 1, 2, 3]
    assert {t for _, t in built[:3]} == {"ddpscope-encoder"} and built[3][1] == threading.current_thread().name
    assert enc.facts() == {"encoded_beside_backward": 3, "encoded_between_steps": 1}
    enc.add(_steps(4, built))  # after drain (closing): built at once, here
    writer.close(status=fmt.COMPLETE)
    assert _written(writer.path) == [0, 1, 2, 3, 4]
    assert not enc._thread.is_alive()


def test_a_failure_on_the_encoders_thread_is_raised_on_the_training_thread_and_keeps_what_was_written(writer):
    built: list = []
    enc = BackwardEncoder(writer)
    enc.add(_steps(0, built))
    enc.backward_began()
    assert _wait_for(lambda: len(_written(writer.path)) == 1)
    enc.add(_steps(1, built, fail=True))
    enc.add(_steps(2, built))  # queued behind the failing one
    enc.backward_began()
    assert _wait_for(lambda: not enc._thread.is_alive())
    with pytest.raises(RuntimeError, match=r"building a step's events failed \(ValueError: a bug of ours\)"):
        enc.add(_steps(3, built))
    with pytest.raises(RuntimeError, match="a bug of ours"):
        enc.drain()
    writer.close(status=fmt.FAILED)
    assert _written(writer.path) == [0]  # what was written whole before stays
    assert [s for s, _ in built] == [0, 1]  # nothing after the failure was built


def test_it_is_used_on_a_device_with_cores_to_spare_per_rank_never_for_the_cpu(monkeypatch):
    """``os.sched_getaffinity`` is replaced (a stand-in: this machine has 2 cores, and
    whether a host of 16 is worth it cannot be read here otherwise)."""
    assert not worth_it("cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert worth_it("cuda") and not worth_it("cpu")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(16 // backward_encoder.CORES_PER_RANK + 1))
    assert not worth_it("cuda")  # 6 ranks on 16 cores: not 3 cores each
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not a number")
    assert worth_it("cuda")  # read as one rank
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert not worth_it("cuda")
