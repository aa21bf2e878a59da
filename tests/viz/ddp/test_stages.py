"""The ZeRO model beside a DDP run: K (optimizer bytes per parameter) from the optimizer's
name in run.json, or read off the measurement when ddpscope does not know it."""

import dataclasses

from ddpscope.viz.ddp.stages import compute_ddp_stage_comparison, ddp_stage_differences, optimizer_k
from ddpscope.viz.trace import load_run


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
