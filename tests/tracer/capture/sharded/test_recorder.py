"""The sharded recorder's step machine, in process: steps held and emitted in batches.

Real recorder, real clock; ``emit`` collects the steps (what the tracer would encode).
"""

from __future__ import annotations

import threading
import time

import pytest

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


def test_steps_are_held_then_emitted_together_after_every_hold_steps_th_step(monkeypatch):
    """Fast steps: a batch after every HOLD_STEPS-th step, by the step's number, so every
    rank emits in the same step whatever its clock says; each step closed as it ends."""
    monkeypatch.setattr(rec_mod, "HOLD_S", 3600.0)  # no period of rank 0's clock ends in this test
    emitted, closed = [], []
    rec = ShardedRecorder(clock=CpuClock(), emit=emitted.append, on_close=closed.append)
    n = rec_mod.HOLD_STEPS
    for _ in range(n - 1):
        _step(rec)
    assert emitted == [] and [s.step for s in closed] == list(range(n - 1))  # held; each closed
    _step(rec)
    assert [s.step for s in emitted] == list(range(n))  # the batch, oldest first
    for _ in range(n + 3):
        _step(rec)
    assert [s.step for s in emitted] == list(range(2 * n))
    rec.finish(aborted=False)
    assert [s.step for s in emitted] == list(range(2 * n + 3)) and rec.steps_written == 2 * n + 3
    assert emitted[1].colls[0].extra == {"zero": "param_fetch"}


def test_an_all_gather_the_script_issues_between_steps_is_the_next_steps():
    """The script's ``unshard()`` before forward (PyTorch's FSDP2 example): its all-gather and
    the wait for it run between steps and are the next training step's, which starts at
    them; one held and then followed by a forward outside the steps (an evaluation) is that
    forward's, as are those issued inside it; a reduce-scatter between steps is no step's."""
    emitted = []
    rec = ShardedRecorder(clock=CpuClock(), emit=emitted.append)
    _step(rec)
    c = rec.comm_start("all_gather", ROOT, 128, False)  # the script's unshard()
    rec.comm_end(c)
    rec.wait_end(rec.wait_start(ROOT))
    _step(rec)
    rec.comm_end(rec.comm_start("all_gather", ROOT, 128, False))  # unshard(), then an evaluation forward
    rec.enter(ROOT, FORWARD)
    rec.comm_end(rec.comm_start("all_gather", 1, 32, False))
    rec.leave(ROOT, FORWARD)
    rec.comm_end(rec.comm_start("reduce_scatter", 1, 32, False))
    _step(rec)
    rec.finish(aborted=False)
    one, two = emitted[1], emitted[2]
    assert [(c.unit, c.nbytes, c.phase, c.end is not None) for c in one.colls] == [
        (ROOT, 128, FORWARD, True), (ROOT, 64, FORWARD, True)]
    assert one.start == one.colls[0].start < one.colls[0].end <= one.passes[0].forward[0]
    assert [(u, ph) for u, ph, _, _ in one.waits] == [(ROOT, FORWARD)]
    assert one.colls[0].end <= one.waits[0][2] <= one.waits[0][3] <= one.passes[0].forward[0]
    assert [c.nbytes for c in two.colls] == [64] and two.start == two.passes[0].forward[0] and not two.waits
    assert [c.nbytes for c in emitted[0].colls] == [64]


class _Driven(CpuClock):
    """A host clock the test moves (``now``: rank 0's, µs), ``ahead_us`` ahead of it."""

    now = [1000.0]

    def __init__(self, ahead_us: float) -> None:
        super().__init__()
        self.ahead_us = ahead_us

    def host_us(self) -> float:
        return self.now[0] + self.ahead_us


def test_long_steps_are_emitted_in_the_same_step_on_ranks_whose_clocks_differ(monkeypatch):
    """Steps longer than HOLD_S / HOLD_STEPS: a batch at the first step closed in each
    HOLD_S of rank 0's clock. Two ranks stepping together, one's clock 7.1 s ahead and its
    offset saying so, emit in the same steps; the same rank told no offset emits in others
    (its periods end half a period apart): the offset is what aligns them. The host clocks
    are driven by the test (50 ms a step), so no period ends between ranks."""
    monkeypatch.setattr(rec_mod, "HOLD_S", 0.2)
    monkeypatch.setattr(rec_mod, "HOLD_STEPS", 10_000)
    monkeypatch.setattr(_Driven, "now", [1000.0])
    batches: dict[str, list[int]] = {"rank 0": [], "rank 1": [], "rank 1, no offset": []}
    recs = {"rank 0": ShardedRecorder(clock=_Driven(0.0), emit=lambda s: None),
            "rank 1": ShardedRecorder(clock=_Driven(7.1e6), emit=lambda s: None, offset_us=-7.1e6),
            "rank 1, no offset": ShardedRecorder(clock=_Driven(7.1e6), emit=lambda s: None)}
    for _ in range(14):
        _Driven.now[0] += 50_000.0
        for name, rec in recs.items():
            written = rec.steps_written
            _step(rec)
            if rec.steps_written > written:
                batches[name].append(rec.next_step - 1)
    assert batches["rank 0"] == [3, 7, 11]  # its steps close at 0.05 s each; periods end at 0.2, 0.4, 0.6 s
    assert batches["rank 1"] == batches["rank 0"]
    assert batches["rank 1, no offset"] == [1, 5, 9, 13]


def test_a_rank_that_stops_closing_steps_has_them_written_by_the_live_thread(tmp_path, monkeypatch):
    """A hang after some steps: the live file's thread emits what is held, so the steps that
    finished are in the trace before the watchdog kills the rank."""
    monkeypatch.setattr(rec_mod, "HOLD_S", 3600.0)  # batches by step number only
    emitted, threads = [], []

    def emit(s):
        emitted.append(s)
        threads.append(threading.current_thread().name)

    rec = ShardedRecorder(clock=CpuClock(), emit=emit)
    live = LiveFile(tmp_path, 0, rec, interval_s=0.05, position=lambda: {"step": rec.next_step},
                    tick=rec.flush_held)
    try:
        end = time.monotonic() + 0.6
        while time.monotonic() < end or rec.next_step % rec_mod.HOLD_STEPS != 5:  # steps keep closing:
            _step(rec)  # the live thread (every 50 ms) writes nothing
            time.sleep(0.01)
        n = rec.next_step
        assert set(threads) <= {threading.current_thread().name}  # the GIL stays with training
        held = n - len(emitted)
        assert held > 0  # the last ones came after the last batch
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
    deadline = time.monotonic() + 5.0  # its thread writes every 20 ms, when a loaded machine lets it
    while (later := live.path.read_text()) == first and time.monotonic() < deadline:
        time.sleep(0.02)
    live.close("complete")
    err = capfd.readouterr().err
    assert len(calls) == 1 and err.count("could not write the steps held (RuntimeError: disk gone)") == 1
    assert later != first  # the heartbeat goes on (its time moves)


def test_on_cuda_compute_is_cut_on_the_compute_stream_and_collectives_timed_on_their_own():
    """FSDP2 calls its collectives inside its own streams, which run ahead of compute. With
    a device stand-in (the one place a stand-in is allowed: no GPU here): every cut is on
    the compute stream (the clock is pinned to it), the collective is timed on its stream
    (a synchronous call: after the stream waited for it; an async one: in its Work's
    future's callback), so a unit's compute is where the compute stream ran it."""
    from tests.tracer.capture.test_clock import FakeGpu

    gpu = FakeGpu()
    comm = gpu.stream()
    current = [gpu.compute]
    clock = gpu.clock()
    clock._current = lambda: current[0]
    clock.pin_stream(gpu.compute)
    emitted = []
    rec = ShardedRecorder(clock=clock, emit=emitted.append)

    class Work:  # what an async collective returns: its future's callbacks run when it is done
        def get_future(self):
            return self

        def then(self, callback):
            current[0] = comm  # the callback's stream waits for the work
            callback(self)
            current[0] = gpu.compute

    t0 = gpu.now
    rec.on_forward_start()
    rec.enter(ROOT, FORWARD)
    gpu.compute.busy_until = gpu.now + 3000  # the root's forward kernels: 3 ms of compute
    current[0] = comm  # FSDP2's all-gather stream: waits for nothing queued, its collective takes 5 ms
    c = rec.comm_start("all_gather", 1, 64, True)
    comm.busy_until = gpu.now + 5000
    rec.comm_end(c)  # synchronous: the stream waited for NCCL
    c2 = rec.comm_start("reduce_scatter", 1, 64, False)
    comm.busy_until = gpu.now + 9000
    rec.comm_end(c2, Work())  # async: the end from the future
    current[0] = gpu.compute
    gpu.compute.busy_until = gpu.now + 4000  # more compute: to 4 ms
    rec.leave(ROOT, FORWARD)
    rec.on_forward_end()
    rec.on_optimizer_start()
    rec.on_optimizer_end()
    gpu.now += 20_000  # the device finishes
    rec.finish(aborted=False)
    (step,) = emitted
    ag, rs = step.colls
    assert ag.end - ag.start == pytest.approx(5000, abs=3)
    assert (rs.start - t0, rs.end - t0) == pytest.approx((5000, 9000), abs=5)  # behind the all-gather on its stream
    assert ag.start - t0 == pytest.approx(0, abs=5)  # launched at once on its own stream, not after compute
    root = [seg for seg in step.segments if seg[0] == ROOT]
    assert all(b >= a for _, _, a, b in root)  # no negative segments
    assert max(b for _, _, _, b in root) - t0 == pytest.approx(4000, abs=5)  # compute ran to 4 ms


class _Ticks(CpuClock):
    """The host clock's interface, each stamp one µs after the last: two recorders fed the
    same calls stamp the same times."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0

    def stamp(self) -> float:
        self.t += 1.0
        return self.t

    stamp_current = stamp


def test_a_collective_or_wait_recorded_whole_cuts_compute_as_one_recorded_at_both_ends():
    """DeepSpeed's tap records a synchronous collective (and a wait) in one call after it
    returned (``comm_timed``, ``wait_timed``): the step it gives is the one ``comm_start``/
    ``comm_end`` and ``wait_start``/``wait_end`` give, compute cut around each, in both
    passes, whether or not the hole touches a segment's end."""
    def step(rec: ShardedRecorder, whole: bool) -> None:
        clock = rec.clock
        rec.on_forward_start()
        rec.enter(ROOT, FORWARD)
        for unit in (1, 2):  # two collectives in a row: the second's hole touches the first's
            if whole:
                start = clock.stamp()
                rec.comm_timed(rec.current, "all_reduce", unit, 64, False, None, {"op": "all_reduce"}, start,
                               clock.stamp())
            else:
                rec.comm_end(rec.comm_start("all_reduce", unit, 64, False, None, {"op": "all_reduce"}))
        clock.stamp()  # compute
        if whole:
            start = clock.stamp()
            rec.wait_timed(rec.current, 3, start, clock.stamp())
        else:
            rec.wait_end(rec.wait_start(3))
        rec.leave(ROOT, FORWARD)
        rec.on_forward_end()
        rec.enter(ROOT, BACKWARD)
        clock.stamp()
        if whole:
            start = clock.stamp()
            rec.comm_timed(rec.current, "all_reduce", 4, 32, False, None, None, start, clock.stamp())
        else:
            rec.comm_end(rec.comm_start("all_reduce", 4, 32, False))
        rec.leave(ROOT, BACKWARD)
        rec.on_backward_end()
        rec.on_optimizer_start()
        rec.on_optimizer_end()

    out = {}
    for whole in (False, True):
        emitted: list = []
        rec = ShardedRecorder(clock=_Ticks(), emit=emitted.append)
        step(rec, whole)
        rec.finish(aborted=False)
        (s,) = emitted
        out[whole] = s
    a, b = out[False], out[True]
    assert [(u, ph, ts, te) for u, ph, ts, te in a.segments if te > ts] == b.segments
    # one µs a stamp: compute runs between the holes (the collectives at 3-4, 5-6 and 15-16, the wait
    # at 8-9), never inside one
    assert b.segments == [(ROOT, FORWARD, 2.0, 3.0), (ROOT, FORWARD, 4.0, 5.0), (ROOT, FORWARD, 6.0, 8.0),
                          (ROOT, FORWARD, 9.0, 10.0), (ROOT, BACKWARD, 12.0, 15.0), (ROOT, BACKWARD, 16.0, 17.0)]
    assert a.waits == b.waits and [w[0] for w in b.waits] == [3]
    assert [(c.kind, c.unit, c.phase, c.nbytes, c.start, c.end, c.extra) for c in a.colls] == \
        [(c.kind, c.unit, c.phase, c.nbytes, c.start, c.end, c.extra) for c in b.colls]
    assert [c.phase for c in b.colls] == [FORWARD, FORWARD, BACKWARD]



def test_a_collective_of_no_unit_cuts_compute_and_one_between_steps_is_no_steps():
    """``OwnCollectives`` (collective_timer's recorder for a sharded step): a synchronous
    all-reduce inside a unit's forward cuts that unit's compute for its length; a
    functional one runs beside compute from its launch, and only the wait for it is cut;
    the hang watchdog says "of no unit"; one between steps, and a broadcast, are not kept."""
    from ddpscope.tracer.capture.sharded.fsdp_tracer import position
    from ddpscope.tracer.capture.sharded.own_collectives import OwnCollectives

    emitted = []
    rec = ShardedRecorder(clock=CpuClock(), emit=emitted.append)
    own = OwnCollectives(rec)
    _step(rec)
    assert own.on_own_start("all_reduce (the script, t.py:1)", 4, op="all_reduce", message_bytes=4) is None
    assert own.on_own_start("broadcast (the script, t.py:2)", 4, op="broadcast", message_bytes=4) is None
    rec.on_forward_start()
    rec.enter(ROOT, FORWARD)
    sync = own.on_own_start("all_reduce (the script, t.py:3)", 4, op="all_reduce", message_bytes=4)
    assert position(rec, ["(root)"])["phase"] == "all-reduce of no unit (forward)"
    time.sleep(0.002)
    own.on_own_return(sync, True)
    launched = own.on_own_start("all_gather_single (torch.x)", 8, op="all_gather_single", message_bytes=8)
    own.on_own_return(launched, False, message_bytes=16)  # the gathered output, known on return
    time.sleep(0.002)  # compute beside it
    own.on_own_wait(launched, True)
    time.sleep(0.002)
    own.on_own_end(launched)
    own.on_own_wait(launched, False)
    rec.leave(ROOT, FORWARD)
    rec.on_forward_end()
    rec.on_backward_end()
    rec.on_optimizer_start()
    rec.on_optimizer_end()
    rec.finish(aborted=False)
    s = emitted[1]
    mine = [c for c in s.colls if c.unit == -1]
    assert [(c.kind, c.nbytes, c.extra["by"]) for c in mine] == [
        ("all_reduce", 4, "all_reduce (the script, t.py:3)"), ("all_gather", 16, "all_gather_single (torch.x)")]
    cuts = sorted((a, b) for unit, phase, a, b in s.segments if unit == ROOT and phase == FORWARD)
    # before the all-reduce; after it, until the gather's launch call; after that call, until the
    # wait for it; after the wait
    assert len(cuts) == 4
    assert cuts[0][1] == mine[0].start and cuts[1][0] == mine[0].end  # off compute for the all-reduce's length
    assert cuts[1][1] == mine[1].start and mine[1].end <= cuts[3][0]  # the gather runs from its launch ...
    assert cuts[2][1] - cuts[2][0] >= 1500  # ... beside compute (µs) until the wait for it
