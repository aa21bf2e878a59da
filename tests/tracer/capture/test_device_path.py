"""The tracer's device path (what times a CUDA run) run end to end where there is no GPU,
on a STAND-IN accelerator (tests/standin_device: PyTorch's PrivateUse1 device with a
GPU's streams and timing events on the host; the one kind of stand-in this project allows,
issue 34). It has a device clock of its own (another epoch, a drift), streams that run
behind the host (events complete later than they are recorded, FIFO), float32 elapsed
times that fail on an event not completed, and it counts every synchronisation.

What runs for real: ``timed_group.cpp``'s device events, rings and anchors (built as
``ddpscope build`` builds them), ``cuda_clock.py`` given the stand-in's ``torch.Event`` and
``torch.Stream``, the compiled capture's and the Python capture's device bookkeeping, the
recorder's one-step-late resolution, and a real 2-rank gloo DDP job (on CPU tensors: the
stand-in has no memory and runs no kernels). What does not: CUDA itself, NCCL, memory
(tests/tracer/capture/test_cuda.py runs those where a GPU is).

The instrument the traces are checked against is the host clock: the worker brackets each
step with ``time.perf_counter_ns`` (the tracer's host clock); on the device a step happens
the stream's lag later, so its traced span must sit inside the bracket moved by that lag,
whatever the device's epoch and drift.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.native import build as native
from ddpscope.tracer.launch.torchrun import LaunchConfig, launch
from ddpscope.viz.run_files import read_rank_file
from tests import standin_device
from tests.conftest import ROOT, workers_env

PARAMS = 14  # tests/workers/standin_train.py's model: 7 Linear layers
FIRST_ANCHOR_NS = 5_000


@pytest.fixture(scope="module")
def built():
    result = native.ensure_built()
    if not result["ok"]:
        pytest.fail(f"the compiled capture does not build here: {result['error']}")
    standin_device.load()  # built once here (~10 s), loaded by the workers
    return result


RINGS = """
import json, time, torch, torch.distributed as dist
from ddpscope.tracer.capture.native import build as native
from tests import standin_device as sd

dev, ext = sd.load(), native.load_built()
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dev.configure(drift_ppm=0.0, offset_ns=10**12)  # the device's epoch 1000 s from the host's
ns = time.perf_counter_ns
idle = sd.new_stream()
tries = {}

def anchor(group, rate=1.0):
    # An anchor as the clock takes one: its host time the middle of a bracket under 4 us wide,
    # tried again when the scheduler stretched it (a loaded CI machine). wrap()'s first anchor
    # reads the host clock after waiting for its event, late by however long this process was
    # off its core: the tests below must not hang on that.
    for _ in range(10_000):
        i = tries[id(group)] = tries.get(id(group), -1) + 1
        t0 = ns()
        ext.anchor_candidate(group, i, idle.stream_id, idle.device_index, idle.device_type)
        t1 = ns()
        if t1 - t0 <= 4_000:
            ext.anchor_commit(group, i, (t0 + t1) // 2, rate)
            return t1 - t0, (t0 + t1) // 2
    raise SystemExit("no anchor bracket under 4 us in 10000 tries")

def tight_stamp():
    # a stamp whose host bracket the scheduler did not stretch (the others released)
    for _ in range(10_000):
        t0 = ns()
        s = ds.stamp()
        t1 = ns()
        if t1 - t0 <= 4_000:
            return s, t0, t1
        ds.resolve([s])
    raise SystemExit("no stamp bracket under 4 us in 10000 tries")

g = ext.wrap(dist.group.WORLD, 16, torch.device(sd.DEVICE))
anchor(g)
ds = ext.DeviceStamps(g, 64)
out = {}

def stamps(n):
    got = []
    for _ in range(n):
        t0 = ns()
        s = ds.stamp()
        got.append((s, t0, ns()))
    return got

def outside(got, lag_ns=0, known_done=False):
    # ns outside [before, after] moved by the lag, per stamp; None: unknown (read 0)
    times = ds.resolve([s for s, _, _ in got], known_done)
    return [None if t == 0 else max(0, a + lag_ns - t, t - b - lag_ns) for t, (_, a, b) in zip(times, got)]

# a full ring: the try after 64 gets -1 and takes no slot, and the 64 before all read right
got = stamps(64)
out["full_try"], out["issued_when_full"] = ds.stamp(), ds.issued
out["full_outside"] = outside(got)
out["after_release"] = ds.stamp()  # resolving released the slots

# a slot released by a later one's resolve and then reused reads unknown, never the newer time
got = stamps(10)
ds.resolve([got[-1][0]])
more = stamps(64)
out["overwritten"] = ds.resolve([s for s, _, _ in got[:9]])
ds.resolve([s for s, _, _ in more])

# a stream 30 ms behind the host: not done at once; resolving waits for that event only
dev.set_lag(0, 30_000_000)
got = stamps(1)
out["lag_query"] = ds.query(got[0][0])
c0 = dev.counters()
out["lag_outside"] = outside(got, 30_000_000)
got = stamps(1)
out["lag_known_done_outside"] = outside(got, 30_000_000, known_done=True)  # said done, it was not: waited for
c1 = dev.counters()
out["lag_syncs"] = {k: c1[k] - c0[k] for k in ("device_syncs", "stream_syncs", "event_syncs")}
out["blocked"] = ds.blocked
dev.set_lag(0, 0)

# a device clock 300 ppm slow: 0.5 s after the only anchor (rate 1), a stamp reads ~150 us early;
# after an anchor committed with the host-per-device rate, right again
dev.configure(drift_ppm=-300.0, offset_ns=10**12)
g2 = ext.wrap(dist.group.WORLD, 16, torch.device(sd.DEVICE))
_, at = anchor(g2)
ds = ext.DeviceStamps(g2, 64)
time.sleep(0.5)
s, t0, t1 = tight_stamp()
out["drift_early_ns"] = (t0 + t1) // 2 - ds.resolve([s])[0]
out["drift_span_ns"] = (t0 + t1) // 2 - at  # ~0.5 s, longer by however long the process was off its core
width, _ = anchor(g2, 1.0 / (1.0 - 300e-6))
time.sleep(0.5)
got = [tight_stamp()]
out["drift_corrected_outside"] = outside(got)[0] - width

# (the first group's anchor was taken before the drift was set: anchored again, as the clock
# does every few seconds, so its gradients below read where they ran)
anchor(g)

# gradients: a device event per parameter on the autograd thread, or one under set_only
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
params = list(model.parameters())
ready = ext.ReadyTimes(params, group=g)
t0 = ns()
model(torch.randn(4, 8)).sum().backward()
t1 = ns()
taken = ready.take_device(0)
times = ready.resolve([s for _, s, _ in taken])
out["ready_params"] = sorted(p for p, _, _ in taken)
out["ready_inside"] = all(t0 <= t <= t1 for t in times)
ready.set_only(1)
r0 = dev.recorded(0)
model(torch.randn(4, 8)).sum().backward()
out["only_recorded"] = dev.recorded(0) - r0
taken = ready.take_device(0)
out["only_taken"] = [p for p, _, _ in taken]
out["only_time_known"] = ready.resolve([s for _, s, _ in taken])[0] > 0
ready.set_only(-1)
model(torch.randn(4, 8)).sum().backward()
out["all_again"] = len(ready.take_device(0))
ready.remove()
print(json.dumps(out))
"""


def test_the_rings_keep_every_stamp_wait_for_one_event_and_use_the_anchors_rate(built):
    """``timed_group.cpp``'s EventRing (the clock's stamps, the gradients' events) and its
    anchors, on the stand-in's events: a full ring refuses a stamp without losing the
    oldest one still to be read; a reused slot reads unknown, never another event's time; an
    event on a stream behind the host is waited for alone (no device or stream sync); a
    drifting device clock is read right once an anchor carries the host-per-device rate;
    the ready hooks record one device event per gradient, and one only under ``set_only``."""
    proc = subprocess.run([sys.executable, "-c", RINGS], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["full_try"] == -1 and out["issued_when_full"] == 64
    # ns; the anchor is a bracketed one under 4 µs wide, as the clock takes them (wrap()'s first
    # one reads the host clock after waiting for its event: late by as long as the process was
    # off its core, 380 µs once in CI; the tracer replaces it at once)
    assert None not in out["full_outside"] and max(out["full_outside"]) <= FIRST_ANCHOR_NS
    assert out["after_release"] >= 0
    assert out["overwritten"] == [0] * 9
    assert out["lag_query"] is False
    assert out["lag_outside"][0] is not None and out["lag_outside"][0] <= FIRST_ANCHOR_NS
    assert out["lag_known_done_outside"][0] is not None and out["lag_known_done_outside"][0] <= FIRST_ANCHOR_NS
    assert out["lag_syncs"] == {"device_syncs": 0, "stream_syncs": 0, "event_syncs": 2}
    assert out["blocked"] == 2
    # the stand-in's drift is there to be corrected: 300 ppm of the time since the anchor, within
    # the anchor's and the stamp's brackets (4 µs each)
    assert out["drift_span_ns"] >= 500_000_000
    assert out["drift_early_ns"] == pytest.approx(300e-6 * out["drift_span_ns"], abs=8_000)
    assert out["drift_corrected_outside"] <= 2_000
    assert out["ready_params"] == [0, 1, 2, 3] and out["ready_inside"]
    assert out["only_recorded"] == 1 and out["only_taken"] == [1] and out["only_time_known"]
    assert out["all_again"] == 4


def _run(tmp_path: Path, *args: str) -> dict[int, tuple[dict, dict, list[dict]]]:
    """``tests.workers.standin_train`` on 2 gloo ranks: per rank (the worker's host record,
    the trace's metadata, its events)."""
    out = tmp_path / "run"
    result = launch(LaunchConfig(target="tests.workers.standin_train", nproc=2, log_dir=tmp_path / "logs",
                                 timeout_s=240, env=workers_env(), args=["--out", str(out), *args]))
    assert result.ok, f"{result.reason}\n{result.stderr_tail}"
    return {r: (json.loads((out / f"rank-{r}.host.json").read_text()), *read_rank_file(out / f"rank-{r}.json"))
            for r in (0, 1)}


def _by_step(events: list[dict], cat: str) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in events:
        if e.get("cat") == cat:
            out.setdefault(e["args"]["step"], []).append(e)
    return out


def _check_structure(host: dict, meta: dict, events: list[dict], steps: int, marked: set[int]) -> None:
    """Every step whole, each span where it belongs on the device's timeline: gradients
    inside their backward (all of them on marked steps, none on the others), each bucket's
    all-reduce launched in backward and done after its launch, its bytes the model's."""
    assert meta["device"] == standin_device.DEVICE and meta["clock"] == "cuda-event" and meta["status"] == "complete"
    assert host["same_as_untraced"], "tracing changed the training"
    assert host["during"]["device_syncs"] == 0 and host["during"]["stream_syncs"] == 0
    # the buckets read on the device path (DDP's logging data, the ready order): DDP's own layout
    ddp_layout = [[int(i) for i in b.split()] for b in host["rebuilt_per_bucket_param_indices"].split(",")]
    assert meta["bucket_layouts"][-1]["buckets"] == ddp_layout and len(ddp_layout) == 3
    spans = {cat: _by_step(events, cat) for cat in (fmt.CAT_STEP, fmt.CAT_FORWARD, fmt.CAT_BACKWARD,
                                                     fmt.CAT_OPTIMIZER, fmt.CAT_GRAD, fmt.CAT_ALLREDUCE)}
    assert sorted(spans[fmt.CAT_STEP]) == list(range(steps))
    for s in range(steps):
        (step,), (fwd,), (bwd,), (opt,) = (spans[c][s] for c in (fmt.CAT_STEP, fmt.CAT_FORWARD, fmt.CAT_BACKWARD,
                                                                  fmt.CAT_OPTIMIZER))
        end = step["ts"] + step["dur"]
        assert step["ts"] <= fwd["ts"] <= fwd["ts"] + fwd["dur"] <= bwd["ts"] + 1e-3
        assert bwd["ts"] + bwd["dur"] <= opt["ts"] + 1e-3 and opt["ts"] + opt["dur"] <= end + 1e-3
        grads = spans[fmt.CAT_GRAD].get(s, [])
        if s in marked:
            assert sorted(g["args"]["param"] for g in grads) == list(range(PARAMS)), s
            assert all(bwd["ts"] <= g["ts"] <= bwd["ts"] + bwd["dur"] + 1e-3 for g in grads), s
        else:
            assert grads == [] and "compute_us" in bwd["args"], s
        buckets = spans[fmt.CAT_ALLREDUCE][s]
        assert sum(b["args"]["bytes"] for b in buckets) == sum(meta["param_bytes"]), s
        for b in buckets:
            assert bwd["ts"] <= b["ts"] <= b["ts"] + b["dur"] and b["ts"] + b["dur"] >= b["ts"], s
            assert "incomplete" not in b["args"], s


def _offsets_us(host: dict, events: list[dict]) -> list[tuple[float, float, float]]:
    """Per step (host start µs, traced start - bracket start, traced end - bracket end),
    the bracket moved by the stream's lag: where the device ran the step."""
    lag = host["lag_ms"] * 1e3
    steps = sorted(_by_step(events, fmt.CAT_STEP).items())
    return [(a / 1e3, e["ts"] - (a / 1e3 + lag), e["ts"] + e["dur"] - (b / 1e3 + lag))
            for (a, b), (_, (e,)) in zip(host["brackets_ns"], steps)]


TOL_US = 50.0  # an anchor's bracket, float32 ms of ≤ 2 s, scheduling between two ranks on 2 cores


@pytest.mark.ddp
@pytest.mark.parametrize("capture", ["compiled", pytest.param("python", marks=pytest.mark.breadth)])
def test_a_run_timed_on_a_drifting_device_behind_the_host_reads_where_the_device_ran_it(tmp_path, built, capture):
    """A device clock 1000 s from the host's and 300 ppm slow, a compute stream 3 ms behind
    the host: every step traced where the device ran it (the host's bracket moved by 3 ms)
    once the clock has measured the drift, which it reports; before that, the drift shows
    (the stamps read early), so the agreement after is the measured rate's doing. Nothing
    synchronises the device or a stream; the training is bit-identical to an untraced copy."""
    steps = 40
    ranks = _run(tmp_path, "--capture", capture, "--steps", str(steps), "--lag-ms", "3", "--drift-ppm", "-300",
                 "--offset-s", "1000", "--sleep-ms", "120")
    for r, (host, meta, events) in ranks.items():
        _check_structure(host, meta, events, steps, marked=set(range(steps)))
        assert meta["capture_path"] == capture
        if capture == "compiled":
            assert meta["clock_ring_stamps"] >= 5 * steps  # the clock's stamps came from the C++ ring
            # the steps' events built and encoded beside the next backward, all but the last few
            assert meta["encoded_beside_backward"] >= steps // 2 and meta["encoded_between_steps"] <= 3, meta
        else:  # the Python capture's hooks run in backward: encoded between steps
            assert "encoded_beside_backward" not in meta
        assert meta["clock_drift_ppm"] == pytest.approx(-300.0, abs=5.0), meta
        assert meta["clock_anchors"] >= 3
        known = meta["clock_drift_from_us"]
        offsets = _offsets_us(host, events)
        late = [(s, a, b) for s, a, b in offsets if s > known]
        assert len(late) >= 5, (known, offsets[-1])
        for start, d_start, d_end in late:
            assert -TOL_US <= d_start and d_end <= TOL_US, (r, start - known, d_start, d_end)
        assert min(d for s, d, _ in offsets if s < known) < -100.0, "the device's drift did not show before it was measured"


@pytest.mark.ddp
@pytest.mark.parametrize(("steps", "lag_ms", "at"), [(14, 3, 6), (8, 60, 7)])
def test_a_failure_building_steps_beside_backward_stops_tracing_never_training(tmp_path, built, steps, lag_ms, at):
    """Building step ``at``'s events raises on the encoder's thread (a fault injected): the
    rank stops tracing and says why in its trace, which keeps every step built before,
    whole; the job ends well and trains as it would untraced. With the device 60 ms behind,
    the last step is resolved at the end together with the steps still waiting for the
    device: those are kept too (they were lost with it, in one hand-over)."""
    ranks = _run(tmp_path, "--steps", str(steps), "--lag-ms", str(lag_ms), "--fail-building-at", str(at))
    for r, (host, meta, events) in ranks.items():
        assert host["same_as_untraced"], "tracing changed the training"
        assert meta["status"] == fmt.FAILED and f"ValueError: injected at step {at}" in meta["error"], meta
        assert host["failure"] == meta["error"]
        assert ("training goes on untraced" in meta["error"]) == (at < steps - 1)  # the last: training has ended
        assert sorted(_by_step(events, fmt.CAT_STEP)) == list(range(at))


@pytest.mark.ddp
def test_accumulated_micro_batches_with_unused_parameter_detection_each_sit_where_the_device_ran_them(tmp_path, built):
    """Three micro-batches a step (DDP's ``no_sync`` on the first two) under
    ``find_unused_parameters=True`` (DDP's ``_DDPSink``: Python at the start of every
    backward, beside the encoder): each pass's forward and backward in order inside its
    step, every gradient inside its own pass's backward, the all-reduces launched in the
    last (syncing) backward only, DDP's unused-parameter map on its own lane once a step;
    the steps encoded beside backward; training bit-identical, nothing synchronised."""
    steps, micro = 12, 3
    ranks = _run(tmp_path, "--steps", str(steps), "--accumulate", str(micro), "--find-unused", "--lag-ms", "3")
    for r, (host, meta, events) in ranks.items():
        assert host["same_as_untraced"] and meta["status"] == fmt.COMPLETE, meta.get("error")
        assert host["during"]["device_syncs"] == 0 and host["during"]["stream_syncs"] == 0
        assert meta["encoded_beside_backward"] >= steps // 2, meta
        spans = {cat: _by_step(events, cat) for cat in (fmt.CAT_STEP, fmt.CAT_FORWARD, fmt.CAT_BACKWARD,
                                                         fmt.CAT_GRAD, fmt.CAT_ALLREDUCE, fmt.CAT_DDP_OWN)}
        assert sorted(spans[fmt.CAT_STEP]) == list(range(steps))
        for s in range(steps):
            (step,) = spans[fmt.CAT_STEP][s]
            fwd = sorted(spans[fmt.CAT_FORWARD][s], key=lambda e: e["args"]["micro"])
            bwd = sorted(spans[fmt.CAT_BACKWARD][s], key=lambda e: e["args"]["micro"])
            assert [e["args"]["micro"] for e in bwd] == list(range(micro))
            assert [e["args"]["sync"] for e in bwd] == [False] * (micro - 1) + [True]
            t = step["ts"]
            for f, b in zip(fwd, bwd):  # forward k, backward k, forward k+1, ...
                assert t <= f["ts"] <= f["ts"] + f["dur"] <= b["ts"] + 1e-3, (r, s)
                t = b["ts"] + b["dur"] - 1e-3
            assert t <= step["ts"] + step["dur"]
            grads = spans[fmt.CAT_GRAD][s]
            assert len(grads) == micro * PARAMS, (r, s)
            for g in grads:
                own = bwd[g["args"]["micro"]]
                assert own["ts"] <= g["ts"] <= own["ts"] + own["dur"] + 1e-3, (r, s, g["args"])
            last = bwd[-1]
            buckets = spans[fmt.CAT_ALLREDUCE][s]
            assert sum(b["args"]["bytes"] for b in buckets) == sum(meta["param_bytes"]), (r, s)
            assert all(last["ts"] <= b["ts"] for b in buckets), (r, s)
            assert [o["name"] for o in spans[fmt.CAT_DDP_OWN].get(s, [])] == [fmt.UNUSED_MAP], (r, s)


@pytest.mark.ddp
@pytest.mark.parametrize("capture", ["compiled", pytest.param("python", marks=pytest.mark.breadth)])
def test_a_stream_far_behind_and_sparse_gradient_marks_record_one_gradient_event_per_unmarked_step(tmp_path, built,
                                                                                                 capture):
    """A compute stream 200 ms behind the host (many steps): the host runs two steps ahead
    of the device and no more (``lag_steps``): the third waits on the oldest step's own
    events (counted, never a device or stream sync), so at most one step in three waits.
    (Its buckets' device times were read at the next take: every other step waited.) The
    times stay right. Under ``--grad-marks-every 3`` a step without marks records exactly
    one gradient event on the device, not one per parameter (``ReadyTimes.set_only``): the
    stand-in counts the events each step recorded on the compute stream. (On the Python
    capture the gradients' hooks record ``torch.Event``s; they skip the same ones.)"""
    steps, every, lag_ms = 24, 3, 200
    ranks = _run(tmp_path, "--capture", capture, "--steps", str(steps), "--lag-ms", str(lag_ms), "--offset-s", "1000",
                 "--grad-marks-every", str(every))
    marked = {s for s in range(steps) if s < 5 or s % every == 0}
    for r, (host, meta, events) in ranks.items():
        _check_structure(host, meta, events, steps, marked)
        assert meta["clock_blocked"] > 0 and host["during"]["event_syncs"] > 0  # waited for its own events
        waited = [s for s, (a, b) in enumerate(host["brackets_ns"]) if b - a > lag_ms * 1e6 / 2]
        # one step in three by design (8 here), and a step or two a stall on 2 loaded cores
        # stretched past 100 ms; waiting every other step (12) fails
        assert len(waited) <= steps // 3 + 2, waited
        for start, d_start, d_end in _offsets_us(host, events):
            assert -TOL_US <= d_start and d_end <= TOL_US, (r, d_start, d_end)
        recorded = host["recorded"]
        on_marked = {recorded[s] for s in range(1, steps) if s in marked}
        on_unmarked = {recorded[s] for s in range(1, steps) if s not in marked}
        assert len(on_marked) == 1 and len(on_unmarked) == 1, recorded  # the same events every step of a kind
        assert on_marked.pop() - on_unmarked.pop() == PARAMS - 1, recorded


@pytest.mark.ddp
def test_fsdp2_timed_on_the_device_reads_where_the_device_ran_each_unit(tmp_path, built):
    """FSDP2 (each Linear ``fully_shard``-ed, then the root) traced with its clock on the
    stand-in, pinned to the compute stream 3 ms behind the host: every step where the
    device ran it, each unit's compute and each collective inside its step (a collective's
    end read from its Work's future on the device), every all-gather there (two a unit: its
    forward and its backward), no device or stream sync, the shards bit-identical to an
    untraced copy's. The script unshards the first layer before each forward, between
    steps: that all-gather is its step's, timed on the device like the rest, first in it.
    It clips the gradients before each optimizer step: DTensor's all-reduce of their norm
    is the step's one collective of no unit, after backward, before the optimizer, timed
    on the compute stream from its launch to the end of the wait for its output."""
    steps = 6
    ranks = _run(tmp_path, "--fsdp2", "--steps", str(steps), "--lag-ms", "3", "--offset-s", "1000", "--unshard-first",
                 "--clip")
    for r, (host, meta, events) in ranks.items():
        assert meta["clock"] == "cuda-event" and meta["status"] == "complete"
        assert host["same_as_untraced"], "tracing changed the training"
        assert host["during"]["device_syncs"] == 0 and host["during"]["stream_syncs"] == 0
        for start, d_start, d_end in _offsets_us(host, events):
            assert -TOL_US <= d_start and d_end <= TOL_US, (r, d_start, d_end)
        spans = _by_step(events, fmt.CAT_STEP)
        units = _by_step(events, fmt.CAT_UNIT)
        gathers = _by_step(events, fmt.CAT_ALL_GATHER)
        for s in range(steps):
            (step,) = spans[s]
            lo, hi = step["ts"] - 1e-3, step["ts"] + step["dur"] + 1e-3
            assert all(lo <= e["ts"] and e["ts"] + e["dur"] <= hi for e in units[s] + gathers[s]), s
            assert sorted(e["args"]["unit"] for e in gathers[s]) == sorted(2 * list(range(7))), s  # 7 units
            assert all(e["dur"] > 0 for e in gathers[s]), s
            (first,) = [e for e in gathers[s] if e["args"]["unit"] == 0 and e["args"]["phase"] == "forward"]
            assert first["ts"] <= min(e["ts"] for e in units[s]) and first["ts"] >= step["ts"] - 1e-3, s
            (norm,) = [e for e in _by_step(events, fmt.CAT_REDUCE_SCATTER)[s] if e["args"]["unit"] == -1]
            assert norm["name"] == "all_reduce (torch.nn.utils.clip_grad._get_total_norm)" and norm["dur"] > 0, s
            assert norm["args"]["bytes"] == 4 * PARAMS, s  # each parameter's partial norm, float32
            (backward,) = _by_step(events, fmt.CAT_BACKWARD)[s]
            (update,) = _by_step(events, fmt.CAT_OPTIMIZER)[s]
            assert backward["ts"] + backward["dur"] - 1e-3 <= norm["ts"], s
            assert norm["ts"] + norm["dur"] <= update["ts"] + 1e-3, s
