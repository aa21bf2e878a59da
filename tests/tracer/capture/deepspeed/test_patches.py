"""DeepSpeed's ``initialize`` patched under ``ddpscope run`` (tracer/capture/deepspeed/patches.py):
``--bucket-cap-mb`` applied as ``reduce_bucket_size`` in elements of the communication
dtype, whatever form the config comes in, and ``--steps`` holding. Real 2-rank DeepSpeed
jobs (CPU accelerator, gloo); DeepSpeed builds a small C++ op on its first run (~100 s),
so they are their own marked suite."""

from __future__ import annotations

import json

import pytest

from ddpscope.tracer import format as fmt
from tests.conftest import ROOT
from tests.tracer.capture.autotrace.test_autotrace import checks, trace_script

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.deepspeed]
WORKER = str(ROOT / "tests" / "workers" / "deepspeed_train.py")


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
    assert run["sharding"]["framework"] == "deepspeed" and run["deepspeed"]["gradient_accumulation_steps"] == 2
    from ddpscope.viz.trace import load_run

    steps = load_run(out).steps  # both traced steps, each of its two micro-batches
    assert sorted(set(steps["step"])) == [0, 1] and steps["micro_batches"].eq(2).all()
