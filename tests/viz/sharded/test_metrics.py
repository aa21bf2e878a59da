"""The unit table's definitions (viz/sharded/metrics.py), on a hand-made step whose answer is
known: the tables below are a trace's data, not a stand-in for any behaviour."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from ddpscope.viz.sharded.metrics import (
    NO_UNIT,
    active_units,
    compute_sharded_run_comparison,
    compute_sharded_steps,
    compute_stage_comparison,
    compute_unit_table,
    idle_units_line,
    reshard_setting,
    sharded_step_noise_ms,
    stage_differences,
)


def _trace():
    """One rank, steps 0 (warm-up) and 1, each 0-100 µs: unit 0's forward 0-20 µs and its gather
    20-30 µs; after compute, three gathers no unit issued side by side, 40-70, 45-75, 50-80 µs
    (DeepSpeed's post-step gathers), and the gradient norm's all-reduce, 85-90 µs."""
    colls, segs, steps = [], [], []
    for step in (0, 1):
        t0 = 100.0 * step
        steps.append({"rank": 0, "step": step, "warmup": step == 0, "incomplete": False,
                      "start_us": t0, "end_us": t0 + 100})
        segs.append({"rank": 0, "step": step, "unit": 0, "phase": "forward", "start_us": t0, "end_us": t0 + 20})
        colls.append({"rank": 0, "step": step, "unit": 0, "collective": "all_gather", "bytes": 40,
                      "start_us": t0 + 20, "end_us": t0 + 30})
        for a in (40, 45, 50):
            colls.append({"rank": 0, "step": step, "unit": -1, "collective": "all_gather", "bytes": 100,
                          "start_us": t0 + a, "end_us": t0 + a + 30})
        colls.append({"rank": 0, "step": step, "unit": -1, "collective": "all_reduce", "bytes": 4,
                      "start_us": t0 + 85, "end_us": t0 + 90})
    units = pd.DataFrame([{"unit": 0, "name": "(root)", "numel": 10, "sharded_bytes": 20, "unsharded_bytes": 40,
                           "reshard_after_forward": True, "root": True}])
    waits = pd.DataFrame(columns=["rank", "step", "unit", "start_us", "end_us"]).astype(
        {"rank": int, "step": int, "unit": int, "start_us": float, "end_us": float})
    shards = SimpleNamespace(colls=pd.DataFrame(colls), waits=waits, segments=pd.DataFrame(segs), units=units,
                             framework="deepspeed", memory=pd.DataFrame(columns=["rank", "step", "total_bytes"]))
    return SimpleNamespace(shards=shards, steps=pd.DataFrame(steps), cache={})


def test_collectives_no_unit_issued_have_a_row_that_counts_time_in_flight_not_summed_spans():
    table = compute_unit_table(_trace()).set_index("unit")
    assert list(table.index) == ["(root)", NO_UNIT]
    row = table.loc[NO_UNIT]
    assert row["all_gathers"] == 3 and row["all_gather_bytes"] == 300
    assert row["all_gather_ms"] == pytest.approx(0.040)  # 40-80 µs in flight, not 3 x 30 µs
    assert row["all_reduce_ms"] == pytest.approx(0.005)
    assert row["exposed_ms"] == pytest.approx(0.045)  # nothing computed beside them
    assert pd.isna(row["forward_ms"]) and pd.isna(row["backward_ms"])  # not measured, not zero
    assert table.loc["(root)", "all_gather_ms"] == pytest.approx(0.010)
    # the rows add up to the step's exposed communication (the step table's definition)
    steps = compute_sharded_steps(_trace())
    assert table["exposed_ms"].sum() == pytest.approx(float(steps.loc[steps["step"] == 1, "exposed_ms"].iloc[0]))


def test_units_that_issued_nothing_are_left_out_where_the_table_is_read_and_counted():
    """A unit whose parameters no collective carried and no wait or compute touched (a
    ZeRO-1/2 module whose gradients went in a bucket named for another's): out of the
    table a person reads, counted in one line; ``compute_unit_table`` keeps every unit."""
    trace = _trace()
    idle = {"unit": 1, "name": "body.0", "numel": 5, "sharded_bytes": 10, "unsharded_bytes": 20,
            "reshard_after_forward": True, "root": False}
    trace.shards.units = pd.concat([trace.shards.units, pd.DataFrame([idle])], ignore_index=True)
    table = compute_unit_table(trace)
    assert list(table["unit"]) == ["(root)", "body.0", NO_UNIT]
    shown = active_units(table)
    assert list(shown["unit"]) == ["(root)", NO_UNIT]  # the root computed; the no-unit row communicated
    assert idle_units_line(len(table) - len(shown)).startswith("1 more unit issued no collective")


@pytest.mark.parametrize("framework, root, others, said", [
    ("fsdp2", True, [False, False], "false"),  # the root's own rule is not the run's setting
    ("fsdp2", False, [True, True], "true"),
    ("fsdp2", True, [2, 2], "2"),  # resharded to 2 ranks
    ("fsdp2", True, [True, 2], "mixed"),  # True is not 2 (nor 1)
    ("fsdp2", True, [], "true"),  # the root is the only unit
    ("deepspeed", True, [True, True], None),  # no such setting: its stage says it
])
def test_reshard_setting_is_the_units_own_not_the_roots_nor_deepspeeds(framework, root, others, said):
    units = pd.DataFrame([{"unit": k, "root": k == 0, "reshard_after_forward": v}
                          for k, v in enumerate([root, *others])])
    trace = SimpleNamespace(shards=SimpleNamespace(framework=framework, units=units))
    assert reshard_setting(trace) == said


def _steps_of(durations_us: dict[int, list[float]]) -> SimpleNamespace:
    """A trace of steps only: ``durations_us`` per rank, steps numbered from 1 after a warm-up step 0."""
    rows = []
    for rank, durations in durations_us.items():
        t = 0.0
        for step, d in enumerate([5000.0, *durations]):
            rows.append({"rank": rank, "step": step, "warmup": step == 0, "incomplete": False,
                         "start_us": t, "end_us": t + d})
            t += d
    empty = pd.DataFrame(columns=["rank", "step", "unit", "collective", "bytes", "start_us", "end_us"])
    shards = SimpleNamespace(colls=empty, waits=empty.drop(columns=["collective", "bytes"]),
                             segments=empty.drop(columns=["collective", "bytes"]).assign(phase=[]),
                             units=pd.DataFrame(), framework="fsdp2",
                             memory=pd.DataFrame(columns=["rank", "step", "total_bytes"]))
    return SimpleNamespace(shards=shards, steps=pd.DataFrame(rows), cache={})


def test_the_step_noise_is_none_for_steady_steps_bounded_by_their_spread_and_unknown_from_one():
    """A run whose steps all take 100 ms has no noise; one whose steps spread has some, within
    √2 x half their spread (a median's interval lies inside its values), more as they spread
    more; the warm-up step counts for nothing; with one real step it is not known (NaN)."""
    assert sharded_step_noise_ms(_steps_of({0: [100e3] * 8, 1: [100e3] * 8})) == 0.0
    rng = np.random.default_rng(1)
    ms = 100 + rng.normal(0, 5, size=(2, 12))
    noise = sharded_step_noise_ms(_steps_of({r: list(ms[r] * 1e3) for r in (0, 1)}))
    assert 0 < noise <= np.sqrt(2) * (ms.max() - ms.min()) / 2
    wider = sharded_step_noise_ms(_steps_of({r: list((100 + (ms[r] - 100) * 4) * 1e3) for r in (0, 1)}))
    assert wider == pytest.approx(4 * noise, rel=1e-9)  # the bootstrap resamples the same steps, seeded
    assert np.isnan(sharded_step_noise_ms(_steps_of({0: [100e3], 1: [90e3]})))


def test_the_step_noise_is_between_steps_not_between_the_ranks_of_one():
    """Three ranks whose steps each take 110 ms on average, every other one split 100, 100
    and 130 ms among them: no step is slower than another, so no noise (pooled over ranks,
    the bootstrap's medians moved between 100 and 110 ms)."""
    split, even = [100e3, 100e3, 130e3], [110e3] * 3
    steps = [split if i % 2 else even for i in range(10)]
    t = _steps_of({r: [s[r] for s in steps] for r in range(3)})
    assert sharded_step_noise_ms(t) == 0.0


def test_the_compare_row_is_each_step_as_the_rank_it_waited_for_its_time_the_ranks_mean():
    """Rank 0 waits 30 µs in each step for rank 1, which waits for nothing: the run's exposed
    communication is rank 1's (0), not 15 µs, the median pooled over both ranks that neither
    had; the step is the mean of its ranks' (110, 110, 80 ms: 110, where pooled reads 100)."""
    t = _steps_of({0: [100e3, 100e3, 100e3], 1: [120e3, 120e3, 60e3]})
    starts = t.steps.query("rank == 0 and step > 0")
    t.shards.waits = pd.DataFrame({"rank": 0, "step": starts["step"], "unit": 0,
                                   "start_us": starts["start_us"] + 10, "end_us": starts["start_us"] + 40})
    t.shards.units = pd.DataFrame([{"unit": 0, "name": "(root)", "root": True, "reshard_after_forward": True}])
    t.shards.stage, t.run = 3, {}
    steps = compute_sharded_steps(t).query("step > 0")
    assert steps.groupby("rank")["exposed_ms"].median().tolist() == pytest.approx([0.030, 0.0])
    row = compute_sharded_run_comparison({"run": t}).iloc[0]
    assert row["exposed_ms"] == 0.0 and row["step_ms"] == pytest.approx(110.0)


@pytest.mark.ddp
def test_frozen_blocks_are_sharded_with_no_gradient_or_optimizer_state(tmp_path):
    """FSDP2 with the first 2 of 4 blocks frozen (``requires_grad=False``, a partial
    fine-tune): every unit is sharded and gathered as before, but only the parameters that
    train have a gradient shard, Adam's moments and a reduce-scatter. run.json names them;
    the ZeRO model counts P held and P_t trained and meets the measurement; the gradients'
    D is theirs; training bit-identical to the run untraced."""
    from ddpscope.viz.sharded.comm_volume import compute_comm_volume
    from ddpscope.viz.trace import load_run
    from tests.tracer.capture.autotrace.test_autotrace import trace_script, untraced
    from tests.tracer.capture.sharded.test_sharded import SCRIPT, assert_trained_alike

    args = (SCRIPT, "--steps", "3", "--freeze", "2")
    proc, out, report = trace_script(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trained_alike(report, untraced(tmp_path, *args))
    trace = load_run(out)
    block = 2 * 64 + 64 * 256 + 256 + 256 * 64 + 64  # a block's norm, w1 and w2
    params, trained = int(trace.run["model_params"]), int(trace.run["trainable_params"])
    assert params - trained == 2 * block
    stages = compute_stage_comparison(trace)
    measured = stages[stages["rank"].notna()]
    assert ((measured["measured/predicted"] - 1).abs() < 0.02).all(), measured
    # no gradient shard or Adam moments for the frozen blocks: the trained parameters' alone (padded to N = 2)
    assert ((measured["grads_bytes"] - 4 * trained / 2).abs() <= 4 * 64).all(), measured
    assert ((measured["optimizer_state_bytes"] - 8 * trained / 2).abs() <= 8 * 64 + 64).all(), measured
    assert ((measured["params_bytes"] - 4 * params / 2).abs() <= 4 * 64).all(), measured  # every parameter sharded
    assert any(line.startswith(f"{2 * block:,} of the {params:,} parameters are frozen")
               for line in stage_differences(trace))
    vol = compute_comm_volume(trace).set_index("collective")
    assert vol.loc["all_gather", "message_D"] == pytest.approx(2.0, rel=0.01)  # the frozen gathered too
    assert vol.loc["reduce_scatter", "message_D"] == pytest.approx(1.0, rel=0.01)  # the trained ones' gradients
