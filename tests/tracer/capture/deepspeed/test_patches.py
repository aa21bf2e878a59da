"""DeepSpeed's engine recognised under ``ddpscope run`` (tracer/capture/deepspeed/):
stages 1-3 named once, their settings in run.json as the engine itself reports them,
``--bucket-cap-mb`` applied as ``reduce_bucket_size`` in elements of the communication
dtype, ``--steps`` holding, training bit-identical, and ``summary`` saying in one line why
nothing was traced. Real 2-rank DeepSpeed jobs (CPU accelerator, gloo); DeepSpeed builds
a small C++ op on its first run (~100 s), so they are their own marked suite."""

from __future__ import annotations

import json

import pytest

from ddpscope.tracer import format as fmt
from tests.conftest import ROOT, run_cli
from tests.tracer.capture.autotrace.test_autotrace import checks, trace_script, untraced

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.deepspeed]
WORKER = str(ROOT / "tests" / "workers" / "deepspeed_train.py")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_is_named_kept_in_run_json_and_trains_bit_identically(tmp_path, stage):
    script = (WORKER, "--stage", str(stage), "--steps", "3")
    proc, out, report = trace_script(tmp_path, *script, env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr
    run = json.loads((out / fmt.RUN_FILE).read_text())
    own = checks(report)
    assert run["kind"] == fmt.KIND_DEEPSPEED and run["status"] == fmt.UNTRACED
    ds = run["deepspeed"]
    assert ds["zero_stage"] == own[0]["stage"] == stage and ds["reduce_bucket_size"] == own[0]["reduce_bucket_size"]
    assert ds["dtype"] == "float32" and ds["reduce_bucket_bytes"] == 4 * ds["reduce_bucket_size"]
    said = [line for line in proc.stderr.splitlines() if f"DeepSpeed ZeRO stage {stage}" in line]
    assert len(said) == 2 and "nothing was traced" not in proc.stderr  # once as it happened, once at the end
    summary = run_cli("summary", str(out))
    assert summary.returncode == 2 and len(summary.stderr.strip().splitlines()) == 1
    assert "was run but not traced" in summary.stderr and f"DeepSpeed ZeRO stage {stage}" in summary.stderr
    if stage == 3:
        plain = untraced(tmp_path, *script)
        for r in (0, 1):
            assert own[r]["params_sha256"] == checks(plain)[r]["params_sha256"]
            assert own[r]["losses"] == checks(plain)[r]["losses"]


@pytest.mark.parametrize("form", ["dict", "file"])
def test_bucket_cap_mb_becomes_reduce_bucket_size_in_elements(tmp_path, form):
    """1 MiB of float32 is 262,144 elements, of bfloat16 524,288: the engine reports the
    new size; the script's own config (its file) is untouched."""
    extra = ("--config-file",) if form == "file" else ()
    bf16 = ("--bf16",) if form == "file" else ()
    proc, out, report = trace_script(tmp_path, WORKER, "--stage", "2", "--steps", "2", *extra, *bf16,
                                     ddpscope=("--bucket-cap-mb", "1"), env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr
    want = 2**20 // (2 if bf16 else 4)
    assert checks(report)[0]["reduce_bucket_size"] == want
    assert f"replaced by --bucket-cap-mb 1 ({want} elements of {'bfloat16' if bf16 else 'float32'})" in proc.stderr
    if form == "file":
        assert json.loads((report / "ds-config-0.json").read_text())["zero_optimization"]["reduce_bucket_size"] \
            == 50_000


def test_steps_holds_for_a_deepspeed_engine(tmp_path):
    """``--steps 2`` on a script of 6 steps of 2 micro-batches: two optimizer steps (each
    at an accumulation boundary), then the job ends cleanly."""
    proc, out, report = trace_script(tmp_path, WORKER, "--stage", "1", "--steps", "6", "--accumulate", "2",
                                     ddpscope=("--steps", "2"), env={"DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr
    printed = "".join(p.read_text() for p in (out / "logs").rglob("stdout.log") if p.parent.name == "0")
    assert "step 1 loss" in printed and "step 2 loss" not in printed  # the limit ends it inside step 2's engine.step
    assert not (report / "check-rank0.json").exists()  # the script never reached its end
    run = json.loads((out / fmt.RUN_FILE).read_text())
    assert run["kind"] == fmt.KIND_DEEPSPEED and run["deepspeed"]["gradient_accumulation_steps"] == 2
