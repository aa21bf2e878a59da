"""Clocks. The CUDA clock cannot run here (no GPU): its arithmetic and its
one-synchronize-per-resolve rule are checked with fake events — a mock, because there
is no other way to exercise it on a CPU machine."""

from __future__ import annotations

import pytest

from ddpscope.tracer.capture.clock import SKEW_ENV, CpuClock, make_clock
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
    assert 250_000 <= skewed - base < 260_000
    monkeypatch.setenv(SKEW_ENV, "soon")
    with pytest.raises(ValueError, match=SKEW_ENV):
        CpuClock()


class FakeGpu:
    """A fake device timeline: events complete at the GPU time when recorded."""

    def __init__(self):
        self.gpu_ms = 100.0
        self.syncs = 0

    def event(self):
        gpu = self

        class Event:
            def record(self):
                self.t = gpu.gpu_ms

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return other.t - self.t

        return Event()

    def synchronize(self):
        self.syncs += 1


class FakeHost:
    def __init__(self):
        self.now = 5_000_000.0

    def host_us(self):
        return self.now


def test_cuda_clock_maps_events_onto_the_host_clock_with_one_sync_per_resolve():
    gpu, host = FakeGpu(), FakeHost()
    clock = CudaEventClock(host_clock=host, event_factory=gpu.event, synchronize=gpu.synchronize)
    assert gpu.syncs == 1 and clock.lag_steps == 1  # the anchor
    stamps = []
    for dt_ms in (1.0, 2.5, 0.25):
        gpu.gpu_ms += dt_ms
        stamps.append(clock.stamp())
    times = clock.resolve(stamps + [None])
    assert times[:3] == pytest.approx([5_000_000 + 1000, 5_000_000 + 3500, 5_000_000 + 3750])
    assert times[3] is None
    assert gpu.syncs == 2 and clock.syncs == 1  # one synchronize for the whole batch
    assert clock.resolve([None, None]) == [None, None] and clock.syncs == 1


def test_the_compiled_captures_device_times_pass_through_without_a_sync():
    """The compiled capture hands bucket times over as host µs (its own CUDA events, read
    a step late): resolve keeps them, and needs no synchronize for a batch of only those."""
    gpu, host = FakeGpu(), FakeHost()
    clock = CudaEventClock(host_clock=host, event_factory=gpu.event, synchronize=gpu.synchronize)
    assert clock.resolve([5_000_123.5, None, 7]) == [5_000_123.5, None, 7.0]
    assert clock.syncs == 0
    gpu.gpu_ms += 2.0
    assert clock.resolve([clock.stamp(), 5_000_001.0]) == pytest.approx([5_002_000.0, 5_000_001.0])
    assert clock.syncs == 1


def test_the_recorder_resolves_device_stamps_a_step_late_in_one_sync_each():
    """The recorder on the CUDA clock (fake events, a real backward on CPU tensors): a
    step's events come out one step late, its stamps turned into host µs in one batch
    (one synchronize per step), the spans and gradient marks where the device was."""
    import json

    import msgspec
    import torch

    from ddpscope.tracer.capture.ddp.recorder import StepRecorder

    gpu, host = FakeGpu(), FakeHost()
    clock = CudaEventClock(host_clock=host, event_factory=gpu.event, synchronize=gpu.synchronize)
    lin = torch.nn.Linear(4, 2)
    params = list(lin.parameters())
    out: list[list[dict]] = []
    rec = StepRecorder(clock=clock, rank=0, param_names=["weight", "bias"], params=params, optimizer=None,
                       step_boundary="explicit",
                       emit=lambda events, layouts: out.append(json.loads(msgspec.json.encode(list(events)))))

    def ready(i):
        def hook(p):
            gpu.gpu_ms += 1.0  # each gradient 1 ms after the one before
            rec.on_grad_ready(i)
        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(ready(i))
    starts = []
    for _ in range(3):
        gpu.gpu_ms += 10.0
        starts.append(5_000_000 + (gpu.gpu_ms - 100.0) * 1000)  # the host µs of the step's start
        rec.on_forward_start()
        gpu.gpu_ms += 2.0
        rec.on_forward_end(warmup=False)
        lin(torch.randn(3, 4)).sum().backward()
        gpu.gpu_ms += 5.0
        rec.mark_step()
    assert len(out) == 2 and clock.syncs == 2  # the last step waits a step (lag 1)
    rec.finish(aborted=False)
    assert len(out) == 3 and clock.syncs == 3
    for events, start in zip(out, starts):
        by_cat = {e["cat"]: e for e in events if e["ph"] == "X"}
        assert by_cat["step"]["ts"] == pytest.approx(start) and by_cat["step"]["dur"] == pytest.approx(9000)
        assert by_cat["forward"]["dur"] == pytest.approx(2000)
        assert by_cat["backward"]["ts"] == pytest.approx(start + 2000)  # no output hook here: from forward's end
        assert by_cat["backward"]["dur"] == pytest.approx(2000)  # to the engine's end, after the 2nd gradient
        marks = sorted(e["ts"] - start for e in events if e["ph"] == "i")
        assert marks == pytest.approx([3000, 4000])
