"""Where a recommended bucket setting goes in the user's code (``viz.whatif.where_to_set``),
for each framework that builds DDP; run.json's ``ddp_built_by`` as the tracer writes it (the
real runs of tests/tracer/capture/autotrace/test_autotrace.py check that it does)."""

from __future__ import annotations

import json
import shutil

import pandas as pd
import pytest

from ddpscope.viz.trace import load_run
from ddpscope.viz.whatif.advisor import advise
from ddpscope.viz.whatif.where_to_set import bucket_elements_in_code, flag_in_code, reshard_in_code, where_to_set
from tests.conftest import SAMPLES, run_cli


def _built(framework: str) -> dict:
    return {"ddp_built_by": {"framework": framework, "module": "__main__", "file": "/home/u/proj/train.py",
                             "line": 57, "function": "main"}}


CANDIDATES = pd.DataFrame({"kind": ["growing list", "uniform", "uniform"], "setting": [(1.0, 4.0), 4.0, 2.0],
                           "step_ms": [100.0, 103.25, 101.5]})


@pytest.mark.parametrize("framework, cap, said", [
    ("script", 4.0, "DistributedDataParallel(..., bucket_cap_mb=4) at train.py:57"),
    ("script", (1.0, 4.0, 25.0), "DistributedDataParallel(..., bucket_cap_mb_list=[1, 4, 25]) at train.py:57"),
    ("transformers", 4.0, "TrainingArguments(ddp_bucket_cap_mb=4), or --ddp_bucket_cap_mb 4 on the command line"),
    ("transformers", 0.5, "TrainingArguments(ddp_bucket_cap_mb=0.5) (from Python: the command line's "
                          "--ddp_bucket_cap_mb takes whole MiB only)"),
    ("accelerate", 2.0, "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=2)])"),
    ("lightning", (1.0, 4.0), "Trainer(strategy=DDPStrategy(bucket_cap_mb_list=[1, 4])) (Lightning passes it to DDP)"),
    ("fabric", 8.0, "Fabric(strategy=DDPStrategy(bucket_cap_mb=8)) (Fabric passes it to DDP)"),
    ("lightning", None, "leave bucket_cap_mb out of DDPStrategy(...) (DDP's default)"),
])
def test_each_framework_is_told_its_own_way_to_set_it(framework, cap, said):
    assert where_to_set(_built(framework), cap) == f"in your code: {said}"


@pytest.mark.parametrize("framework", ["transformers", "accelerate"])
def test_a_list_where_the_framework_takes_one_cap_names_the_fastest_single_cap(framework):
    text = where_to_set(_built(framework), (1.0, 4.0), CANDIDATES)
    assert "passes one bucket_cap_mb to DDP and no bucket_cap_mb_list" in text
    assert "`ddpscope run --bucket-cap-mb-list 1,4`" in text
    assert text.endswith("the fastest single cap searched is bucket_cap_mb=2 (101.5 ms a step)")


def test_nothing_is_said_without_who_built_it_or_for_the_demo():
    assert where_to_set({}, 4.0) is None  # traced before run.json said, or by DDPTracer from Python
    assert where_to_set({**_built("script"), "demo": "gpt"}, 4.0) is None
    assert where_to_set({"ddp_built_by": {"framework": ["x"]}}, 4.0) is None  # hand-edited: not a name
    assert where_to_set({"ddp_built_by": "script"}, 4.0) is None


def test_the_advisors_change_carries_it_to_whatif_json_and_text(tmp_path):
    """The sample's advisor recommends a list (a change): traced as a Lightning run would be,
    the recommendation says DDPStrategy's list; as a Trainer's, the fastest single cap of the
    same search, in ``--json`` and in the text under ``recommended:``."""
    for framework in ("lightning", "transformers"):
        run_dir = tmp_path / framework
        shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", run_dir)
        meta = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**meta, **_built(framework)}))
        a = advise(load_run(run_dir))
        assert a.change and a.as_json()["in_code"] == a.in_code
        best = a.candidates[a.candidates["kind"] == "uniform"].sort_values("step_ms").iloc[0]
        if framework == "lightning":
            assert a.in_code == where_to_set(meta | _built(framework), a.setting)
            assert "DDPStrategy(bucket_cap_mb_list=[" in a.in_code
        else:
            assert a.in_code.endswith(f"bucket_cap_mb={best['setting']:g} ({best['step_ms']:.1f} ms a step)")
        proc = run_cli("whatif", str(run_dir))
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        at = next(i for i, t in enumerate(lines) if t.startswith("recommended: "))
        assert lines[at + 1] == f"  {a.in_code}"


@pytest.mark.parametrize("framework, said", [
    ("script", "DistributedDataParallel(..., find_unused_parameters=False) at train.py:57"),
    ("transformers", "TrainingArguments(ddp_find_unused_parameters=False), or --ddp_find_unused_parameters false "
                     "on the command line"),
    ("accelerate", "Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=False)])"),
    ("lightning", "Trainer(strategy=DDPStrategy(find_unused_parameters=False)) (Lightning passes it to DDP)"),
])
def test_turning_find_unused_parameters_off_is_said_each_frameworks_way(framework, said):
    assert flag_in_code(_built(framework), "find_unused_parameters", False) == f"in your code: {said}"
    assert flag_in_code({}, "find_unused_parameters", False) is None


@pytest.mark.parametrize("framework, said", [
    ("script", "fully_shard(module, reshard_after_forward=True|False|N) for each unit"),
    ("torchtitan", "torchtitan's --parallelism.fsdp_reshard_after_forward always (true) or never (false)"),
    ("transformers", 'TrainingArguments(fsdp_config={"reshard_after_forward": true|false})'),
    ("accelerate", "FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True|False)"),
])
def test_fsdp2s_reshard_after_forward_is_said_each_frameworks_way(framework, said):
    assert reshard_in_code({"fsdp_trained_by": {"framework": framework}}).startswith(f"in your code: {said}")
    assert reshard_in_code({}) is None and reshard_in_code({"fsdp_trained_by": {"framework": 3}}) is None


def test_a_deepspeed_bucket_size_is_said_in_the_configs_elements():
    """As a rerun's --bucket-cap-mb converts (config_override.edited): bf16 gradients, 2 bytes."""
    from ddpscope.tracer.capture.deepspeed.config_override import Override, edited

    run = {"deepspeed": {"reduce_bucket_size": 500_000, "reduce_bucket_bytes": 1_000_000,
                         "communication_dtype": "bfloat16"}}
    said = bucket_elements_in_code(run, 1.5)
    config, _ = edited({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, Override(bucket_cap_mb=1.5))
    assert said == (f"in your code: the DeepSpeed config's zero_optimization.reduce_bucket_size = "
                    f"{config['zero_optimization']['reduce_bucket_size']} (1.5 MiB in elements of bfloat16)")
    assert config["zero_optimization"]["reduce_bucket_size"] == 786_432
    assert bucket_elements_in_code({"deepspeed": {"reduce_bucket_size": 0}}, 1.0) is None
    assert bucket_elements_in_code({}, 1.0) is None
