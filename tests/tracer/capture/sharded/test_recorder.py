"""The sharded recorder's step machine, in process: steps held and emitted in batches.

Real recorder, real clock; ``emit`` collects the steps (what the tracer would encode).
"""

from __future__ import annotations

import threading
import time

from ddpscope.tracer.capture.clock import CpuClock
from ddpscope.tracer.capture.live import LiveFile
from ddpscope.tracer.capture.sharded import recorder as rec_mod
from ddpscope.tracer.capture.sharded.recorder import BACKWARD, FORWARD, ROOT, ShardedRecorder


def _step(rec: ShardedRecorder) -> None:
    rec.on_forward_start()
    rec.enter(ROOT, FORWARD)
    c = rec.comm_start("all_gather", 0, 64, False, extra={"zero": "param_fetch"})
    rec.comm_end(c)
    rec.leave(ROOT, FORWARD)
    rec.on_forward_end()
    rec.enter(ROOT, BACKWARD)
    rec.leave(ROOT, BACKWARD)
    rec.on_backward_end()
    rec.on_optimizer_start()
    rec.on_optimizer_end()


def test_fast_steps_are_held_then_emitted_together_in_order():
    emitted, closed = [], []
    rec = ShardedRecorder(clock=CpuClock(), emit=emitted.append, on_close=closed.append)
    time.sleep(rec_mod.HOLD_S)  # the first step of a run comes long after the recorder is made
    _step(rec)
    assert [s.step for s in emitted] == [0]  # nothing emitted for HOLD_S before: out at once
    for _ in range(3):
        _step(rec)
    assert [s.step for s in emitted] == [0] and [s.step for s in closed] == [0, 1, 2, 3]  # held; each closed
    time.sleep(rec_mod.HOLD_S)
    _step(rec)
    assert [s.step for s in emitted] == [0, 1, 2, 3, 4]  # the batch, oldest first
    _step(rec)
    rec.finish(aborted=False)
    assert [s.step for s in emitted] == [0, 1, 2, 3, 4, 5] and rec.steps_written == 6
    assert emitted[1].colls[0].extra == {"zero": "param_fetch"}


def test_no_more_than_hold_steps_are_held():
    emitted = []
    rec = ShardedRecorder(clock=CpuClock(), emit=emitted.append)
    for _ in range(rec_mod.HOLD_STEPS):
        _step(rec)
    assert len(emitted) == rec_mod.HOLD_STEPS  # the 32nd step emitted every one held


def test_a_rank_that_stops_closing_steps_has_them_written_by_the_live_thread(tmp_path):
    """A hang after some steps: the live file's thread emits what is held, so the steps that
    finished are in the trace before the watchdog kills the rank."""
    emitted, threads = [], []

    def emit(s):
        emitted.append(s)
        threads.append(threading.current_thread().name)

    rec = ShardedRecorder(clock=CpuClock(), emit=emit)
    live = LiveFile(tmp_path, 0, rec, interval_s=0.05, position=lambda: {"step": rec.next_step},
                    tick=rec.flush_held)
    try:
        end = time.monotonic() + 0.6
        while time.monotonic() < end:  # steps keep closing: the live thread (every 50 ms) writes nothing
            _step(rec)
            time.sleep(0.01)
        n = rec.next_step
        assert set(threads) <= {threading.current_thread().name}  # the GIL stays with training
        held = n - len(emitted)
        assert held > 0  # the last ones came within HOLD_S of a batch
        rec.on_forward_start()  # the next step starts and never ends
        deadline = time.monotonic() + 5
        while len(emitted) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [s.step for s in emitted] == list(range(n))
        assert threads[-held:] == ["ddpscope-live"] * held  # after STALL_S, written from there
    finally:
        live.close("complete")
    rec.finish(aborted=True)
    assert [s.step for s in emitted] == list(range(n + 1)) and emitted[-1].incomplete


def test_a_tick_that_fails_is_said_once_and_the_heartbeat_goes_on(tmp_path, capfd):
    calls = []

    def tick():
        calls.append(1)
        raise RuntimeError("disk gone")

    rec = ShardedRecorder(clock=CpuClock(), emit=lambda s: None)
    live = LiveFile(tmp_path, 0, rec, interval_s=0.02, position=lambda: {"step": 0}, tick=tick)
    time.sleep(0.2)
    first = live.path.read_text()
    time.sleep(0.1)
    later = live.path.read_text()
    live.close("complete")
    err = capfd.readouterr().err
    assert len(calls) == 1 and err.count("could not write the steps held (RuntimeError: disk gone)") == 1
    assert later != first  # the heartbeat goes on (its time moves)
