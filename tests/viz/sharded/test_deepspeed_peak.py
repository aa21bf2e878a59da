"""A DeepSpeed run at another reduce_bucket_size: its peak (viz/sharded/predict.py,
``predict_deepspeed_peak``) and its buckets (viz/sharded/deepspeed_buckets.py), against the
rerun at that size: real 2-rank DeepSpeed jobs (CPU accelerator, gloo), the rerun made as
the Run page makes it (``ddpscope run --bucket-cap-mb``)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pandas as pd
import pytest

from ddpscope.viz.sharded.deepspeed_buckets import (
    bucket_cost,
    bucket_elements,
    in_situ_latency,
    predict_deepspeed_step_ms,
    recut,
    reductions,
)
from ddpscope.viz.sharded.metrics import (
    compute_memory_over_step,
    compute_sharded_run_comparison,
    compute_sharded_steps,
)
from ddpscope.viz.sharded.predict import predict_deepspeed_peak
from ddpscope.viz.sharded.trace import real_steps
from ddpscope.viz.trace import TraceError, load_run
from tests.conftest import ROOT, run_cli
from tests.tracer.capture.autotrace.test_autotrace import trace_script

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.deepspeed]
WORKER = str(ROOT / "tests" / "workers" / "deepspeed_train.py")
ENV = {"DS_ACCELERATOR": "cpu"}
RERUN_MIB = 280_000 / 2**20  # 70,000 fp32 elements: the worker's layers cut where neither 20,000 nor 1 MiB cuts
MODEL_NUMEL = 64 * 256 + 256 + 256 * 256 + 256 + 256 * 8 + 8  # the worker's MLP


def layouts(trace) -> dict:
    """(rank, step, micro) -> the elements of each bucket reduced there, in order."""
    table = reductions(trace)
    return {k: [int(e) for e in g["elements"]] for k, g in table.groupby(["rank", "step", "micro"])}


def assert_each_step_moves_by_its_buckets(traced, own: pd.DataFrame, steps: pd.DataFrame) -> None:
    """Each step's prediction at RERUN_MIB is the step as run moved by its new buckets' cost
    less its own on the one cost line (``bucket_cost``): recomputed here from ``recut``, on
    a line that is not bandwidth alone (a calibration is present), so a prediction that
    ignored the buckets (the run's own step) fails."""
    order = {k: [n for t in g["numels"] for n in t] for k, g in own.groupby(["rank", "step", "micro"])}
    cost, step_ms = bucket_cost(traced), compute_sharded_steps(traced).set_index(["rank", "step"])["step_ms"]
    assert cost.latency_us > 0 or len(cost.points) >= 2, cost  # else fewer buckets cost the same
    for rank in (0, 1):
        mine = own[own["rank"] == rank]
        per_element = mine["bytes"].sum() / mine["elements"].sum()
        assert per_element == pytest.approx(4.0, rel=0.01)  # fp32 messages, whole buckets
        moved = {}
        for step, g in mine.groupby("step"):
            new = [recut(order[(rank, step, micro)], 70_000) for micro in g["micro"].unique()]
            moved[step] = (sum(cost.time_us(per_element * pd.Series(n, dtype=float)).sum() for n in new)
                           - cost.time_us(per_element * g["elements"]).sum()) / 1e3
        expected = pd.Series({s: step_ms[(rank, s)] + m for s, m in moved.items()}).median()
        assert steps.loc[rank, "predicted_step_ms"] == pytest.approx(expected, rel=1e-9)
        assert any(m != 0 for m in moved.values()), moved


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_peak_and_buckets_at_another_reduce_bucket_size_are_the_reruns(tmp_path, stage):
    """Traced at 20,000 elements, predicted at 70,000, rerun there: the rerun's peak per rank
    is the prediction, to the byte, and so is every bucket it reduced (elements, in order, in
    every step and rank). ZeRO-3 allocates its bucket whole, so its peak grows by the
    bucket's growth; these stage-1 and 2 runs hold no bucket buffer when memory is sampled,
    so their peak stays. Stage 1 (no overlap_comm) takes the gradients in parameter order
    once the backward ends, stages 2-3 as they become ready: the trace's lists have both."""
    script = (WORKER, "--stage", str(stage), "--steps", "5", "--reduce-bucket-size", "20000")
    proc, out, _ = trace_script(tmp_path, *script, name="traced", env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, again, _ = trace_script(tmp_path, *script, ddpscope=("--bucket-cap-mb", repr(RERUN_MIB)), name="rerun",
                                  env=ENV)
    assert proc.returncode == 0, proc.stderr[-2000:]
    traced, rerun = load_run(out), load_run(again)
    assert traced.run["deepspeed"]["reduce_bucket_bytes"] == 4 * 20_000
    assert rerun.run["deepspeed"]["reduce_bucket_bytes"] == 280_000  # as DeepSpeed ran it
    assert bucket_elements(traced, RERUN_MIB) == 70_000

    table = predict_deepspeed_peak(traced, 280_000).set_index("rank")
    measured = {r: compute_memory_over_step(rerun, r)["total_bytes"].max() for r in (0, 1)}
    assert table["predicted_peak_bytes"].to_dict() == measured
    grew = table["predicted_peak_bytes"] - table["measured_peak_bytes"]
    assert (grew == (280_000 - 80_000) if stage == 3 else grew == 0).all(), grew

    # the buckets: each one's parameters as the trace lists them, end to end, are the whole model
    # once per micro-batch (the model's own count, the independent instrument) in ready order;
    # cut again at 70,000 they are the rerun's buckets
    own = reductions(traced)
    order = {k: [n for t in g["numels"] for n in t] for k, g in own.groupby(["rank", "step", "micro"])}
    assert order and all(sum(v) == MODEL_NUMEL for v in order.values())
    assert {k: recut(v, 20_000) for k, v in order.items()} == layouts(traced)  # the run's own cut, again
    predicted = {k: recut(v, 70_000) for k, v in order.items()}
    assert predicted == layouts(rerun) and len(next(iter(predicted.values()))) == 2
    assert len(next(iter(layouts(traced).values()))) == 3
    steps = predict_deepspeed_step_ms(traced, RERUN_MIB).set_index("rank")
    assert (steps["measured_buckets"] == 3).all() and (steps["predicted_buckets"] == 2).all()
    assert steps["predicted_step_ms"].notna().all()
    at_own = predict_deepspeed_step_ms(traced, 80_000 / 2**20)  # at its own size the prediction is the run
    assert (at_own["predicted_step_ms"] == at_own["measured_step_ms"]).all()

    # the Compare table set beside the rerun on the page says which size each ran with, and the
    # rerun's peak there is the one predicted (its largest rank's)
    table_ab = compute_sharded_run_comparison({"traced": traced, "rerun": rerun}).set_index("run")
    assert table_ab["reduce_bucket_MiB"].tolist() == [80_000 / 2**20, RERUN_MIB]
    assert table_ab.loc["rerun", "peak_MiB"] * 2**20 == pytest.approx(table["predicted_peak_bytes"].max(), rel=1e-12)
    # `ddpscope whatif --caps` prints it (the page's prediction) beside the run as measured
    said = run_cli("whatif", str(out), "--caps", f"{RERUN_MIB!r},16", "--json")
    assert said.returncode == 0, said.stderr
    body = json.loads(said.stdout)
    sizes = pd.DataFrame(body["bucket_sizes"])
    assert sizes["reduce_bucket_MiB"].drop_duplicates().tolist() == [80_000 / 2**20, RERUN_MIB, 16.0]
    at_rerun = sizes[sizes["reduce_bucket_MiB"] == RERUN_MIB].set_index("rank")
    assert at_rerun["predicted"].all() and at_rerun["peak_bytes"].to_dict() == measured
    assert at_rerun["buckets"].tolist() == [2, 2] and at_rerun["step_ms"].to_dict() == steps["predicted_step_ms"].to_dict()
    # in the config's own unit (elements), what the rerun's DeepSpeed reported it ran with
    assert rerun.run["deepspeed"]["reduce_bucket_size"] == 70_000
    assert (at_rerun["reduce_bucket_size"] == 70_000).all()
    own_row = sizes[~sizes["predicted"]].set_index("rank")
    assert (own_row["reduce_bucket_size"] == traced.run["deepspeed"]["reduce_bucket_size"]).all()
    assert own_row["peak_bytes"].to_dict() == table["measured_peak_bytes"].to_dict()
    assert own_row["buckets"].tolist() == [3, 3] and "bucket reductions" in body["bucket_cost"]
    # at its own size, the prediction is the run
    own_peak = predict_deepspeed_peak(traced, 80_000)
    assert (own_peak["predicted_peak_bytes"] == own_peak["measured_peak_bytes"]).all()

    table_all = reductions(traced)
    one_size = table_all[table_all["bytes"] == table_all["bytes"].max()]
    bare = bucket_cost(traced, one_size, in_situ=False)  # the buckets of one size give no fixed cost a reduction
    assert bare.latency_us == 0 and "calibration" not in bare.source
    # the run's own small all-reduces outside its buckets (ZeRO's gradient norm, every step and rank) give it:
    # their mean time, read here from the raw collectives by who issued them, and the buckets' time beyond it
    # per byte, which at the run's own buckets adds up to the time they held the training thread. Which of
    # the two these tiny buckets took longer is this machine's noise, so the buckets' times are set on either
    # side of it: longer (the line), shorter (no line of that kind: the buckets are not all fixed cost)
    colls = traced.shards.colls
    small = colls[(colls["issued_by"] == "other") & (colls["collective"] == "all_reduce")
                  & (colls["bytes"] <= 64 * 1024) & colls["step"].isin(real_steps(traced))]
    assert len(small) >= 2 * 4, small  # 4 real steps a rank
    fixed_ms = (small["end_us"] - small["start_us"]).mean() / 1e3
    assert in_situ_latency(traced) == (pytest.approx(fixed_ms * 1e3, rel=1e-9), len(small))
    longer = one_size.assign(held_ms=one_size["held_ms"] + fixed_ms)
    anchored = bucket_cost(traced, longer)
    assert anchored.source.startswith("fixed: the mean of the run's own") and not anchored.points
    assert anchored.latency_us == pytest.approx(fixed_ms * 1e3, rel=1e-9)
    assert anchored.time_us(longer["bytes"]).sum() == pytest.approx(longer["held_ms"].sum() * 1e3, rel=1e-9)
    assert bucket_cost(traced, one_size.assign(held_ms=fixed_ms / 2)).source == bare.source
    said = run_cli("whatif", str(out), "--caps", repr(RERUN_MIB))
    before = bucket_cost(traced)  # what whatif used, before a calibration
    calibrated = run_cli("calibrate", str(out), "--max-mb", "1", "--quiet")
    assert calibrated.returncode == 0, calibrated.stderr
    assert_each_step_moves_by_its_buckets(traced, own, predict_deepspeed_step_ms(traced, RERUN_MIB).set_index("rank"))

    if stage == 2:  # a calibration of these ranks gives the one-size table its fixed cost where the run has no
        # small all-reduce of its own (in_situ off); its own fit may go through the origin (one slow size): its
        # points and source are the check
        cost = bucket_cost(traced, one_size, in_situ=False)
        assert len(cost.points) >= 2 and cost.source.startswith("calibration x")
        # where the run has them, they come first: the calibration changes nothing whatif says
        assert bucket_cost(traced, longer).source == anchored.source
        if before.latency_us > 0:  # the run gave a fixed cost of its own (its buckets' line, or its small all-reduces)
            assert bucket_cost(traced) == before and not before.points
            assert run_cli("whatif", str(out), "--caps", repr(RERUN_MIB)).stdout == said.stdout
        else:  # it gave none (the buckets took less than the small all-reduces: this machine's noise, seen once
            # in CI): only then does the calibration's curve come in
            assert bucket_cost(traced).source.startswith("calibration x") and not before.points
        saved = json.loads((out / "calibration.json").read_text())
        (out / "calibration.json").write_text(json.dumps({**saved, "world_size": 3}))  # other ranks: not used
        assert bucket_cost(traced, one_size, in_situ=False).source == bare.source

    # bad input: one line, no table
    with pytest.raises(ValueError, match="must be > 0 bytes"):
        predict_deepspeed_peak(traced, 0)
    with pytest.raises(ValueError, match="must be > 0 MiB"):
        predict_deepspeed_step_ms(traced, float("nan"))
    for bad, said in (([1, 2], "run.json's deepspeed is a list, not an object"),
                      ({**traced.run["deepspeed"], "reduce_bucket_bytes": "x"},
                       "run.json's deepspeed.reduce_bucket_bytes is 'x', not a count")):
        broken = tmp_path / f"broken-{stage}-{len(said)}"
        shutil.copytree(out, broken)
        (broken / "run.json").write_text(json.dumps({**traced.run, "deepspeed": bad}))
        with pytest.raises(TraceError, match=said):
            load_run(broken)
        for command in (("summary",), ("whatif",), ("whatif", "--json")):
            proc = run_cli(*command, str(broken))
            assert proc.returncode == 2 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    untold = replace(traced, run={**traced.run, "deepspeed": {}}, cache={})
    with pytest.raises(ValueError, match="did not record DeepSpeed's reduce_bucket_size"):
        predict_deepspeed_peak(untold, 2**19)
    with pytest.raises(ValueError, match="did not record DeepSpeed's reduce_bucket_size"):
        predict_deepspeed_step_ms(untold, 1.0)
