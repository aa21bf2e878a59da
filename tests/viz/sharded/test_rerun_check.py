"""A sharded run's prediction for its rerun, beside what the rerun measured
(viz/sharded/rerun_check.py): real 2-rank FSDP2 jobs (gloo), the rerun made as the Run
page makes it (``ddpscope run --reshard-after-forward ... --forward-prefetch ...``). The
DeepSpeed side, through the page's live loop: tests/dashboard/test_sharded_view.py."""

from __future__ import annotations

import pytest

from ddpscope.viz.sharded.metrics import compute_memory_over_step, compute_sharded_steps
from ddpscope.viz.sharded.predict import compute_reshard_whatif
from ddpscope.viz.sharded.rerun_check import compute_rerun_check, rerun_setting
from ddpscope.viz.sharded.trace import real_steps
from ddpscope.viz.trace import load_run
from tests.conftest import SAMPLES
from tests.tracer.capture.autotrace.test_autotrace import WORKERS, trace_script

MIB = 2**20


@pytest.mark.ddp
def test_an_fsdp2_rerun_is_set_beside_what_its_run_predicted_for_it(tmp_path):
    """Traced with the script's reshard_after_forward (true), rerun at false with forward
    prefetch 1: the check reads the rerun's setting from the rerun (its units, the prefetch
    it was started with), predicts it as ``whatif`` and the Run page do, and sets it beside
    the rerun's own rank-0 step and peak; a run that is not sharded is refused."""
    script = (str(WORKERS / "fsdp2_train.py"), "--steps", "5")
    proc, out, _ = trace_script(tmp_path, *script, name="true")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc, again, _ = trace_script(tmp_path, *script, name="false",
                                  ddpscope=("--reshard-after-forward", "false", "--forward-prefetch", "1"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    source, rerun = load_run(out), load_run(again)

    setting = rerun_setting(rerun)
    assert (setting["reshard_after_forward"], setting["forward_prefetch"], setting["backward_prefetch"]) == (False, 1, 1)
    assert setting["words"] == "reshard_after_forward false, prefetch 1 ahead in forward and 1 in backward"
    assert rerun_setting(source)["reshard_after_forward"] is True  # the script's own, read from its units

    check = compute_rerun_check(source, rerun).set_index("quantity")
    assert list(check.index) == ["step (ms)", "peak (MiB)"]
    # predicted: whatif's row for that setting, made from the source
    whatif = compute_reshard_whatif(source, [{"reshard_after_forward": False, "forward_prefetch": 1}])
    row = whatif[whatif["predicted"] & (whatif["rank"] == 0)].iloc[0]
    assert check.loc["step (ms)", "predicted"] == row["step_ms"]
    assert check.loc["peak (MiB)", "predicted"] == row["peak_bytes"] / MIB
    # measured: the rerun's own rank 0, read from its tables
    steps = compute_sharded_steps(rerun)
    steps = steps[(steps["rank"] == 0) & steps["step"].isin(real_steps(rerun))]
    assert check.loc["step (ms)", "measured"] == pytest.approx(steps["step_ms"].median(), rel=1e-12)
    peak = compute_memory_over_step(rerun, 0)["total_bytes"].max()
    assert check.loc["peak (MiB)", "measured"] == pytest.approx(peak / MIB, rel=1e-12)
    assert check.loc["peak (MiB)", "error_pct"] == pytest.approx(
        (check.loc["peak (MiB)", "predicted"] / check.loc["peak (MiB)", "measured"] - 1) * 100, rel=1e-9)
    # keeping the units gathered: a larger peak predicted, and measured, than the source's own
    assert check.loc["peak (MiB)", "predicted"] > compute_memory_over_step(source, 0)["total_bytes"].max() / MIB
    assert check.loc["peak (MiB)", "measured"] > compute_memory_over_step(source, 0)["total_bytes"].max() / MIB

    # the same run beside itself: predicted as itself, no error
    same = compute_rerun_check(source, source)
    assert (same["predicted"] == same["measured"]).all() and (same["error_pct"] == 0).all()
    with pytest.raises(ValueError, match="both runs must be sharded"):
        compute_rerun_check(source, load_run(SAMPLES / "gpt-2rank-cap1mb"))


@pytest.mark.deepspeed
def test_a_deepspeed_rerun_at_another_stage_is_checked_on_the_model_states_it_kept(deepspeed_two_then_three):
    """Traced at ZeRO-2, rerun at ZeRO-3 (``--zero-stage 3``; the session's pair, see
    tests/conftest.py): a step at another stage is not predicted, so the check holds one
    row, the model states the rerun kept (parameters, master, moments; rank 0) against the
    Run page's prediction for stage 3, which ZeRO's own partitioning meets."""
    from ddpscope.viz.sharded.deepspeed_states import measured_states
    from ddpscope.viz.sharded.predict import compute_deepspeed_stage_whatif

    source, rerun = load_run(deepspeed_two_then_three["two"]), load_run(deepspeed_two_then_three["three"])
    assert rerun.shards.stage == 3 and rerun_setting(rerun)["words"].startswith("ZeRO stage 3, reduce_bucket_size")
    check = compute_rerun_check(source, rerun).set_index("quantity")
    assert list(check.index) == ["model states kept (MiB)"]
    states = compute_deepspeed_stage_whatif(source, [3])
    assert check.iloc[0]["predicted"] == states[states["predicted"]]["persistent_bytes"].iloc[0] / MIB
    kept = measured_states(rerun)
    assert check.iloc[0]["measured"] == kept[kept["rank"] == 0]["persistent_bytes"].iloc[0] / MIB
    assert abs(check.iloc[0]["error_pct"]) < 1.0, check  # the partitions' padding at most
