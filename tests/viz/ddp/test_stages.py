"""The ZeRO model beside a DDP run: K (optimizer bytes per parameter) from the optimizer's
name in run.json, or read off the measurement when ddpscope does not know it; parameters
that do not train held, without gradients or optimizer state."""

import dataclasses

import pytest

from ddpscope.viz.ddp.stages import compute_ddp_stage_comparison, ddp_comm_lines, ddp_stage_differences, optimizer_k
from ddpscope.viz.trace import load_run
from tests.tracer.capture.autotrace.test_autotrace import USER, checks, trace_script, untraced


def test_k_comes_from_the_named_optimizer_else_from_what_the_ranks_hold(mlp_run):
    trace = load_run(mlp_run[0])  # the demo's AdamW, named in its run.json
    assert optimizer_k(trace) == (8.0, "AdamW: 2 fp32 value(s) per parameter")
    named = compute_ddp_stage_comparison(trace)
    measured = named[named["rank"].notna()]
    # AdamW's two fp32 moments are what the ranks hold: the model's stage 0 within 1 %
    assert ((measured["measured/predicted"] - 1).abs() < 0.01).all(), measured
    unknown = dataclasses.replace(trace, run={**trace.run, "sharding": {**trace.run["sharding"], "optimizer": "Lion"}})
    k, why = optimizer_k(unknown)
    assert k is None and why == "Lion: K unknown to ddpscope, read off the measurement"
    assert ddp_stage_differences(unknown)[0] == f"K (optimizer bytes per parameter): {why}."
    read = compute_ddp_stage_comparison(unknown)
    stage0 = read.loc[read["row"] == "stage 0", "optimizer_state_bytes"].iloc[0]
    # K read off the measurement: the model's optimizer state is the ranks' own
    assert abs(stage0 / measured["optimizer_state_bytes"].median() - 1) < 1e-9


@pytest.mark.ddp
def test_frozen_parameters_are_held_without_gradients_or_state_and_training_is_unchanged(tmp_path):
    """A partial fine-tune (the first 3 of 5 layers ``requires_grad=False`` and in bfloat16,
    the rest fp32 under CPU autocast, as PEFT keeps fp32 adapters beside a bf16 base model):
    the run holds every parameter, but only those that train have gradients, DDP buckets
    and optimizer state. Measured against the script's own counts (its parameters, its
    gradients before ``zero_grad``, its SGD momentum buffers), set beside the ZeRO model
    with P held (each in its own dtype) and P_t trained, and bit-identical to the run
    untraced."""
    script = (USER, "--freeze", "3", "--frozen-bf16", "--width", "128", "--depth", "4", "--steps", "4")
    proc, out, report = trace_script(tmp_path, *script)
    assert proc.returncode == 0, proc.stderr
    ours, theirs = checks(report), checks(untraced(tmp_path, *script))
    assert all(ours[r]["params_sha256"] == theirs[r]["params_sha256"] for r in (0, 1))
    trace = load_run(out)
    own = ours[0]
    frozen, trained = own["frozen_numel"], trace.run["model_params"]
    assert trace.run["frozen_params"] == frozen == 3 * (128 * 128 + 128)
    assert frozen * 2 + trained * 4 == own["param_bytes"]  # bf16 frozen, fp32 trained
    table = compute_ddp_stage_comparison(trace)
    measured = table[table["rank"].notna()]
    assert (measured["params_bytes"] == own["param_bytes"]).all()  # the frozen ones held too
    assert (measured["grads_bytes"] == own["grad_bytes"]).all() and own["grad_bytes"] == 4 * trained
    assert (measured["optimizer_state_bytes"] == own["optimizer_state_bytes"]).all()  # momentum: trained only
    assert ((measured["measured/predicted"] - 1).abs() < 1e-3).all(), measured
    stage = table.set_index("row")
    assert stage.loc["stage 3", "params_bytes"] == own["param_bytes"] / 2  # every parameter sharded
    assert stage.loc["stage 2", "grads_bytes"] == 4 * trained / 2 and stage.loc["stage 1", "grads_bytes"] == 4 * trained
    assert stage.loc["stage 1", "optimizer_state_bytes"] == 4 * trained / 2  # SGD momentum: K = 4
    assert any(line.startswith(f"{frozen:,} of the {frozen + trained:,} parameters are frozen")
               for line in ddp_stage_differences(trace))
    assert ddp_comm_lines(trace)[0].startswith(f"D = {4 * trained / 2**20:.3f} MiB of parameters that train")
