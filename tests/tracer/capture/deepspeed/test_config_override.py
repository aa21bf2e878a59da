"""A rerun's settings on the config a script hands ``deepspeed.initialize``
(tracer/capture/deepspeed/config_override.py): MiB into elements of the communication
dtype as DeepSpeed resolves it, the stage, every place the config may come from, the
script's own objects untouched. Pure functions: the real engine's reading of the result
is checked in test_patches.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch import nn

from ddpscope.tracer.capture.deepspeed.config_override import Override, apply, comm_dtype, edited


def _load(config):
    if isinstance(config, dict):
        return config
    with open(config) as f:
        return json.load(f)


@pytest.mark.parametrize("config, dtype", [({}, "float32"), ({"bf16": {"enabled": True}}, "bfloat16"),
                                           ({"fp16": {"enabled": True}}, "float16"),
                                           ({"bf16": {"enabled": False}}, "float32"),
                                           ({"bf16": {"enabled": True}, "communication_data_type": "fp32"}, "fp32")])
def test_the_communication_dtype_is_deepspeeds(config, dtype):
    assert comm_dtype(config) == dtype


def test_mib_become_elements_and_the_stage_changes_with_a_note_each():
    script = {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}, "bf16": {"enabled": True}}
    o = Override(bucket_cap_mb=2, zero_stage=2)
    out, notes = edited(script, o)
    assert out["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 2 * 2**20 // 2}
    assert script["zero_optimization"]["reduce_bucket_size"] == 5e8  # a copy
    assert notes == ["ZeRO stage 1 in the script's config is replaced by --zero-stage 2",
                       "the script's reduce_bucket_size 500000000.0 is replaced by --bucket-cap-mb 2 "
                       "(1048576 elements of bfloat16)"]


def test_a_model_built_partitioned_for_zero3_keeps_its_stage():
    model = nn.Linear(2, 2)
    model.weight.ds_id = 0  # what deepspeed.zero.Init leaves on a parameter
    o = Override(zero_stage=1)
    out, notes = edited({"zero_optimization": {"stage": 3}}, o, model)
    assert out["zero_optimization"]["stage"] == 3 and "not applied" in notes[0]


def test_each_place_a_config_comes_from(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    for key in ("config", "config_params"):
        arguments = {key: str(path)}
        restore, notes = apply(arguments, Override(bucket_cap_mb=1), _load)
        restore()
        assert "262144 elements of float32" in notes[0]
        assert arguments[key]["zero_optimization"]["reduce_bucket_size"] == 2**18
    args = SimpleNamespace(deepspeed_config=str(path))
    arguments = {"args": args}
    restore, _ = apply(arguments, Override(bucket_cap_mb=1), _load)
    assert args.deepspeed_config["zero_optimization"]["reduce_bucket_size"] == 2**18  # what DeepSpeed reads
    restore()
    assert args.deepspeed_config == str(path)  # the script's object, as it was
    assert json.loads(path.read_text()) == {"zero_optimization": {"stage": 2}}
    nothing = {"config": None}
    restore, notes = apply(nothing, Override(), _load)
    restore()
    assert nothing == {"config": None} and notes == []


@pytest.mark.parametrize("kw, flag", [({"bucket_cap_mb": 0}, "--bucket-cap-mb"), ({"zero_stage": 4}, "--zero-stage")])
def test_a_bad_setting_names_its_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        Override(**kw)
