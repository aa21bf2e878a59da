"""Clocks. The CUDA clock cannot run here (no GPU): its scheduling and arithmetic are
checked against a stand-in for a device (events with ``record``/``query``/``synchronize``
and float32 ``elapsed_time``, streams busy until a time the test sets): a mock, the one
place one is allowed, because there is no other way to exercise it on a CPU machine.
tests/tracer/capture/test_cuda.py runs the real thing where a GPU is."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ddpscope.tracer.capture.clock import SKEW_ENV, CpuClock, make_clock, steps_to_keep
from ddpscope.tracer.capture.cuda_clock import CudaEventClock


def test_cpu_clock_is_monotonic_and_resolves_to_itself():
    c = CpuClock()
    stamps = [c.stamp() for _ in range(1000)]
    assert stamps == sorted(stamps)
    assert c.resolve(stamps + [None]) == stamps + [None]
    assert c.lag_steps == 0 and make_clock("cpu").kind == "cpu-monotonic"


def test_injected_skew_shifts_the_clock(monkeypatch):
    base = CpuClock().host_us()
    monkeypatch.setenv(SKEW_ENV, "250")
    skewed = CpuClock().host_us()
    assert 250_000 <= skewed - base < 350_000  # µs; what lies between the two reads: up to 100 ms off the core
    monkeypatch.setenv(SKEW_ENV, "soon")
    with pytest.raises(ValueError, match=SKEW_ENV):
        CpuClock()


class FakeGpu:
    """A device stand-in: a host clock the test moves (each read advances it 0.5 µs, as
    reading a clock takes time), a device clock on its own epoch running ``drift`` faster,
    streams whose queued work ends at a host time the test sets, events that complete when
    the work queued before them on their stream has."""

    def __init__(self, drift: float = 0.0):
        self.now = 5_000_000.0  # host µs
        self.drift = drift
        self.event_syncs = 0
        self.compute = self.stream()

    def device_us(self, host_us: float) -> float:
        return 7e9 + host_us * (1.0 + self.drift)

    def host_us(self) -> float:
        self.now += 0.5
        return self.now

    def stream(self, jitter=None):
        """``jitter()``: µs an event recorded on it waits for the GPU (another process's turn)."""
        return type("Stream", (), {"busy_until": 0.0, "jitter": staticmethod(jitter or (lambda: 0.0))})()

    def event(self):
        gpu = self

        class Event:
            at = None  # host µs when it completes

            def record(self, stream):
                self.at = max(gpu.now, stream.busy_until) + stream.jitter()

            def query(self):
                return self.at is not None and gpu.now >= self.at

            def synchronize(self):
                gpu.event_syncs += 1
                gpu.now = max(gpu.now, self.at)

            def elapsed_time(self, other):
                assert self.query() and other.query(), "cudaErrorNotReady"
                return float(np.float32((gpu.device_us(other.at) - gpu.device_us(self.at)) / 1000.0))

        return Event()

    def clock(self, idle_jitter=None, **kw):
        return CudaEventClock(host_clock=self, event_factory=self.event, current_stream=lambda: self.compute,
                              idle_stream=self.stream(idle_jitter), **kw)


@pytest.fixture
def no_device_sync(monkeypatch):
    """torch.cuda.synchronize (the device-wide sync) fails the test if anything calls it."""
    def refuse(*a, **k):
        raise AssertionError("torch.cuda.synchronize: a device-wide sync")
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)


def test_cuda_clock_maps_events_onto_the_host_clock(no_device_sync):
    gpu = FakeGpu()
    clock = gpu.clock()
    assert gpu.now - 5.0 <= clock.anchor_host_us < gpu.now  # the idle stream took the anchor at once
    stamps, truth = [], []
    for dt_us in (1000.0, 2500.0, 250.0):
        gpu.now += dt_us
        stamps.append(clock.stamp())
        truth.append(gpu.now)
    assert all(clock.done(s) for s in stamps)
    times = clock.resolve(stamps + [None, 5_000_123.5])
    assert times[:3] == pytest.approx(truth, abs=1.0)
    assert times[3:] == [None, 5_000_123.5]  # host µs (the compiled capture's) pass through
    assert gpu.event_syncs == 0 and clock.blocked == 0


@pytest.mark.parametrize("stamps", ["events", "ring"])
def test_a_step_is_resolved_when_its_end_event_completes_never_by_syncing_the_device(no_device_sync, stamps):
    """The GPU runs 30 ms behind the CPU: steps wait (nothing emitted, nothing blocks) until
    their end events complete; only when more than ``lag_steps`` wait is the oldest
    resolved, blocking on its own events (``Event.synchronize``), not the device. With the
    compiled capture's ring, a step whose end is done is read without a query per stamp
    (``known_done``), and one resolved before its end is not."""
    import json

    import msgspec

    from ddpscope.tracer.capture.ddp.recorder import StepRecorder

    gpu = FakeGpu()
    clock = gpu.clock()
    ring = None
    if stamps == "ring":
        ring = FakeRing(gpu, slots=64)
        clock.share_anchors(ring)
        clock.use_stamps(ring)
    lin = torch.nn.Linear(4, 2)
    out: list[list[dict]] = []
    rec = StepRecorder(clock=clock, rank=0, param_names=["weight", "bias"], params=list(lin.parameters()),
                       optimizer=None, step_boundary="explicit",
                       emit=lambda events, layouts: out.append(json.loads(msgspec.json.encode(list(events)))))

    def step(queued_ms: float):
        rec.on_forward_start()
        gpu.now += 1000.0
        gpu.compute.busy_until = gpu.now + queued_ms * 1000  # the kernels just launched end then
        rec.on_forward_end(warmup=False)
        lin(torch.randn(3, 4)).sum().backward()
        rec.mark_step()

    def emitted() -> int:
        return sum(e["ph"] == "X" and e["cat"] == "step" for events in out for e in events)

    step(30.0)
    step(30.0)
    assert emitted() == 0 and gpu.event_syncs == 0  # two steps wait for the GPU, none blocks
    step(30.0)
    assert emitted() == 1 and clock.blocked > 0 and gpu.event_syncs > 0  # the third: the oldest waited for
    syncs = gpu.event_syncs
    gpu.now += 100_000.0  # the GPU catches up
    step(0.0)
    assert emitted() == 4 and gpu.event_syncs == syncs  # every step done: resolved at once, no wait
    assert steps_to_keep(clock, []) == 0 and steps_to_keep(CpuClock(), [1.0, 2.0]) == 0
    forwards = [e for events in out for e in events if e["ph"] == "X" and e["cat"] == "forward"]
    # where the device ran them: the first forward ends 30 ms late, the next ones queue behind it
    assert [f["dur"] for f in forwards] == pytest.approx([31_000, 1000, 1000, 1000], abs=2.0)
    if ring is not None:
        assert ring.issued > 0 and ring.known_done == [False, True] and ring.wrongly_known_done == 0


def test_float32_rounding_and_drift_are_bounded_by_reanchoring_over_an_hour(no_device_sync):
    """A simulated hour at 20 ppm GPU-vs-host drift: each stamp is within 1 µs of its true
    host time with re-anchoring; from one anchor taken at attach, float32 milliseconds and
    the drift put stamps off by tens of ms."""
    def run(reanchor_s: float, drift: float) -> float:
        gpu = FakeGpu(drift=drift)
        clock = gpu.clock()
        clock.REANCHOR_S = reanchor_s
        worst = 0.0
        for second in range(3600):
            gpu.now += 1_000_000.0 + 0.37 * second  # steps of ~1 s
            s = clock.stamp()
            truth = gpu.now
            (t,) = clock.resolve([s])
            if second >= 3000:
                worst = max(worst, abs(t - truth))
        return worst

    assert run(2.0, 20e-6) <= 1.0
    assert run(float("inf"), 20e-6) > 10_000.0  # drift alone: 20 ppm of an hour is 72 ms
    assert run(float("inf"), 0.0) > 10.0  # float32 ms an hour from the anchor: 250 µs steps


def test_the_compiled_capture_shares_the_clocks_anchors(no_device_sync):
    """The bucket lanes' events (an anchor sink) get a try recorded on the idle stream just
    before each of the clock's, and the winning try's host time: one anchor, two paths."""
    gpu = FakeGpu()
    clock = gpu.clock()
    calls = []

    class Sink:
        def candidate(self, index, stream):
            calls.append(("try", index, stream is clock._idle))

        def commit(self, index, host_ns, rate):
            calls.append(("commit", index, host_ns))

    clock.share_anchors(Sink())
    gpu.now += 3_000_000.0
    clock.resolve([clock.stamp()])  # 3 s on: the clock re-anchors, and the sink with it
    tries = [c for c in calls if c[0] == "try"]
    commits = [c for c in calls if c[0] == "commit"]
    assert len(commits) == 2 and len(tries) == 2 * clock.ANCHOR_SAMPLES and all(t[2] for t in tries)
    assert commits[-1][2] == round(clock.anchor_host_us * 1000)
    assert 0 <= commits[-1][1] < clock.ANCHOR_SAMPLES


def test_the_drift_is_measured_over_a_long_baseline_and_shared_not_read_off_noisy_anchors(no_device_sync):
    """Another process time-slices the GPU: an anchor try waits up to 1 ms for its turn, so
    every bracket is wide. A rate read off two anchors 2 s apart would then be off by up to
    5e-4 (ms within the next 2 s); the clock keeps the rate it has until a baseline long
    against the brackets tells drift from noise, and the sink (the compiled capture's
    events) gets the very rate the clock uses for each anchor. With tight brackets the
    true drift is found within a minute."""
    import random

    def run(jitter_us: float, seconds: int, drift: float = 10e-6):
        rng = random.Random(0)
        gpu = FakeGpu(drift=drift)
        clock = gpu.clock(idle_jitter=lambda: rng.uniform(0.0, jitter_us))
        committed = []

        class Sink:
            def candidate(self, index, stream):
                pass

            def commit(self, index, host_ns, rate):
                committed.append(rate)

        clock.share_anchors(Sink())
        for _ in range(seconds):
            gpu.now += 1_000_000.0
            clock.resolve([clock.stamp()])
        rates = [a[2] for a in clock._anchors]
        return rates, committed, clock.facts()

    rates, committed, facts = run(1000.0, 60)
    assert all(abs(r - 1.0) <= 2e-5 for r in rates), rates  # never a noise-made "drift" of 1e-4 or more
    # the rate the clock uses from each anchor on is the one the sink was told with the next
    # anchor (the newest: with itself): one rate for both sets of events
    assert len(committed) >= len(rates) - 1 and rates[:-1] == committed[-(len(rates) - 1):] and rates[-1] == committed[-1]
    # what the rank's metadata says: the drift, once measured, and from when; anchors taken
    assert facts["clock_anchors"] == len(rates) == 2 + 60 // CudaEventClock.REANCHOR_S  # at start, when shared, each 2 s
    if facts["clock_drift_ppm"] is not None:
        assert abs(facts["clock_drift_ppm"] - 10.0) <= 20.0
    tight, _, facts = run(0.0, 60)
    assert tight[-1] == pytest.approx(1.0 / (1.0 + 10e-6), abs=1e-7)  # host µs per device µs: the device runs fast
    assert facts["clock_drift_ppm"] == pytest.approx(10.0, abs=0.1)
    assert 1e6 <= facts["clock_drift_from_us"] - 5e6 <= 3e6  # measured from the first anchor >= 1 s after the first
    _, _, facts = run(0.0, 0)
    assert facts["clock_drift_ppm"] is None and facts["clock_drift_from_us"] is None  # no baseline yet: not claimed
    assert facts["clock_blocked"] == 0 and facts["clock_ring_stamps"] == 0



def test_stamps_and_anchors_use_the_models_device_not_the_current_one(monkeypatch):
    """A model on cuda:1 while cuda:0 is current (a script that never calls set_device):
    stamps go on cuda:1's current stream, the anchor stream is made on cuda:1."""
    gpu = FakeGpu()
    asked = []

    def current_stream(device=None):
        asked.append(device)
        return gpu.compute

    def stream(device=None, **_):
        asked.append(("anchor stream", device))
        return gpu.stream()

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Stream", stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing: gpu.event())
    clock = make_clock(torch.device("cuda", 1))
    clock.host_us = gpu.host_us
    clock._host = gpu
    clock.stamp()
    assert asked == [("anchor stream", torch.device("cuda", 1)), torch.device("cuda", 1)]


class FakeRing:
    """The compiled capture's ``DeviceStamps`` on the stand-in device, as ``timed_group.cpp``
    does it: an anchor sink (a try on the idle stream before each of the clock's, the winner
    committed with its host ns and rate), and a ring of events recorded on the current
    stream, each measured from the newest anchor, resolved in one call to host ns."""

    def __init__(self, gpu: FakeGpu, slots: int = 4):
        self.gpu, self.slots = gpu, slots
        self.tries, self.anchors = {}, []  # [event, host_ns, rate]
        self.events: dict[int, tuple] = {}  # slot -> (event, anchor index)
        self.issued = self.released = self.blocked = self.resolve_calls = self.wrongly_known_done = 0
        self.known_done: list[bool] = []  # per resolve call

    def candidate(self, index, stream):
        ev = self.gpu.event()
        ev.record(stream)
        self.tries[index] = ev

    def commit(self, index, host_ns, rate):
        if self.anchors:
            self.anchors[-1][2] = rate
        self.anchors.append([self.tries[index], host_ns, rate])

    def stamp(self) -> int:
        slot = self.issued
        self.issued += 1
        if slot - self.released >= self.slots:
            return -1
        ev = self.gpu.event()
        ev.record(self.gpu.compute)
        self.events[slot] = (ev, len(self.anchors) - 1)
        return slot

    def query(self, slot) -> bool:
        return self.events[slot][0].query()

    def resolve(self, slots, known_done=False) -> list[int]:
        self.resolve_calls += 1
        self.known_done.append(known_done)
        out = []
        for slot in slots:
            ev, k = self.events[slot]
            if not ev.query():  # C++: queried first, or (known_done) elapsedTime throws: it waits either way
                self.blocked += 1
                self.wrongly_known_done += known_done
                ev.synchronize()
            anchor, host_ns, rate = self.anchors[k]
            out.append(host_ns + round(anchor.elapsed_time(ev) * 1e6 * rate))
            self.released = max(self.released, slot + 1)
        return out


def test_stamps_from_the_compiled_rings_events_resolve_as_the_clocks_own_in_one_call(no_device_sync):
    """With the compiled capture's ring (``use_stamps``), a stamp is a slot of a preallocated
    event on the same anchors: it resolves to the time an event stamp gets (within 1 µs,
    across re-anchoring and drift), every slot of a resolve in one call; a step waits for
    it without a sync (``done`` asks the ring); a full ring and a pinned stream fall back to
    events, and stamps taken before the ring is given back still resolve."""
    gpu = FakeGpu(drift=15e-6)
    clock = gpu.clock()
    ring = FakeRing(gpu, slots=4)
    clock.share_anchors(ring)
    clock.use_stamps(ring)
    worst = 0.0
    for second in range(40):
        gpu.now += 1_000_000.0
        a, b = clock.stamp(), clock.stamp_current()
        assert a[0] is None and b[0] is None  # ring slots, not events
        event = (clock._new_event(), clock._count - 1)
        event[0].record(gpu.compute)
        calls = ring.resolve_calls
        ta, tb, te = clock.resolve([a, b, event])
        assert ring.resolve_calls == calls + 1  # both slots in one call
        worst = max(worst, abs(ta - te), abs(tb - te))
    assert worst <= 1.0 and clock._count > 10  # re-anchored on the way, the drift taken out
    # a step's end stamp on the ring: not done until the GPU gets there, and nothing syncs
    gpu.compute.busy_until = gpu.now + 30_000.0
    end, event = clock.stamp(), (clock._new_event(), clock._count - 1)
    event[0].record(gpu.compute)
    assert not clock.done(end) and steps_to_keep(clock, [end]) == 1 and clock.blocked == 0
    gpu.now += 31_000.0
    assert clock.done(end)
    t_end, t_event = clock.resolve([end, event])
    assert t_end == pytest.approx(t_event, abs=1.0) and t_end - (gpu.now - 31_000.0) > 29_000.0
    # more stamps held than the ring has slots: the rest are events, and all resolve
    held = [clock.stamp() for _ in range(6)]
    assert sum(s[0] is None for s in held) == 4 and all(t is not None for t in clock.resolve(held))
    # FSDP2 pins the compute stream: stamp() is an event there, stamp_current() a slot
    clock.pin_stream(gpu.compute)
    assert clock.stamp()[0] is not None and clock.stamp_current()[0] is None
    # the ring given back (tracing stopped): events again; a slot taken before still resolves
    kept = clock.stamp_current()
    clock.use_stamps(None)
    assert clock.stamp_current()[0] is not None and clock.resolve([kept])[0] is not None
    assert gpu.event_syncs == 0 and clock.blocked == 0 and clock.ring_stamps == ring.issued
