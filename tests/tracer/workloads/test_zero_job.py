"""``ddpscope zero`` end to end: real DDP, ZeroRedundancyOptimizer and FSDP runs,
what each rank holds and sends, against the ZeRO paper's model; failures, bad input."""

from __future__ import annotations

import json

import pytest

from ddpscope.viz.zero.trace import compute_zero_comparison, load_zero
from tests.chrome_trace import check_chrome_trace
from tests.conftest import assert_refused, processes_mentioning, run_cli

pytestmark = pytest.mark.ddp


def test_zero_run_measures_every_stage_on_every_rank(zero_run):
    out, proc = zero_run
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert "stage 3 (FSDP, full sharding)" in proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and run["kind"] == "zero" and run["world_size"] == 2
    # where it came from: the command that reproduces it, and when
    assert run["command"] == f"ddpscope zero --nproc 2 --model mlp --steps 3 --stages 0,1,2,3 --timeout 600 --out {out}"
    assert run["started_at"].startswith("20") and run["started_at"].endswith("+00:00")
    for r in (0, 1):
        assert check_chrome_trace(json.loads((out / f"rank-{r}.json").read_text())) == []
    trace = load_zero(out)
    assert sorted(trace.stages.groupby("rank")["stage"].apply(list).tolist()) == [[0, 1, 2, 3]] * 2
    assert trace.params == 4_203_520  # the demo MLP


def test_measured_model_states_agree_with_the_zero_model(zero_run):
    """Within 5 % (in fact to a few hundred bytes: Adam's step counters), each stage and rank."""
    cmp = compute_zero_comparison(load_zero(zero_run[0]))
    assert ((cmp["measured/predicted"] - 1).abs() < 0.05).all(), cmp.to_string()
    s = cmp[cmp["rank"] == 0].set_index("stage")
    P = 4_203_520
    assert s.loc[0, "params_bytes"] == s.loc[1, "params_bytes"] == 4 * P  # replicated
    assert s.loc[2, "params_bytes"] == 4 * P + 2 * P  # FSDP stage 2: unsharded copy + its shard
    assert s.loc[3, "params_bytes"] == 2 * P  # sharded over 2 ranks
    assert s.loc[0, "grads_bytes"] == s.loc[1, "grads_bytes"] == 4 * P
    assert s.loc[2, "grads_bytes"] == s.loc[3, "grads_bytes"] == 2 * P
    assert s.loc[0, "optimizer_state_bytes"] - 8 * P < 1000  # exp_avg + exp_avg_sq (+ step scalars)
    assert s.loc[1, "optimizer_state_bytes"] + cmp.set_index(["rank", "stage"]).loc[(1, 1), "optimizer_state_bytes"] \
        == s.loc[0, "optimizer_state_bytes"]  # ZeRO-1: the two ranks' shards add up to the whole
    assert (cmp["peak_bytes"] >= cmp["model_state_bytes"] - 4 * P).all()  # grads are freed between steps


def test_communication_counted_from_the_run(zero_run):
    comm = load_zero(zero_run[0]).comm
    c = comm[comm["rank"] == 0].set_index(["stage", "collective"])
    P = 4_203_520
    assert c.loc[(0, "all_reduce"), "message_bytes"] == 4 * P  # DDP: every gradient once
    assert c.loc[(1, "all_reduce"), "message_bytes"] == 4 * P  # torch's ZeRO-1: all-reduce ...
    assert c.loc[(1, "broadcast"), "message_bytes"] == 4 * P  # ... then every parameter broadcast
    assert c.loc[(2, "all_gather"), "message_bytes"] == 4 * P  # parameters gathered once (kept for backward)
    assert c.loc[(3, "all_gather"), "message_bytes"] == 2 * 4 * P  # gathered again for backward: the 3rd P
    # gloo runs FSDP's reduce-scatter as an all-reduce of the whole gradient
    assert c.loc[(2, "all_reduce"), "message_bytes"] == c.loc[(3, "all_reduce"), "message_bytes"] == 4 * P
    assert set(c.loc[3].index) == {"all_gather", "all_reduce"}


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1"], "--nproc must be in 2..64"),
    (["--model", "resnet"], "--model must be one of mlp, gpt"),
    (["--steps", "1"], "--steps must be in 2..100"),
    (["--stages", "4"], "--stages must list distinct stages from 0,1,2,3"),
    (["--stages", "0,0"], "--stages must list distinct stages"),
    (["--stages", ""], "--stages must list distinct stages"),
    (["--timeout", "-5"], "--timeout must be > 0"),
    (["--nproc", "two"], "invalid int value"),
])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(tmp_path, args, message):
    assert_refused("zero", args, message, tmp_path / "never")


@pytest.mark.failures
def test_failing_rank_keeps_the_finished_stages(tmp_path):
    out = tmp_path / "fails"
    proc = run_cli("zero", "--nproc", "2", "--stages", "0,3,1", "--out", str(out), env={"DDPSCOPE_TEST_FAIL": "1:1"})
    assert proc.returncode == 1
    assert "rank 1 failed: RuntimeError: injected failure on rank 1 at stage 1" in proc.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    trace = load_zero(out)
    assert sorted(trace.stages[trace.stages["rank"] == 1]["stage"]) == [0, 3]
    assert processes_mentioning(str(out)) == []
