"""``ddpscope run -- script.py``: zero-code capture of unmodified training scripts, run
for real (torchrun, 2 gloo ranks), checked against what the scripts measure themselves,
DDP's own runtime logging and the same scripts run untraced."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from ddpscope.viz.ddp.gantt import backward_segments
from ddpscope.viz.ddp.overlap import compute_ddp_logging_view, compute_step_breakdown
from ddpscope.viz.trace import load_run
from ddpscope.viz.whatif.simulate import predict_layout, predict_run, traced_cap
from tests.conftest import ROOT, processes_mentioning, run_cli

pytestmark = pytest.mark.ddp
WORKERS = ROOT / "tests" / "workers"
USER = str(WORKERS / "user_train.py")


def trace_script(tmp_path: Path, *script: str, ddpscope: tuple[str, ...] = (), name: str = "run",
                 env: dict | None = None) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """``ddpscope run --nproc 2 [ddpscope] --out OUT -- script --report REPORT``, from a
    folder that is not the project."""
    out, report = tmp_path / name, tmp_path / f"{name}-report"
    proc = run_cli("run", "--nproc", "2", *ddpscope, "--out", str(out), "--", *script, "--report", str(report),
                   env=env)
    return proc, out, report


def test_a_bucket_cap_mb_list_is_applied_traced_and_predicted(tmp_path):
    """``--bucket-cap-mb-list`` replaces the script's own bucket_cap_mb: DDP (its
    ``bucket_bytes_cap_list``, its rebuilt layout from ``_get_ddp_logging_data()``) uses
    the limits; run.json holds them and the layout; the what-if lays out the same buckets
    from the trace alone; the rerun command carries the list."""
    limits = [2**18, 2**20, 2**19]
    proc, out, report = trace_script(tmp_path, USER, "--steps", "4", "--bucket-cap-mb", "2",
                                     ddpscope=("--bucket-cap-mb-list", "0.25,1,0.5"), name="caplist")
    assert proc.returncode == 0, proc.stderr
    trace = load_run(out)
    run, c = trace.run, checks(report)[0]
    assert c["bucket_bytes_cap_list"] == limits == run["bucket_cap_bytes_list"]
    assert c["bucket_bytes_cap"] == 2**20 == run["bucket_cap_bytes"]  # the largest is DDP's cap
    assert run["bucket_cap_mb_list_requested"] == [0.25, 1.0, 0.5] and run["bucket_cap_mb_script"] == 2.0
    rebuilt = [[int(i) for i in b.split()] for b in c["rebuilt"].split(",")]
    assert run["bucket_layout"] == rebuilt and len(rebuilt) >= 4
    sizes = run["param_bytes"]
    for k, b in enumerate(rebuilt[:-1]):  # bucket k closes on the gradient that takes it to its limit
        assert sum(sizes[i] for i in b) >= limits[min(k, len(limits) - 1)] > sum(sizes[i] for i in b[:-1])
    assert traced_cap(trace) == (0.25, 1.0, 0.5) and predict_layout(trace, traced_cap(trace)) == rebuilt
    assert set(trace.buckets[trace.buckets.step >= 1].bytes) == {sum(sizes[i] for i in b) for b in rebuilt}
    assert "--bucket-cap-mb-list 0.25,1,0.5 --out " in run["command"]


def untraced(tmp_path: Path, *script: str, name: str = "plain", nproc: int = 2) -> Path:
    """The same script under torchrun alone: no ddpscope anywhere on its path (its output
    kept in ``tmp_path/<name>.log``)."""
    report = tmp_path / f"{name}-report"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DDPSCOPE_CAPTURE")}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--rdzv-backend",
                           "static", "--rdzv-endpoint", f"127.0.0.1:{_port()}", "--log-dir", str(tmp_path / f"{name}-torchrun"),
                           *script, "--report", str(report)],
                          cwd="/", env=env, capture_output=True, text=True, timeout=240)
    (tmp_path / f"{name}.log").write_text(proc.stdout + proc.stderr)  # what the script printed, for who reads it
    # torch 2.13's gloo sometimes aborts a rank as its process exits, untraced too ("terminate called
    # without an active exception", after the script ended; see tests/workers/user_train.py): the
    # reference run is whole when every rank wrote its report before that
    torn_down = "terminate called without an active exception" in proc.stderr and report.is_dir() \
        and len(list(report.glob("*rank*.json"))) >= nproc
    assert proc.returncode == 0 or torn_down, proc.stderr[-3000:]
    return report


def _port() -> int:
    from ddpscope.tracer.launch.torchrun import free_port

    return free_port()


def checks(report: Path) -> dict[int, dict]:
    return {r: json.loads((report / f"check-rank{r}.json").read_text()) for r in (0, 1)}


def test_gradient_accumulation_every_micro_batch_is_its_own_pass(tmp_path):
    """4 micro-batches (no_sync on the first 3): each forward and backward is its own
    span, the all-reduces belong to the syncing pass, and the figures agree with the
    script's own timings and with DDP's runtime logging of the syncing pass."""
    proc, out, report = trace_script(tmp_path, USER, "--accumulate", "4", "--steps", "8",
                                     ddpscope=("--bucket-cap-mb", "1"))
    assert proc.returncode == 0, proc.stderr
    trace, own = load_run(out), checks(report)
    p = trace.passes
    assert sorted(p.groupby(["rank", "step"]).size().unique()) == [4]
    assert p.groupby(["rank", "step"])["sync"].apply(tuple).unique().tolist() == [(False, False, False, True)]
    # every bucket all-reduce launched inside the syncing pass's backward (or its wait)
    sync = p[p.sync].set_index(["rank", "step"])
    b = trace.buckets.join(sync[["backward_start_us"]], on=["rank", "step"])
    assert (b.launch_us >= b.backward_start_us).all() and len(b) >= 8 * 2 * 3

    # per micro-batch: forward and backward against the script's own perf_counter timings
    off, preempted, compared = [], set(), 0
    for r, c in own.items():
        mine = p[p["rank"] == r].set_index(["step", "micro"])
        for o in c["own"]:
            row = mine.loc[(o["step"], o["micro"])]
            fwd = (row.forward_end_us - row.forward_start_us) / 1e3
            bwd = (row.backward_end_us - row.backward_start_us) / 1e3
            if o["sync"]:
                bwd += (row.sync_end_us - row.sync_start_us) / 1e3  # loss.backward() returns after DDP's wait
            for what, ours, theirs in (("forward", fwd, o["forward_ms"]), ("backward", bwd, o["backward_ms"])):
                compared += 1
                assert ours <= theirs + 0.05, (r, o, what, ours)  # our spans lie inside the script's
                if theirs - ours > max(0.10 * theirs, 1.0):
                    off.append(f"rank {r} step {o['step']} micro {o['micro']} {what}: {ours:.2f} vs {theirs:.2f} ms")
                    preempted.add((r, o["step"]))
    # a preempted stamp now and then on 2 busy cores (4 of 128 seen): at most 1 in 10 off (a
    # wrong span would put most of them off)
    assert len(off) <= max(3, compared // 10), off

    # the step's figures: forward and backward summed over micro-batches, not first-to-last
    bd = compute_step_breakdown(trace).set_index(["rank", "step"])
    for r, c in own.items():
        for step in range(1, 8):
            micro = [o for o in c["own"] if o["step"] == step]
            fwd = sum(o["forward_ms"] for o in micro)
            assert bd.loc[(r, step), "forward_ms"] <= fwd + 0.2
            if (r, step) not in preempted:  # a pass already let off above is in its step's sum too
                assert bd.loc[(r, step), "forward_ms"] >= 0.8 * fwd - 1.0
            assert bd.loc[(r, step), "micro_batches"] == 4
    assert (bd.comm_ms >= bd.overlapped_ms).all() and (bd.exposed_ms >= 0).all()
    assert ((bd.overlapped_ms + bd.exposed_ms - bd.comm_ms).abs() < 1e-6).all()
    # the old error, one "forward" from the first micro-batch's start to the last one's
    # end, would hold the three no_sync backwards too
    first_fwd = p.groupby(["rank", "step"]).forward_start_us.min().loc[bd.index]
    last_fwd_end = p.groupby(["rank", "step"]).forward_end_us.max().loc[bd.index]
    span_ms = (last_fwd_end - first_fwd) / 1e3
    for (r, step), span in span_ms.items():
        no_sync_bwd = sum(o["backward_ms"] for o in own[r]["own"] if o["step"] == step and not o["sync"])
        assert span - bd.loc[(r, step), "forward_ms"] >= 0.8 * no_sync_bwd

    # DDP's runtime logging for the syncing pass: within 10 % or 2 ms
    view = compute_ddp_logging_view(trace).set_index(["rank", "step"])
    keys = {"forward_compute_time": "forward_compute_ms", "backward_compute_time": "backward_compute_ms",
            "backward_comm_time": "backward_comm_ms",
            "backward_compute_comm_overlap_time": "backward_compute_comm_overlap_ms"}
    compared, off = 0, []
    for r, c in own.items():
        for rec in c["logging"]:
            if (r, rec["step"]) not in view.index:
                continue
            compared += 1
            for key, col in keys.items():
                theirs, mine = rec[key] / 1e6, view.loc[(r, rec["step"]), col]
                if abs(mine - theirs) > max(0.10 * theirs, 2.0):
                    off.append(f"rank {r} step {rec['step']} {key}: {mine:.2f} vs DDP {theirs:.2f} ms")
    # as above: a preempted pass now and then, at most 1 figure in 10 off (a wrong view puts most off)
    assert compared >= 2 * 5 and len(off) <= max(2, compared * len(keys) // 10), off

    # the What-if's replay keeps the no_sync passes as measured: drawn, each backward is
    # cut at its gradients as the trace's is (they once came out blank)
    pred = predict_run(trace, 1.0)
    no_sync = p[~p.sync][["rank", "step", "backward_start_us", "backward_end_us"]]

    def no_sync_segments(t):
        seg = backward_segments(t, pred.steps).merge(no_sync, on=["rank", "step"])
        seg = seg[(seg.start_us >= seg.backward_start_us) & (seg.end_us <= seg.backward_end_us)]
        return seg[["rank", "step", "start_us", "end_us", "label"]].sort_values(["rank", "start_us"],
                                                                                ignore_index=True)

    measured = no_sync_segments(trace)
    assert len(measured) >= 3 * len(pred.steps)  # 3 no_sync passes a step, a segment at least each
    pd.testing.assert_frame_equal(no_sync_segments(pred), measured)


# a script's Python hook in the default suite: test_compiled's test_the_scripts_own_hook_is_timed_in_python_and_said
@pytest.mark.breadth  # ~16 s each
@pytest.mark.parametrize("hook", ["fp16", "builtin-fp16", "custom"])
def test_the_scripts_own_comm_hook_is_wrapped_timed_and_bit_identical(tmp_path, hook):
    """A hook the script registers after building DDP runs inside ddpscope's: every
    bucket is timed, and the parameters equal those of the same run untraced. The hook's
    own collectives (``custom`` calls ``dist.all_reduce``) are the buckets', never the
    step's other collectives."""
    proc, out, report = trace_script(tmp_path, USER, "--hook", hook, "--steps", "5", "--bucket-cap-mb", "1")
    assert proc.returncode == 0, proc.stderr
    plain = untraced(tmp_path, USER, "--hook", hook, "--steps", "5", "--bucket-cap-mb", "1")
    ours, theirs = checks(report), checks(plain)
    for r in (0, 1):
        assert ours[r]["params_sha256"] == theirs[r]["params_sha256"], f"rank {r} differs from the untraced run"
    trace = load_run(out)
    expected = {"fp16": "fp16_compress_hook", "builtin-fp16": "FP16_COMPRESS (DDP's built-in C++ hook)",
                "custom": "register_hook.<locals>.scaled_sum"}[hook]
    assert trace.run["comm_hook"] == expected
    layout = trace.run["bucket_layout"]
    per_step = trace.buckets[trace.buckets.step >= 1].groupby(["rank", "step"]).size()
    assert len(layout) >= 3 and (per_step == len(layout)).all()
    assert (trace.buckets.done_us > trace.buckets.launch_us).all()
    assert trace.steps["other_comm_count"].isna().all()
    # DDP's built-in C++ hook all-reduces on the reducer's group, so the compiled capture
    # times it there (its fp16 copies: half each bucket's bytes); a Python hook's collectives
    # may go elsewhere, so those are timed by the Python hooks
    meta = trace.ranks[0]
    assert meta["capture_path"] == ("compiled" if hook == "builtin-fp16" else "python"), meta["capture_path_note"]
    names, nbytes = meta["param_names"], dict(zip(meta["param_names"], meta["param_bytes"]))
    layout_bytes = {sum(nbytes[names[i]] for i in b) for b in layout}
    sent = set(trace.buckets[trace.buckets.step >= 1].bytes)
    assert sent == ({b // 2 for b in layout_bytes} if hook == "builtin-fp16" else layout_bytes)


def test_the_override_wins_and_without_it_the_scripts_cap_stands(tmp_path):
    proc, out, report = trace_script(tmp_path, USER, "--steps", "4", "--bucket-cap-mb", "2", name="script-cap")
    assert proc.returncode == 0, proc.stderr
    run, c = load_run(out).run, checks(report)[0]
    assert run["bucket_cap_mb"] == 2.0 and run["bucket_cap_mb_script"] == 2.0 and run["bucket_cap_mb_requested"] is None
    assert c["bucket_bytes_cap"] == 2 * 2**20 and not run["bucket_cap_default"]
    assert "in place of" not in proc.stderr and not any("replaced" in n for n in run["notes"])
    assert run["bucket_layout"] == [[int(i) for i in b.split()] for b in c["rebuilt"].split(",")]
    # where the script sets it: its own DDP(...) line (the independent instrument: the script's source)
    line = next(i for i, t in enumerate(Path(USER).read_text().splitlines(), 1) if "ddp = DDP(model, **kw)" in t)
    assert run["ddp_built_by"] == {"framework": "script", "module": "__main__", "file": USER, "line": line,
                                   "function": run["ddp_built_by"]["function"]}

    proc, out, report = trace_script(tmp_path, USER, "--steps", "4", "--bucket-cap-mb", "2",
                                     ddpscope=("--bucket-cap-mb", "0.5"), name="override")
    assert proc.returncode == 0, proc.stderr
    run, c = load_run(out).run, checks(report)[0]
    assert c["bucket_bytes_cap"] == 2**19 and run["bucket_cap_bytes"] == 2**19  # what DDP really used
    assert run["bucket_cap_mb_script"] == 2.0 and run["bucket_cap_mb_requested"] == 0.5
    # the script's own value named once it is known (a rank), never before it is (the launcher)
    said = "the script's bucket_cap_mb 2 is replaced by --bucket-cap-mb 0.5"
    assert said in run["notes"] and proc.stderr.count(said) == 1
    assert "bucket_cap_mb 0.5 MiB in place of the script's own" in proc.stderr
    assert run["bucket_layout"] == [[int(i) for i in b.split()] for b in c["rebuilt"].split(",")]
    # what a rerun needs
    assert run["script"]["path"] == USER and len(run["script"]["sha256"]) == 64 and run["script"]["cwd"] == "/"
    assert run["script"]["argv"][0] == USER and run["nproc_per_node"] == 2
    assert run["command"].startswith("ddpscope run --nproc 2 --bucket-cap-mb 0.5 --out ")
    assert run["torch_version"].startswith("2.")


def test_steps_ends_a_long_script_cleanly(tmp_path):
    t0 = time.monotonic()
    proc, out, report = trace_script(tmp_path, USER, "--steps", "10000", ddpscope=("--steps", "3"))
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 120
    trace = load_run(out)
    assert trace.run["status"] == "complete" and trace.run["steps"] == 3
    assert trace.steps.groupby("rank").size().to_dict() == {0: 3, 1: 3} and not trace.steps.incomplete.any()
    assert trace.run["clock_offsets"]["end"] is not None  # closed properly, on every rank
    assert "step 3/3" in proc.stderr
    assert not report.exists()  # the script itself never reached its end
    assert processes_mentioning(str(out)) == []


@pytest.mark.breadth  # the default suite keeps --steps ending a script that does not catch it
def test_steps_holds_when_the_script_catches_the_systemexit_and_trains_on(tmp_path):
    """A script that catches the SystemExit ending the job (a framework's wrapper, a loop's
    ``except BaseException``) and trains on: the next step says so once and raises it again."""
    proc, out, report = trace_script(tmp_path, USER, "--steps", "10000", "--catch-exit", "1",
                                     ddpscope=("--steps", "3"))
    assert proc.returncode == 0, proc.stderr
    trace = load_run(out)
    assert trace.run["status"] == "complete" and trace.steps.groupby("rank").size().to_dict() == {0: 3, 1: 3}
    said = "the script caught the SystemExit that ends the job after --steps 3 and trained on"
    assert proc.stderr.count(said) == 1, proc.stderr[-3000:]
    assert any(said in n for n in trace.run["notes"])
    assert proc.stderr.count("rank 0: caught SystemExit after step 2, training on") == 1  # rank 0's output is shown
    assert "caught SystemExit after step 3" not in proc.stderr  # the next opt.step() ended it
    assert not report.exists() and processes_mentioning(str(out)) == []


def test_a_module_run_with_dash_m_from_its_own_folder(tmp_path):
    out = tmp_path / "mod"
    proc = subprocess.run([sys.executable, "-m", "ddpscope.cli", "run", "--nproc", "2", "--out", str(out), "--", "-m",
                           "tests.workers.user_train", "--steps", "3", "--report", str(tmp_path / "r")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    run = load_run(out).run
    assert run["script"]["module"] is True and run["script"]["path"] == USER and run["model"] == "user_train"


@pytest.mark.frameworks
def test_lightning_ddp_strategy_is_traced_with_its_layout_and_the_override_wins(tmp_path):
    script = (str(WORKERS / "lightning_train.py"), "--bucket-cap-mb", "0.5", "--steps", "6", "--accumulate", "2")
    proc, out, report = trace_script(tmp_path, *script, name="lightning")
    assert proc.returncode == 0, proc.stderr
    trace, c = load_run(out), checks(report)[0]
    assert c["class"] == "DistributedDataParallel" and c["global_step"] == 6
    assert trace.run["bucket_cap_mb"] == 0.5 and trace.run["bucket_cap_mb_script"] == 0.5
    assert trace.run["bucket_layout"] == [[int(i) for i in b.split()] for b in c["rebuilt"].split(",")]
    built = trace.run["ddp_built_by"]  # Lightning's strategy built it: DDPStrategy(...) is where the cap goes
    assert built["framework"] == "lightning" and built["module"].startswith("lightning.pytorch.strategies"), built
    # Lightning steps the optimizer with a closure: still one traced step per optimizer step
    assert trace.steps.groupby("rank").size().to_dict() == {0: 6, 1: 6}
    assert (trace.steps.micro_batches == 2).all()

    proc, out, report = trace_script(tmp_path, *script, ddpscope=("--bucket-cap-mb", "0.25"), name="lightning-override")
    assert proc.returncode == 0, proc.stderr
    trace, c = load_run(out), checks(report)[0]
    assert c["bucket_bytes_cap"] == 2**18 and trace.run["bucket_cap_bytes"] == 2**18
    assert trace.run["bucket_layout"] == [[int(i) for i in b.split()] for b in c["rebuilt"].split(",")]


@pytest.mark.frameworks
def test_accelerate_ddp_kwargs_are_traced_and_the_override_wins(tmp_path):
    script = (str(WORKERS / "accelerate_train.py"), "--bucket-cap-mb", "0.5", "--steps", "6", "--accumulate", "2")
    proc, out, report = trace_script(tmp_path, *script, ddpscope=("--bucket-cap-mb", "0.25"), name="accelerate")
    assert proc.returncode == 0, proc.stderr
    trace, c = load_run(out), checks(report)[0]
    assert c["steps"] == 6 and c["bucket_bytes_cap"] == 2**18 and trace.run["bucket_cap_bytes"] == 2**18
    assert trace.run["bucket_cap_mb_script"] == 0.5
    assert trace.run["bucket_layout"] == [[int(i) for i in b.split()] for b in c["rebuilt"].split(",")]
    assert trace.steps.groupby("rank").size().to_dict() == {0: 6, 1: 6} and (trace.steps.micro_batches == 2).all()
    built = trace.run["ddp_built_by"]  # Accelerate's prepare() built it: its DDP kwargs handler sets the cap
    assert built["framework"] == "accelerate" and built["module"] == "accelerate.accelerator", built


@pytest.mark.frameworks
@pytest.mark.parametrize("accumulate", [1, 2])
def test_hugging_face_trainers_own_ddp_is_traced_as_ddp_built_it(tmp_path, accumulate):
    """Hugging Face Trainer with its defaults (its DDP has ``find_unused_parameters=True``):
    every step's buckets are DDP's own (``_get_ddp_logging_data``'s ``bucket_sizes``, in
    order), never a phantom one; the unused-parameter map is its own collective (4 bytes a
    parameter); DDP never rebuilds, and the what-if lays out at the traced cap, and at
    another, the buckets DDP built in a real run at that cap; training is bit-identical."""
    from ddpscope.viz.whatif.simulate import predict_layout

    hf = str(WORKERS / "hf_trainer_train.py")
    script = (hf, "--steps", "4", "--accumulate", str(accumulate))
    runs = {}
    for cap in ("0.1", "0.25"):
        proc, out, report = trace_script(tmp_path, *script, ddpscope=("--bucket-cap-mb", cap), name=f"hf{cap}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        ddp = {r: json.loads((report / f"rank{r}.json").read_text()) for r in (0, 1)}
        assert ddp[0]["find_unused_parameters"] and ddp[0]["rebuilt"] is None and ddp[0]["global_step"] == 4
        runs[cap] = (load_run(out), ddp, report)
    trace, ddp, report = runs["0.1"]
    assert trace.run["capture_path"] == "compiled" and trace.run["find_unused_parameters"] is True
    # the Trainer built it through Accelerate's prepare(): TrainingArguments is where the cap goes
    built = trace.run["ddp_built_by"]
    assert built["framework"] == "transformers" and built["module"] == "accelerate.accelerator", built
    sizes = ddp[0]["bucket_sizes"]
    assert len(sizes) >= 3
    for (rank, step), b in trace.buckets.groupby(["rank", "step"]):
        assert list(b.sort_values("bucket")["bytes"]) == sizes, (rank, step)
    steps = trace.steps
    assert (steps["num_buckets"] == len(sizes)).all() and (steps["micro_batches"] == accumulate).all()
    assert (steps["ddp_own_bytes"] == 4 * len(trace.run["param_bytes"])).all()
    # DDP's first iteration is the warm-up though it never rebuilds (left out of summaries)
    assert steps.groupby("step")["warmup"].all().to_dict() == {s: s == 0 for s in range(4)}
    for cap, (_, built, _) in runs.items():
        predicted = predict_layout(trace, float(cap))
        assert [sum(trace.run["param_bytes"][i] for i in b) for b in predicted] == built[0]["bucket_sizes"], cap
    # bit-identical to the untraced run (the Trainer's own settings, no override)
    plain = untraced(tmp_path, *script)
    proc, out, report = trace_script(tmp_path, *script, name="hf-default")
    assert proc.returncode == 0, proc.stderr[-3000:]
    for r in (0, 1):
        assert json.loads((report / f"rank{r}.json").read_text())["params_sha256"] == \
            json.loads((plain / f"rank{r}.json").read_text())["params_sha256"]


def test_a_script_without_ddp_runs_and_says_nothing_was_traced(tmp_path):
    proc, out, _ = trace_script(tmp_path, USER, "--no-ddp", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    why = "no DistributedDataParallel, FSDP2 or DeepSpeed model was built; nothing was traced"
    assert proc.stderr.strip().splitlines()[-1] == f"ddpscope run: {why}"
    assert json.loads((out / "run.json").read_text())["status"] == "untraced"
    summary = run_cli("summary", str(out))  # the folder says why, in one line
    assert summary.returncode == 2 and summary.stderr.strip() == f"ddpscope summary: error: {out} was run but not traced: {why}"


# A user's Accelerate script as its docs write it: no cpu=True (on a GPU machine it needs none)
ACCELERATE_AS_WRITTEN = """
import torch
from accelerate import Accelerator
accelerator = Accelerator()
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = accelerator.prepare(model, opt)
for _ in range(3):
    accelerator.backward(model(torch.randn(4, 8)).square().mean())
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize("case", ["no process group", "accelerate without ACCELERATE_USE_CPU",
                                  pytest.param("accelerate with it", marks=pytest.mark.breadth),
                                  pytest.param("accelerate distributed, no model", marks=pytest.mark.breadth)])
def test_a_job_whose_ranks_trained_alone_says_why_in_its_last_line(tmp_path, case):
    """Several ranks, no DDP model: where each rank trained alone, the last line says why
    (no process group; Accelerate on a CPU machine seeing one process), not only that no
    DDP model was built; where Accelerate is told, the model is traced."""
    script = tmp_path / "train.py"
    script.write_text("import torch\nm = torch.nn.Linear(4, 4)\nm(torch.randn(2, 4)).sum().backward()\n"
                      if case == "no process group" else
                      "from accelerate import Accelerator\nAccelerator(cpu=True).wait_for_everyone()\n"
                      if case == "accelerate distributed, no model" else ACCELERATE_AS_WRITTEN)
    out = tmp_path / "run"
    env = {"ACCELERATE_USE_CPU": "1"} if case == "accelerate with it" else {"ACCELERATE_USE_CPU": "false"}
    proc = run_cli("run", "--nproc", "2", "--out", str(out), "--", str(script), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((out / "run.json").read_text())
    if case == "accelerate with it":
        assert run["status"] == "complete" and load_run(out).steps.groupby("rank").size().to_dict() == {0: 3, 1: 3}
        return
    if case == "accelerate distributed, no model":  # Accelerate ran distributed: nothing to explain but that
        assert proc.stderr.strip().splitlines()[-1] == ("ddpscope run: no DistributedDataParallel, FSDP2 or DeepSpeed "
                                                        "model was built; nothing was traced")
        return
    why = {"no process group": "the script never initialised a process group (torch.distributed.init_process_group): "
                               "each of the 2 ranks trained alone, so nothing was traced",
           "accelerate without ACCELERATE_USE_CPU": "Accelerate wraps no model in DDP on a machine without "
                                                    "accelerators unless ACCELERATE_USE_CPU=1 is in the environment"}[case]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ddpscope run: {why}"), proc.stderr[-3000:]
    assert proc.stderr.count(why) == 1  # said once, by the launcher
    assert run["status"] == "untraced" and run["error"].startswith(why)


# DDP under compiled autograd's Python reducer (untraceable), a Python subprocess each step
PYTHON_REDUCER = ("import subprocess, sys, torch, torch.distributed as dist, torch._dynamo\n"
                  "torch._dynamo.config.optimize_ddp = 'python_reducer'\n"
                  "dist.init_process_group('gloo')\n"
                  "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))\n"
                  "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
                  "for _ in range(3):\n"
                  "    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
                  "    subprocess.run([sys.executable, '-c', 'import torch.distributed'], check=True)\n"
                  "dist.destroy_process_group()\n")
REDUCER_WHY = "DDP runs under compiled autograd's Python reducer"


@pytest.mark.breadth  # ~10 s: a real job whose rank starts a Python process of its own
def test_a_python_process_the_script_starts_speaks_for_itself_not_for_the_rank(tmp_path):
    """A process a rank's script starts (inductor's compile workers, a data loader) inherits
    the rank's environment, and with it a capture session: it has no process group and no
    model, and it is not the rank. A job that could not be traced (DDP under the Python
    reducer) keeps the rank's own reason, not the subprocess's idea of the job."""
    script = tmp_path / "train.py"
    script.write_text(PYTHON_REDUCER)
    out = tmp_path / "run"
    proc = run_cli("run", "--nproc", "2", "--out", str(out), "--", str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"ddpscope run: {REDUCER_WHY}"), proc.stderr[-2000:]
    notes = json.loads((out / "run.json").read_text())["notes"]
    assert len(notes) == 1 and notes[0].startswith(REDUCER_WHY) and "trained alone" not in proc.stderr


def test_a_bucket_cap_list_ddp_would_refuse_is_not_applied_and_the_job_runs(tmp_path):
    """DDP asserts at its construction that the Python reducer takes no bucket_cap_mb_list:
    ddpscope's override would end the job there; it is said not applied, the script's stay."""
    script = tmp_path / "train.py"
    script.write_text(PYTHON_REDUCER)
    out = tmp_path / "run"
    proc = run_cli("run", "--nproc", "2", "--bucket-cap-mb-list", "1,4", "--out", str(out), "--", str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    notes = json.loads((out / "run.json").read_text())["notes"]
    assert notes[0] == ("--bucket-cap-mb-list 1,4 is not applied: DDP under compiled autograd's Python reducer "
                        "(optimize_ddp='python_reducer') takes no bucket_cap_mb_list; the script's own bucket caps stay")
    assert notes[1].startswith(REDUCER_WHY)


def test_a_script_that_fails_before_any_step_leaves_a_folder_that_says_why(tmp_path):
    """A script that dies before it builds a model (Accelerate's DeepSpeed on CPU: a batch
    check): ``summary`` says it failed and with what, in one line, not that the folder
    holds no run."""
    script = tmp_path / "dies.py"
    script.write_text("raise ValueError('train_batch_size is not micro_batch x accumulation x world size')\n")
    out = tmp_path / "run"
    proc = run_cli("run", "--nproc", "2", "--out", str(out), "--", str(script))
    assert proc.returncode != 0
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    summary = run_cli("summary", str(out))
    lines = summary.stderr.strip().splitlines()
    assert summary.returncode == 2 and len(lines) == 1, summary.stderr
    assert f"{out} failed before any step was traced: rank " in lines[0]
    assert "ValueError: train_batch_size is not micro_batch x accumulation x world size" in lines[0]


@pytest.mark.breadth  # FSDP2 scripts under `ddpscope run`: tests/tracer/capture/sharded/
def test_an_fsdp2_script_is_traced_and_still_runs(tmp_path):
    proc, out, _ = trace_script(tmp_path, str(WORKERS / "fsdp_train.py"))
    assert proc.returncode == 0, proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["kind"] == "sharded" and run["status"] == "complete" and run["sharding"]["stage"] == 3
    assert (tmp_path / "run-report" / "check-rank1.json").exists()  # it trained to its end


@pytest.mark.breadth
def test_ddp_under_the_python_reducer_is_said_to_be_untraced(tmp_path):
    proc, out, report = trace_script(tmp_path, USER, "--python-reducer", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "compiled autograd's Python reducer" in proc.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "untraced"
    assert checks(report)[1]["params_sha256"]


def test_ranks_a_script_spawns_itself_are_traced(tmp_path):
    """``ddpscope run --nproc 1`` of a script that spawns its own 2 ranks
    (``torch.multiprocessing.spawn``), twice, one job after the other, as PyTorch's ZeRO
    recipe does: the capture reaches them through the environment, they host their own
    store (under torchrun alone they would wait for torchrun's), the first job is traced
    and the second, finding its trace, is not and says so: nothing is overwritten."""
    out = tmp_path / "spawned"
    proc = run_cli("run", "--nproc", "1", "--out", str(out), "--", str(WORKERS / "spawn_train.py"), "--steps", "4",
                   "--jobs", "2")
    assert proc.returncode == 0, proc.stderr
    assert "already holds rank 0's trace of an earlier job" in proc.stderr
    assert "on 1 rank, " in proc.stderr or "on 1 rank\n" in proc.stderr
    assert "the job had 2 ranks: the script started them itself from the 1 launched" in proc.stderr
    assert any("earlier job" in n for n in json.loads((out / "run.json").read_text())["notes"])
    trace = load_run(out)
    assert trace.world_size == 2 and trace.steps.groupby("rank").size().to_dict() == {0: 4, 1: 4}
    assert trace.run["bucket_cap_bytes"] == int(0.1 * 2**20)
    assert sorted(i for b in trace.run["bucket_layout"] for i in b) == [0, 1, 2, 3]


def test_a_second_ddp_model_without_an_optimizer_is_traced_in_its_own_folder(tmp_path):
    proc, out, report = trace_script(tmp_path, USER, "--two-models", "--steps", "3")
    assert proc.returncode == 0, proc.stderr
    assert "DDP model 1 (Sequential) is traced too, into models/1-Sequential" in proc.stderr
    trace = load_run(out)
    assert any("DDP model 1 (Sequential) is traced too" in n for n in trace.run["notes"])
    assert trace.run["model_params"] == 8 * (384 * 384 + 384) + 384 * 8 + 8  # the first model's
    second = load_run(out / "models" / "1-Sequential")
    assert second.run["model_params"] == 2 * (64 * 64 + 64) + 64 * 8 + 8 and second.status == "complete"
    assert second.steps.groupby("rank").size().min() >= 2  # a forward after a syncing backward: a step
    assert checks(report)[1]["params_sha256"]


@pytest.mark.failures
def test_tracing_that_cannot_start_leaves_training_running(tmp_path):
    """One rank cannot start its tracer: no rank traces (a half-traced job would wait on
    the silent rank), the reason is said once, and the script trains to its end."""
    proc, out, report = trace_script(tmp_path, USER, "--steps", "3", env={"DDPSCOPE_TEST_TRACER_FAIL": "1"})
    assert proc.returncode == 0, proc.stderr
    assert checks(report)[0]["params_sha256"] == checks(report)[1]["params_sha256"]
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "untraced"
    assert any("tracing could not start" in n and "rank 1" in n for n in run["notes"])


def test_a_failing_script_names_the_rank_and_keeps_the_finished_steps(tmp_path):
    proc, out, _ = trace_script(tmp_path, USER, "--steps", "8", "--fail-rank", "1", "--fail-step", "3")
    assert proc.returncode == 1
    assert "run failed: rank 1 failed: RuntimeError: user script failed on rank 1 at step 3" in proc.stderr
    assert "--- rank 1 stderr" in proc.stderr and 'user_train.py", line' in proc.stderr  # the user's traceback
    trace = load_run(out)
    assert trace.run["status"] == "failed"
    done = trace.steps[(trace.steps["rank"] == 1) & ~trace.steps.incomplete]
    assert set(done.step) == {0, 1, 2}
    assert processes_mentioning(str(out)) == []


@pytest.mark.failures
def test_a_rank_that_aborts_at_exit_after_training_keeps_a_complete_trace(tmp_path):
    """Rank 1 aborts after its training and ``destroy_process_group`` (as torch's gloo does
    now and then at interpreter exit, ZeRO-3 under DeepSpeed among them): ddpscope says the
    failure came at exit after training finished, keeps the trace as complete, and exits 1
    as the job did; never "partial trace kept"."""
    proc, out, report = trace_script(tmp_path, USER, "--steps", "3", "--abort-at-exit", "1")
    assert proc.returncode == 1
    said = [line for line in proc.stderr.splitlines() if "after training finished" in line]
    assert len(said) == 1 and "rank 1" in said[0] and "SIGABRT at exit" in said[0] and str(out) in said[0]
    assert "partial trace kept" not in proc.stderr and "run failed" not in proc.stderr
    trace = load_run(out)
    assert trace.status == "complete" and trace.run["exit_failure"].startswith("rank 1")
    assert set(trace.steps.groupby("rank").size()) == {3}
    assert checks(report)[1]["params_sha256"]  # the script reached its own end before the abort


@pytest.mark.failures
def test_ranks_that_each_fail_on_their_own_are_named_as_such(tmp_path):
    """Every rank raises its own exception in the user's code: the first is the root cause,
    the other failed on its own (its own error, not a lost peer), never its consequence."""
    proc, out, _ = trace_script(tmp_path, USER, "--steps", "8", "--fail-rank", "-2", "--fail-step", "3")
    assert proc.returncode == 1
    line = next(l for l in proc.stderr.splitlines() if "run failed" in l)
    root = int(line.split("run failed: rank ")[1].split()[0])
    other = 1 - root
    assert f"rank {root} failed: RuntimeError: user script failed on rank {root} at step 3" in line
    assert f"; rank {other} also failed on its own" in line
    said = f"also failed on its own: rank {other}: RuntimeError: user script failed on rank {other} at step 3"
    assert said in proc.stderr and "consequence:" not in proc.stderr
    failure = json.loads((out / "run.json").read_text())["failure"]
    assert failure["consequences"] == [] and len(failure["independent"]) == 1 and failure["rank"] == root


@pytest.mark.parametrize("script, message", [
    (["missing.py"], "script missing.py does not exist (in /)"),
    (["-m", "no_such_package.train"], "-m no_such_package.train: no such module"),
    (["-m"], "-m needs a module name"),
    ([], "nothing to run: give the training script after --"),
])
def test_bad_scripts_exit_2_with_one_line_and_write_nothing(tmp_path, script, message):
    out = tmp_path / "never"
    proc = run_cli("run", "--out", str(out), "--", *script, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not out.exists()


def test_an_older_ddp_without_bucket_cap_mb_list_takes_the_largest_as_its_cap(tmp_path, monkeypatch):
    """A stand-in (a mock: no older torch is installed here) for DDP's constructor before
    PyTorch 2.13, which has no ``bucket_cap_mb_list``: the list runs as bucket_cap_mb =
    its largest, said once."""
    import types

    from ddpscope.tracer.capture.autotrace import patches
    from ddpscope.tracer.capture.autotrace.config import CaptureConfig
    from ddpscope.tracer.capture.autotrace.session import Session

    monkeypatch.setattr(patches, "_patch_destroy", lambda session: None)  # torch's own stays as it is
    seen = []

    class OldDDP:
        def __init__(self, module, device_ids=None, bucket_cap_mb=None):
            seen.append(bucket_cap_mb)

    session = Session(CaptureConfig(out=str(tmp_path), bucket_cap_mb_list="1,4,2"))
    monkeypatch.setattr(session, "on_ddp_built", lambda *args: None)
    patches._patch_ddp(session, types.SimpleNamespace(DistributedDataParallel=OldDDP))
    OldDDP(object(), bucket_cap_mb=8)
    assert seen == [4.0]
    assert [n for n in session.notes if "takes no bucket_cap_mb_list" in n] == [
        "this PyTorch's DDP takes no bucket_cap_mb_list: --bucket-cap-mb-list runs as bucket_cap_mb 4 MiB (its "
        "largest), one cap for every bucket"]
