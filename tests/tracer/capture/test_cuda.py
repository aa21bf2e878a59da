"""The GPU path, on a real GPU: skipped without CUDA (CI has none; README says so).

A 1-rank NCCL DDP run and a 2-rank run with CUDA tensors on gloo, both traced with CUDA
events and profiled by torch.profiler at once (``ddpscope run --profile``), and a 2-rank
NCCL run where two GPUs exist. Checked: the tracer's bucket all-reduces against the
profile's (NCCL kernels, or gloo's spans), step by step, and the tracer's memory
figures against ``torch.cuda.memory_allocated`` read by the script at the same moment
(after ``optimizer.step()`` returns, where the tracer closes a step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"), pytest.mark.ddp]

from ddpscope.viz.ddp.profile_check import compute_profile_agreement  # noqa: E402
from ddpscope.viz.sources.run_profile import load_run_profile  # noqa: E402
from ddpscope.viz.trace import load_run  # noqa: E402
from ddpscope.viz.whatif.cost import read_calibration  # noqa: E402
from tests.conftest import ROOT, run_cli  # noqa: E402

WORKER = ROOT / "tests" / "workers" / "cuda_train.py"


def traced(tmp_path: Path, nproc: int, backend: str, *script_args: str, profile: bool = True, steps: int = 6,
           ddpscope: tuple[str, ...] = ()):
    out, report = tmp_path / f"{backend}{nproc}", tmp_path / f"report-{backend}{nproc}"
    proc = run_cli("run", "--nproc", str(nproc), "--steps", str(steps),
                   *(["--profile", "--profile-steps", "4"] if profile else []), *ddpscope,
                   "--out", str(out), "--", str(WORKER), "--backend", backend, "--report", str(report),
                   "--steps", str(steps + 2), *script_args, timeout=600)
    assert proc.returncode == 0, proc.stderr
    trace = load_run(out)
    reports = {r: json.loads(Path(f"{report}.{r}.json").read_text()) for r in range(nproc)} \
        if Path(f"{report}.0.json").exists() else {}
    return trace, load_run_profile(trace) if profile else None, reports


def check_memory(trace, reports) -> None:
    assert reports and all(reports.values()), "the script wrote no report"
    compared = 0
    for rank, rows in reports.items():
        mem = trace.memory[trace.memory["rank"] == rank].set_index("step")
        for row in rows:
            if row["step"] in mem.index:
                m = mem.loc[row["step"]]
                assert m["allocated_bytes"] == row["allocated_bytes"], (rank, row)
                assert m["params_bytes"] == row["params_bytes"] and m["grads_bytes"] == row["grads_bytes"]
                # the allocator's own counters, read at the same moment; its peak is the script's
                assert m["reserved_bytes"] == row["reserved_bytes"], (rank, row)
                assert m["peak_allocated_bytes"] == row["peak_allocated_bytes"], (rank, row)
                compared += 1
    assert compared >= len(reports)  # at least one measured step of each rank compared


def check_buckets(trace, profile, timed: bool) -> None:
    a = compute_profile_agreement(trace, profile)
    assert len(a) and (a["tracer_bytes"] == a["profile_bytes"]).all(), a
    if timed:  # a bucket ends (the tracer's event after NCCL's work) as its kernel ends
        assert (a["end_before_done_ms"].abs() <= 0.05).all(), a
        assert (a["start_after_launch_ms"] >= -0.05).all(), a


def check_ready_times(trace) -> None:
    """Every parameter's gradient-ready time, every step, inside its pass's backward (the
    compiled capture: C++ hooks' device events on the shared anchors, read a step late)."""
    g, passes = trace.grads, trace.passes
    n_params = len(trace.ranks[0]["param_names"])
    assert len(g) and g["ready_us"].notna().all(), g.head()
    per_step = g.groupby(["rank", "step"])["param"].nunique()
    assert (per_step == n_params).all(), per_step
    both = g.merge(passes, on=["rank", "step", "micro"])
    assert len(both) == len(g)
    # a gradient is accumulated after its pass's backward began and by the end of its compute
    assert (both["ready_us"] >= both["backward_start_us"] - 5.0).all(), both.head()
    assert (both["ready_us"] <= both["backward_end_us"] + 5.0).all(), both.head()


def capture_path_expected() -> str:
    from ddpscope.tracer.capture.native import build as native

    return "compiled" if native.built_library() is not None else "python"


def test_one_rank_nccl(tmp_path):
    trace, profile, reports = traced(tmp_path, 1, "nccl")
    assert trace.ranks[0]["clock"] == "cuda-event" and trace.ranks[0]["backend"] == "nccl"
    # the compiled capture on CUDA: the wrapper's own events, read a step late
    assert trace.ranks[0]["capture_path"] == capture_path_expected(), trace.ranks[0].get("capture_path_note")
    # one rank: NCCL all-reduces in place without a kernel; the CPU-side spans still count
    kernels = profile.kernels
    timed = ((kernels["kind"] == "comm") & (kernels["stream"] >= 0)).any()
    check_buckets(trace, profile, timed=bool(timed))
    check_memory(trace, reports)
    check_ready_times(trace)
    if trace.ranks[0]["capture_path"] == "compiled":  # the clock's stamps from the C++ ring, not Python events
        assert trace.ranks[0]["clock_ring_stamps"] >= 6 * 5, trace.ranks[0].get("clock_ring_stamps")
    b = trace.buckets
    assert (b["num_params"] > 0).all()  # the layout read without copying the buckets on the GPU
    # NCCL timed each bucket's collective itself (its collectives timing, turned on by the tracer)
    assert "kernel_us" in b and b["kernel_us"].notna().all(), b.head()
    assert (b["kernel_us"] <= b["done_us"] - b["launch_us"] + 5.0).all(), b[["launch_us", "done_us", "kernel_us"]]


def test_two_ranks_gloo_with_cuda_tensors(tmp_path):
    trace, profile, reports = traced(tmp_path, 2, "gloo")
    assert {m["clock"] for m in trace.ranks.values()} == {"cuda-event"}
    check_buckets(trace, profile, timed=False)  # gloo's span is host-side, around its copies
    check_ready_times(trace)
    check_memory(trace, reports)
    # its calibration sweeps what it ran on: gloo on CUDA tensors, the two ranks sharing a GPU as
    # its ranks did (this machine's own choice would be gloo on CPU, 2 ranks > 1 GPU: a sweep the
    # what-if leaves unused)
    cal = run_cli("calibrate", str(tmp_path / "gloo2"), "--max-mb", "1", timeout=600)
    assert cal.returncode == 0, cal.stderr[-3000:]
    got = json.loads((tmp_path / "gloo2" / "calibration.json").read_text())
    assert (got["backend"], got["device"]) == ("gloo", "cuda")
    assert read_calibration(tmp_path / "gloo2").unlike(json.loads((tmp_path / "gloo2" / "run.json").read_text()), 2) \
        is None


def test_no_device_sync_inside_traced_steps_and_the_scripts_peak_stays_its_own(tmp_path):
    """torch's sync debug mode set to "error" from step 2 on: a device or stream synchronize
    inside a step (the tracer's, resolving its events) would raise and stop tracing or the
    script. The script's own peak (a 512 MiB temporary before training) is never reset."""
    trace, _, reports = traced(tmp_path, 1, "nccl", "--sync-debug-from", "2", "--temp-mib", "512", profile=False)
    meta = trace.ranks[0]
    assert meta["status"] == "complete" and meta["steps"] == 6, meta  # `ddpscope run --steps 6`: steps 2-5 in "error" mode
    assert meta["capture_path"] == capture_path_expected(), meta.get("capture_path_note")
    rows = reports[0]
    assert len(rows) >= 5  # steps 0-4 returned from optimizer.step() (the job ends inside step 5's)
    assert all(r["peak_allocated_bytes"] >= 512 * 2**20 for r in rows), rows
    check_memory(trace, reports)
    mem = trace.memory
    assert (mem["device_total_bytes"] > mem["device_free_bytes"]).all()
    assert (mem["reserved_bytes"] >= mem["allocated_bytes"]).all()


def test_steps_without_gradient_marks_record_one_event_and_never_sync(tmp_path):
    """``--grad-marks-every 3`` on NCCL, in sync debug mode "error" from step 2: the steps
    without marks (5, 7, 8) have none in the trace, their backward keeps its compute end
    (the one gradient event their C++ hooks recorded), the marked ones every gradient's
    device time; nothing synchronises inside a step."""
    trace, _, _ = traced(tmp_path, 1, "nccl", "--sync-debug-from", "2", profile=False, steps=10,
                         ddpscope=("--grad-marks-every", "3"))
    meta = trace.ranks[0]
    assert meta["status"] == "complete" and meta["steps"] == 10, meta
    steps = trace.steps.set_index("step")
    assert sorted(steps.index[~steps["grad_marks"]]) == [5, 7, 8]
    assert set(trace.grads["step"]) == {0, 1, 2, 3, 4, 6, 9}
    check_ready_times(trace)  # every parameter on each marked step, inside its backward
    assert steps["compute_end_us"].notna().all(), steps["compute_end_us"]
    assert (steps["compute_end_us"] <= steps["backward_end_us"] + 5.0).all()
    assert (steps["compute_end_us"] >= steps["backward_start_us"] - 5.0).all()


def test_the_host_runs_ahead_of_a_busy_device_while_traced(tmp_path):
    """A GPU kept busy 20 ms a step (a sleeping kernel: no host time): untraced, the host
    launches step N while the device still runs step N-1. Traced, it must still: the tracer
    reads a step's events when the step is resolved, two steps later, and waits for nothing
    sooner (reading the buckets' events at the next take made the host wait for the previous
    step every step; tests/tracer/capture/test_device_path.py shows that on a stand-in)."""
    trace, _, reports = traced(tmp_path, 1, "nccl", "--gpu-sleep-ms", "20", "--sync-debug-from", "2",
                               profile=False, steps=12)
    meta = trace.ranks[0]
    assert meta["status"] == "complete" and meta["capture_path"] == capture_path_expected(), meta
    rows = [r for r in reports[0] if r["step"] >= 3]
    assert sum(r["previous_running"] for r in rows) >= len(rows) - 1, rows  # ran ahead every step
    check_ready_times(trace)


def test_the_clock_stays_within_the_hosts_bracket_over_time(tmp_path):
    """The CUDA clock against the host clock for 30 s: events on an idle stream, each
    bracketed by host reads (before the record, when ``query()`` first says done), resolve
    inside their bracket (± 5 µs) with re-anchoring; the worker prints what one anchor
    taken at the start gives at the end (float32 ms and drift), for the note."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "workers" / "cuda_clock_check.py"), "30"],
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ,
                                                                            "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["reanchored_worst_outside_us"] <= 5.0, result
    assert result["blocked"] == 0, result


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_nccl(tmp_path):
    trace, profile, reports = traced(tmp_path, 2, "nccl")
    assert {m["capture_path"] for m in trace.ranks.values()} == {capture_path_expected()}
    check_buckets(trace, profile, timed=True)
    check_memory(trace, reports)


def check_units_against_the_profile(trace, all_matched: bool) -> None:
    """Each unit's all-gather and reduce-scatter against the profile's NCCL kernels on the
    same run: the input bytes (a shard, or the whole), the kernel inside the span the tracer
    timed on its stream (it starts after the tracer's start, its end within 50 µs or 2 %
    of the span before the tracer's). Kernels only: one rank's NCCL copies without a kernel,
    and the profile then takes the CPU-side ``nccl:`` spans (the enqueue, ahead of the
    device) as its collectives; so on one GPU only kernels the profile holds are compared."""
    import dataclasses

    from ddpscope.viz.sharded.profile_check import compute_sharded_profile_agreement

    profile = load_run_profile(trace)
    on_device = dataclasses.replace(profile, kernels=profile.kernels[profile.kernels["stream"] >= 0])
    a = compute_sharded_profile_agreement(trace, on_device)
    both = a.dropna(subset=["start_us", "profile_start_us"])
    if all_matched:
        assert len(a) and len(both) == len(a), a
    assert (both["profile_bytes"] == both["expected_profile_bytes"]).all(), both
    span_ms = (both["end_us"] - both["start_us"]) / 1e3
    assert (both["start_after_ms"] >= -0.05).all(), both
    assert ((both["end_before_ms"] >= -0.05) & (both["end_before_ms"] <= (0.02 * span_ms).clip(lower=0.05))).all(), both


@pytest.mark.parametrize("nproc", [1, 2])
def test_fsdp2_on_nccl_is_traced_per_unit_with_cuda_events(tmp_path, nproc):
    """The sharded capture on CUDA: stamps are CUDA events (collectives on FSDP's own
    streams), memory adds the allocator's remainder, parameters match the untraced run."""
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs")
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS, run_cli

    script = str(WORKERS / "fsdp2_train.py")
    out, report = tmp_path / "run", tmp_path / "report"
    proc = run_cli("run", "--nproc", str(nproc), "--profile", "--profile-steps", "2", "--out", str(out), "--", script,
                   "--cuda", "--steps", "4", "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = load_run(out)
    check_units_against_the_profile(trace, all_matched=nproc > 1)
    assert trace.ranks[0]["clock"] == "cuda-event" and trace.ranks[0]["backend"] == "nccl"
    sh = trace.shards
    assert sh.stage == 3 and sh.reduce_scatter_sent_as is None  # NCCL has a reduce-scatter
    assert (sh.memory["other_bytes"] >= 0).all()
    if nproc > 1:
        colls = sh.colls[sh.colls["step"] == 2]
        assert set(colls["collective"]) == {"all_gather", "reduce_scatter"} and (colls["end_us"] >= colls["start_us"]).all()


def test_an_unshard_before_forward_is_the_next_steps_on_nccl(tmp_path):
    """PyTorch's FSDP2 example on a GPU: the script's ``model.unshard()`` before each forward
    (and an evaluation between steps) on NCCL. Each step from the second holds the root's
    forward all-gather, timed on FSDP's all-gather stream, at or after the step's start (a
    compute-stream stamp taken as the call began), before its forward; training is the
    untraced run's."""
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS, run_cli, untraced

    script = (str(WORKERS / "fsdp2_train.py"), "--cuda", "--steps", "4", "--unshard-first", "--prefetch", "2,2")
    out, report = tmp_path / "run", tmp_path / "report"
    proc = run_cli("run", "--nproc", "1", "--out", str(out), "--", *script, "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, *script, nproc=1)
    traced, base = (json.loads((d / "rank0.json").read_text()) for d in (report, plain))
    assert traced["params_sha256"] == base["params_sha256"] and traced["losses"] == base["losses"]
    trace = load_run(out)
    assert trace.ranks[0]["clock"] == "cuda-event"
    assert (trace.run["sharding"]["forward_prefetch"], trace.run["sharding"]["backward_prefetch"]) == (2, 2)
    c = trace.shards.colls
    early = c[(c["step"] >= 1) & (c["unit"] == 0) & (c["collective"] == "all_gather") & (c["phase"] == "forward")]
    assert sorted(early["step"]) == [1, 2, 3]
    steps = trace.steps.set_index(["rank", "step"])
    for _, g in early.iterrows():
        step = steps.loc[(g["rank"], g["step"])]
        assert step["start_us"] - 50 <= g["start_us"] <= g["end_us"] and step["start_us"] < step["forward_start_us"]


def test_the_scripts_and_the_gradient_norms_all_reduces_are_collectives_of_no_unit_on_nccl(tmp_path):
    """FSDP2 on NCCL with the script's own ``dist.all_reduce`` of its loss and
    ``clip_grad_norm_`` before each optimizer step: each is a collective of no unit in its
    step, timed on the compute stream (a synchronous NCCL call makes the stream wait; the
    functional one's wait does), after backward and before the optimizer; training is the
    untraced run's. On one GPU DTensor has no norm to all-reduce (a mesh of one): only the
    script's is there."""
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS, run_cli, untraced

    nproc = min(2, torch.cuda.device_count())
    script = (str(WORKERS / "fsdp2_train.py"), "--cuda", "--steps", "4", "--clip", "1.0", "--loss-allreduce")
    out, report = tmp_path / "run", tmp_path / "report"
    proc = run_cli("run", "--nproc", str(nproc), "--out", str(out), "--", *script, "--report", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, *script, nproc=nproc)
    for r in range(nproc):
        traced, base = (json.loads((d / f"rank{r}.json").read_text()) for d in (report, plain))
        assert traced["params_sha256"] == base["params_sha256"] and traced["norms"] == base["norms"]
    trace = load_run(out)
    assert trace.ranks[0]["clock"] == "cuda-event"
    c = trace.shards.colls
    own = c[c["unit"] == -1]
    expected = {"the script": 4 * nproc} | ({"torch.nn.utils.clip_grad": 4 * nproc} if nproc > 1 else {})
    assert {k: int(own["by"].str.contains(k, regex=False).sum()) for k in expected} == expected
    steps = trace.steps.set_index(["rank", "step"])
    for _, g in own.iterrows():
        step = steps.loc[(g["rank"], g["step"])]
        assert step["backward_end_us"] - 50 <= g["start_us"] <= g["end_us"] <= step["optimizer_start_us"] + 50


def test_ddpscopes_own_jobs_take_a_gpu_per_rank_or_say_why_not(tmp_path):
    """One rank more than there are GPUs (the demo's default 2 on a 1-GPU machine): gloo on
    CPU, said in one line, not a crash in set_device; calibrating that run likewise. A rank
    per GPU: NCCL, and (two GPUs or more) its calibration sweeps NCCL all-reduces, its repeat
    counts agreed over NCCL on the device."""
    gpus = torch.cuda.device_count()
    over = run_cli("run", "--demo", "gpt", "--nproc", str(gpus + 1), "--steps", "3", "--out", str(tmp_path / "over"),
                   timeout=600)
    assert over.returncode == 0, over.stderr[-3000:]
    assert "NCCL needs a GPU of its own for each rank" in over.stdout + over.stderr
    assert {m["backend"] for m in load_run(tmp_path / "over").ranks.values()} == {"gloo"}
    cal = run_cli("calibrate", str(tmp_path / "over"), "--max-mb", "1", timeout=600)
    assert cal.returncode == 0, cal.stderr[-3000:]
    got = json.loads((tmp_path / "over" / "calibration.json").read_text())
    assert (got["backend"], got["device"]) == ("gloo", "cpu")  # the run's own
    one = run_cli("run", "--demo", "gpt", "--nproc", str(gpus), "--steps", "3", "--out", str(tmp_path / "one"),
                  timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    assert {m["backend"] for m in load_run(tmp_path / "one").ranks.values()} == {"nccl"}
    if gpus >= 2:
        cal = run_cli("calibrate", str(tmp_path / "one"), "--max-mb", "4", timeout=600)
        assert cal.returncode == 0, cal.stderr[-3000:]
        got = json.loads((tmp_path / "one" / "calibration.json").read_text())
        assert got["backend"] == "nccl" and got["device"] == "cuda" and got["sizes"][-1]["bytes"] == 4 * 2**20
