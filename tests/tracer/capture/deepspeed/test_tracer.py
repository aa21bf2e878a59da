"""DeepSpeed's ZeRO engine traced under ``ddpscope run`` (tracer/capture/deepspeed/): real
2-rank DeepSpeed jobs (CPU accelerator, gloo), stages 1-3, checked against what the
script's engine itself reports and against the model's own sizes (the independent
instruments): every step's bucket reductions carry every gradient once, stages 1-2 gather
every parameter back after the step, ZeRO-3 gathers every parameter in the step, the
optimizer state per rank is Adam's two moments of its partition (8P/N bytes in fp32),
the bucket count follows ``--bucket-cap-mb``, and training is bit-identical traced and
untraced. DeepSpeed builds a small C++ op on its first run (~100 s): a marked suite."""

from __future__ import annotations

import json
from dataclasses import replace

import pandas as pd
import pytest

from ddpscope.tracer import format as fmt
from ddpscope.viz.sharded.comm_volume import comm_honesty_lines
from ddpscope.viz.sharded.deepspeed_states import peak_buffers_line
from ddpscope.viz.sharded.exposed import exposed_per_step, with_exposed
from ddpscope.viz.sharded.figures import make_sharded_timeline_figure
from ddpscope.viz.sharded.metrics import (
    NO_UNIT,
    UNTIMED_UNITS,
    compute_no_unit_table,
    compute_sharded_steps,
    compute_unit_table,
)
from ddpscope.viz.sharded.trace import AFTER_STEP_GATHER, real_steps
from tests.conftest import ROOT, run_cli
from tests.tracer.capture.autotrace.test_autotrace import checks, trace_script, untraced

pytest.importorskip("deepspeed")
pytestmark = [pytest.mark.deepspeed]
WORKER = str(ROOT / "tests" / "workers" / "deepspeed_train.py")
ENV = {"DS_ACCELERATOR": "cpu"}
PAD = 4 * 64  # bytes DeepSpeed may pad a flat group with (its alignment), per rank


def _load(out):
    from ddpscope.viz.trace import load_run

    return load_run(out)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_each_stage_is_traced_per_bucket_and_gather_and_trains_bit_identically(tmp_path, stage):
    # the script also all-reduces its loss with torch.distributed itself, past DeepSpeed's backend
    script = (WORKER, "--stage", str(stage), "--steps", "3", "--reduce-bucket-size", "20000", "--loss-allreduce")
    proc, out, report = trace_script(tmp_path, *script, env=ENV)
    assert proc.returncode == 0, proc.stderr
    own = checks(report)
    run = json.loads((out / fmt.RUN_FILE).read_text())
    assert run["kind"] == fmt.KIND_SHARDED and run["status"] == fmt.COMPLETE
    assert run["sharding"]["framework"] == "deepspeed" and run["sharding"]["stage"] == own[0]["stage"] == stage
    assert run["deepspeed"]["reduce_bucket_size"] == own[0]["reduce_bucket_size"] == 20000
    trace = _load(out)
    numel = own[0]["numel"]
    grad_bytes = 4 * numel  # fp32
    colls = trace.shards.colls
    assert set(trace.steps["step"]) == {0, 1, 2}
    for (rank, step), c in colls.groupby(["rank", "step"]):
        buckets = c[c["issued_by"] == "grad_bucket"]
        # every gradient reduced once a step: the buckets' messages are the gradients' bytes
        assert buckets["bytes"].sum() == grad_bytes, (rank, step)
        assert buckets["collective"].eq("reduce_scatter" if stage == 3 else "all_reduce").all()
        assert (buckets["phase"] == "backward").all()
        assert sorted(buckets["bucket"].unique()) == list(range(buckets["bucket"].nunique()))
        # each bucket named by its parameters (found when the step was written) and held by a unit
        assert (buckets["unit"] >= 0).all() and not buckets[["first_param", "last_param"]].isin(["?"]).any().any()
        assert buckets["first_param"].str.endswith((".weight", ".bias")).all()
        gathers = c[c["collective"] == "all_gather"]
        if stage < 3:  # the updated partitions gathered back: the whole (padded) flat model, after the step
            assert set(gathers["issued_by"]) == {"param_allgather"} and (gathers["phase"] == "optimizer").all()
            assert grad_bytes <= gathers["bytes"].sum() <= grad_bytes + 2 * PAD
        else:  # every parameter gathered at least once in the step, by its module's fetch
            assert set(gathers["issued_by"]) == {"param_fetch"}
            assert gathers["bytes"].sum() >= grad_bytes
            assert (gathers["end_us"] >= gathers["start_us"]).all()
    # every colour on the timeline is named: DeepSpeed's compute is the whole model's (one
    # "(root)"), so the units its collectives belong to, and what no unit issued, have entries of their own
    fig = make_sharded_timeline_figure(trace, steps=sorted(set(trace.steps["step"])))
    drawn = {NO_UNIT if u == -1 else n for u, n in zip(colls["unit"], colls["name"])}
    assert drawn <= {d.name for d in fig.data if d.showlegend is not False}
    unnamed = [d for d in fig.data if d.name == NO_UNIT or str(d.name).endswith(f" {NO_UNIT}")]
    assert (NO_UNIT in drawn) == bool(unnamed)
    assert all(f" {NO_UNIT}" in d.hovertemplate for d in unnamed)  # its hover says so too, not a unit's name
    assert len(drawn) > 1 and set(trace.shards.segments["name"]) == {"(root)"}
    # Adam's two fp32 moments of this rank's partition (and its step counter)
    mem = trace.shards.memory
    after = mem[(mem["phase"] == "optimizer") & (mem["step"] >= 1)]
    assert len(after)
    for state in after["optimizer_state_bytes"]:
        assert abs(state - 8 * numel / 2) <= 2 * PAD, state
    # compute is timed between collectives, not per module: the root's row holds it all, the others none
    units = compute_unit_table(trace)
    root = units["unit"] == trace.shards.units.loc[trace.shards.units["root"], "name"].iloc[0]
    assert (units.loc[root, ["forward_ms", "backward_ms"]] > 0).all().all()
    assert units.loc[~root, ["forward_ms", "backward_ms"]].isna().all().all() and (~root).any()
    # collectives no unit issued (the gradient norm's all-reduce; at stages 1-2 the updated
    # partitions' gather) have their own row: the rows' exposed parts add up to the step's
    # (to 1 %: at stage 3 a prefetched gather may run a few µs beside another unit's, counted in both)
    sh = trace.shards
    assert (NO_UNIT in set(units["unit"])) == (sh.colls["unit"] == -1).any()
    if stage < 3:
        row = units.set_index("unit").loc[NO_UNIT]
        assert grad_bytes <= row["all_gather_bytes"] <= grad_bytes + 2 * PAD and row["all_gathers"] == 1
    parts = exposed_per_step(with_exposed(trace), sh.waits, sh.segments, by=("unit",))
    by_step = compute_sharded_steps(trace).set_index(["rank", "step"])["exposed_ms"]
    total = parts.groupby(["rank", "step"]).sum().reindex(by_step.index)
    assert total.to_numpy() == pytest.approx(by_step.to_numpy(), rel=0.01, abs=1e-6) and (by_step > 0).all()
    assert (parts.xs(-1, level="unit") > 0).all()  # the no-unit part is there, not folded away
    # and each row is those parts' median over ranks and the steps the tables count
    names = {**dict(zip(sh.units["unit"], sh.units["name"])), -1: NO_UNIT}
    counted = parts[parts.index.get_level_values("step").isin(real_steps(trace))]
    medians = counted.groupby(level="unit").median().rename(index=names)
    assert units.set_index("unit")["exposed_ms"].loc[medians.index].to_numpy() == pytest.approx(medians.to_numpy())
    assert peak_buffers_line(trace) is None  # buffers are under a quarter of the peak here (ZeRO-3: 6 %)
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0 and "DeepSpeed units=" in summary.stdout and f"ZeRO stage {stage}" in summary.stdout
    assert "gradient buckets (DeepSpeed" in summary.stdout and UNTIMED_UNITS in summary.stdout
    assert summary.stdout.splitlines()[-1] == f"at another ZeRO stage or reduce_bucket_size: `ddpscope whatif {out}`"
    as_json = json.loads(run_cli("summary", str(out), "--json").stdout)
    assert [u["forward_ms"] is None for u in as_json["units"]] == list(~root)
    # units no collective carried are left out of the printed table, counted (the JSON keeps them)
    quiet = units[(units[[c for c in ("all_gathers", "reduce_scatters", "all_reduces") if c in units]].sum(axis=1)
                   == 0) & ~root]
    lines = summary.stdout.splitlines()
    at = lines.index("per unit (ms per step, bytes per step):") + 2 + len(units) - len(quiet)  # header, rows
    assert lines[at].startswith(f"{len(quiet)} more unit" if len(quiet) else UNTIMED_UNITS), lines[at]
    whatif = run_cli("whatif", str(out))  # the Run page's predictions: states per stage, peak per bucket size
    assert whatif.returncode == 0 and f"DeepSpeed ZeRO stage {stage}" in whatif.stdout, whatif.stderr
    assert "model states a rerun at each stage would keep" in whatif.stdout and "--zero-stage S" in whatif.stdout
    assert run_cli("whatif", str(out), "--reshard-after-forward", "false").returncode == 2  # FSDP2's flag
    # The script's own all-reduce of its loss (torch.distributed, past DeepSpeed's backend and its
    # tap): once a step, of no unit, 4 bytes, between backward and the optimizer and off compute,
    # named for its line; every collective no unit issued says who issued it, none DeepSpeed's
    # backend (its frames are passed over); and the volume's line says them.
    line = next(k for k, text in enumerate(open(WORKER).read().splitlines(), 1) if "dist.all_reduce(mean)" in text)
    script_ = f"all_reduce (the script, deepspeed_train.py:{line})"
    other = colls[colls["issued_by"] == "other"]
    assert other["by"].notna().all() and not other["by"].str.contains("deepspeed.comm").any(), other["by"]
    mine = other[other["by"] == script_]
    assert len(mine) == 2 * 3 and mine.groupby(["rank", "step"]).size().eq(1).all(), other["by"].tolist()
    assert set(mine["bytes"]) == {4} and (mine["unit"] == -1).all() and (mine["collective"] == "all_reduce").all()
    steps, segs = trace.steps.set_index(["rank", "step"]), trace.shards.segments
    for _, g in mine.iterrows():
        step = steps.loc[(g["rank"], g["step"])]
        assert step["backward_end_us"] <= g["start_us"] <= g["end_us"] <= step["optimizer_start_us"]
        theirs = segs[(segs["rank"] == g["rank"]) & (segs["step"] == g["step"])]
        assert not ((theirs["start_us"] < g["end_us"]) & (theirs["end_us"] > g["start_us"])).any()
    # the Timeline's hover says who issued each (its grey bar, "(no unit)")
    assert any(f"{NO_UNIT}: {script_}" in (d.hovertemplate or "") for d in fig.data)
    said = [t for t in comm_honesty_lines(trace) if t.startswith("Besides ZeRO's own")]
    assert len(said) == 1 and f"{script_} (1 a step)" in said[0], said
    assert said[0] in summary.stdout.splitlines()  # `ddpscope summary` prints it
    # the no-unit row broken down by who issued each: every collective of no unit in one
    # row, named (stages 1-2's gather of the updated partitions too, in its hover as well)
    no_unit = compute_no_unit_table(trace).set_index("by")
    counted = colls[(colls["unit"] == -1) & colls["step"].isin(real_steps(trace))]
    assert counted["by"].notna().all() and set(no_unit.index) == set(counted["by"])
    assert no_unit.loc[script_, ["count", "bytes"]].tolist() == [1, 4]
    assert (no_unit["exposed_ms"] <= no_unit["ms"] + 1e-6).all() and (no_unit["ms"] > 0).all()
    if stage < 3:
        after = no_unit.loc[AFTER_STEP_GATHER[stage]]
        assert after["collective"] == "all_gather" and after["count"] == 1
        assert grad_bytes <= after["bytes"] <= grad_bytes + 2 * PAD
        assert any(f"{NO_UNIT}: {AFTER_STEP_GATHER[stage]}" in (d.hovertemplate or "") for d in fig.data)
    assert f"the {NO_UNIT} row by who issued it (per step):" in summary.stdout
    assert [r["by"] for r in as_json["no_unit"]] == no_unit.index.tolist()
    plain = untraced(tmp_path, *script)
    for r in (0, 1):
        assert own[r]["params_sha256"] == checks(plain)[r]["params_sha256"]
        assert own[r]["losses"] == checks(plain)[r]["losses"]
        assert own[r]["loss_means"] == checks(plain)[r]["loss_means"] and len(own[r]["loss_means"]) == 3


def test_a_zero3_peak_held_by_its_reduce_bucket_is_said_with_the_setting_that_sizes_it(tmp_path):
    """ZeRO-3 allocates its reduce bucket whole, reduce_bucket_size elements whatever the model's
    size (DeepSpeed's CIFAR example: 191 MiB of a 192 MiB peak): the summary says so, with the
    bucket's bytes from DeepSpeed's own config, the instrument."""
    script = (WORKER, "--stage", "3", "--steps", "2", "--reduce-bucket-size", "5000000")
    proc, out, _ = trace_script(tmp_path, *script, env=ENV)
    assert proc.returncode == 0, proc.stderr
    trace = _load(out)
    at = trace.shards.memory.loc[trace.shards.memory["total_bytes"].idxmax()]
    assert at["comm_buffers_bytes"] == 4 * 5_000_000  # fp32: the bucket, whole, at the peak
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0
    assert ("communication buffers hold 19.1 MiB" in summary.stdout and "DeepSpeed's reduce bucket, allocated whole, "
            "reduce_bucket_size = 5,000,000 elements (19.1 MiB)" in summary.stdout), summary.stdout
    # a warm-up step's peak is not the step's peak the line speaks of: a sample put there, far
    # above the rest and nearly all buffers, leaves the line as it was (said of it without the filter)
    warm = trace.steps.loc[trace.steps["warmup"].astype(bool), "step"]
    assert len(warm), "the run has no warm-up step to put the sample in"
    mem = trace.shards.memory
    sample = mem.iloc[[0]].assign(step=int(warm.iloc[0]), total_bytes=2.0**33, comm_buffers_bytes=2.0**33 - 1)
    shards = replace(trace.shards, memory=pd.concat([mem, sample], ignore_index=True))
    assert peak_buffers_line(replace(trace, shards=shards, cache={})) == peak_buffers_line(trace)
    assert "8192.0 MiB" not in peak_buffers_line(trace)


def test_hugging_face_trainer_under_deepspeed_is_traced_with_its_tied_weights_counted_once(tmp_path):
    """The Trainer builds DeepSpeed's engine itself (through Accelerate): it is traced, each
    step's buckets carry every gradient once, D counts GPT-2's tied head and embedding
    once (as DeepSpeed partitions it: the model's own parameter count, the instrument), the
    measured model states sit on the ZeRO model's, and training is bit-identical."""
    pytest.importorskip("transformers")
    script = (str(ROOT / "tests" / "workers" / "hf_deepspeed_train.py"), "--stage", "2", "--steps", "4")
    proc, out, report = trace_script(tmp_path, *script, env=ENV)
    assert proc.returncode == 0, proc.stderr
    own = checks(report)
    run = json.loads((out / fmt.RUN_FILE).read_text())
    assert run["sharding"]["framework"] == "deepspeed" and run["sharding"]["stage"] == own[0]["stage"] == 2
    assert run["status"] == fmt.COMPLETE and own[0]["global_step"] == 4
    trace = _load(out)
    numel = own[0]["numel"]
    assert int(trace.shards.units["unsharded_bytes"].sum()) == 4 * numel  # the tied weight once
    assert "lm_head" not in set(trace.shards.units["name"])  # holds only the tied weight: wte's unit
    colls = trace.shards.colls
    for (rank, step), c in colls.groupby(["rank", "step"]):
        assert c[c["issued_by"] == "grad_bucket"]["bytes"].sum() == 4 * numel, (rank, step)
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0 and "ZeRO stage 2" in summary.stdout
    measured = [float(line.split()[-1]) for line in summary.stdout.splitlines() if line.strip().startswith("measured")]
    assert len(measured) == 2 and all(0.95 <= m <= 1.05 for m in measured), summary.stdout
    plain = untraced(tmp_path, *script)
    for r in (0, 1):
        assert own[r]["params_sha256"] == checks(plain)[r]["params_sha256"]


def test_zero3_persistent_parameters_gathered_after_the_step_end_in_their_step(tmp_path):
    """DeepSpeed's default keeps parameters under stage3_param_persistence_threshold whole and
    gathers them after every step (``_post_step``), waiting on torch's own Works: those
    gathers are named for what they are and end in their step (they used to stay open until
    the next step's first collective: 90 ms gathers in a 125 ms step, more exposed than the
    step on a user's transformer)."""
    script = (WORKER, "--stage", "3", "--steps", "3", "--reduce-bucket-size", "20000",
              "--persistence-threshold", "300")  # the biases (256, 256, 8) persist, the weights do not
    proc, out, report = trace_script(tmp_path, *script, env=ENV)
    assert proc.returncode == 0, proc.stderr
    trace = _load(out)
    colls, steps = trace.shards.colls, trace.steps.set_index(["rank", "step"])
    after = colls[colls["issued_by"] == "param_allgather"]
    assert len(after) and (after["phase"] == "optimizer").all() and (after["collective"] == "all_gather").all()
    for (rank, step), c in after.groupby(["rank", "step"]):
        assert c["bytes"].sum() == 4 * (256 + 256 + 8), (rank, step)  # every persistent parameter, whole
    for (rank, step), c in colls.groupby(["rank", "step"]):
        end = steps.loc[(rank, step), "end_us"]
        assert (c["end_us"] <= end).all(), (rank, step)  # every collective seen done in its own step
    events = [e for e in json.loads((out / "rank-0.json").read_text())  # a complete run's file is whole JSON
              if e.get("ph") == "X" and e.get("args", {}).get("zero") == "param_allgather"]
    assert events and all(e["name"] == "all-gather (no unit)" for e in events)  # not the last unit's name
    # named for what they are, in the no-unit row's breakdown: 3 a step, every persistent byte
    row = compute_no_unit_table(trace).set_index("by").loc[AFTER_STEP_GATHER[3]]
    assert row["count"] == 3 and row["bytes"] == 4 * (256 + 256 + 8) and row["ms"] > 0
    from ddpscope.viz.sharded.metrics import compute_sharded_steps

    # the gathers run side by side: time in flight and exposed time are times, not sums of spans
    per = compute_sharded_steps(trace)
    for col in ("all_gather_ms", "exposed_ms", "compute_ms"):
        assert (per[col] <= per["step_ms"] + 1e-6).all(), per[["step_ms", col]]
    assert (per["compute_ms"] + per["exposed_ms"] <= per["step_ms"] + 1e-6).all()


def test_bf16_with_overlap_comm_and_accumulation_reduces_every_micro_batch(tmp_path):
    """Stage 2 in bf16 with ``overlap_comm`` and two micro-batches a step: DeepSpeed
    reduces the gradients of every micro-batch (stage 2 partitions them as they come), so
    a step's buckets carry twice the model's bf16 gradient bytes, both micro-batches sit
    inside the step, and training is bit-identical traced and untraced."""
    script = (WORKER, "--stage", "2", "--steps", "3", "--bf16", "--overlap-comm", "--accumulate", "2")
    proc, out, report = trace_script(tmp_path, *script, env=ENV)
    assert proc.returncode == 0, proc.stderr
    run = json.loads((out / fmt.RUN_FILE).read_text())
    assert run["deepspeed"]["dtype"] == "bfloat16" and run["deepspeed"]["overlap_comm"] is True
    trace = _load(out)
    assert trace.steps["micro_batches"].eq(2).all()
    colls = trace.shards.colls
    buckets = colls[colls["issued_by"] == "grad_bucket"]
    numel = checks(report)[0]["numel"]
    assert buckets.groupby(["rank", "step"])["bytes"].sum().eq(2 * 2 * numel).all()
    # numbered in each micro-batch: the same buckets, 0..n-1, reduced once in each
    per_micro = buckets.groupby(["rank", "step", "micro"])
    assert set(buckets["micro"]) == {0, 1} and per_micro["bytes"].sum().eq(2 * numel).all()
    assert all(sorted(b["bucket"]) == list(range(len(b))) for _, b in per_micro)
    firsts = buckets.sort_values("start_us").groupby(["rank", "step", "micro"])["first_param"].apply(tuple)
    assert firsts.groupby(level=[0, 1]).nunique().eq(1).all()  # the same parameters in both
    from ddpscope.viz.sharded.buckets import compute_bucket_table

    table = compute_bucket_table(trace)  # a row per bucket, reduced twice a step: not one per reduction
    assert len(table) == buckets.groupby(["rank", "step", "micro"]).size().max()
    assert table["micro_batches"].eq(2).all() and table["bytes"].sum() == 2 * 2 * numel
    # each reduction whole on the training thread holds its collectives; each micro-batch's
    # buckets list every parameter once (the worker's own count), in an order the run's
    # size cuts into the buckets it reduced
    assert (table["reduce_ms"] >= table["ms"]).all(), table[["ms", "reduce_ms"]]
    from ddpscope.viz.sharded.deepspeed_buckets import recut, reductions

    done = reductions(trace)
    size = run["deepspeed"]["reduce_bucket_size"]
    for _, micro in done.groupby(["rank", "step", "micro"]):
        order = [n for t in micro["numels"] for n in t]
        assert sum(order) == numel and recut(order, size) == micro["elements"].astype(int).tolist()
    from ddpscope.viz.sharded.comm_volume import comm_honesty_lines

    said = [line for line in comm_honesty_lines(trace) if line.startswith("A step here is 2 micro-batches")]
    assert len(said) == 1 and "reduced 2.00 times a step" in said[0], comm_honesty_lines(trace)
    # host times: said where the device runs collectives on streams of its own (the same
    # trace read as if its ranks had been on a GPU), not on the CPU where the host ran them
    assert not any("timed them on the host" in line for line in comm_honesty_lines(trace))
    on_gpu = replace(trace, ranks={r: {**m, "device": f"cuda:{r}"} for r, m in trace.ranks.items()}, cache={})
    assert any(line.startswith("On cuda:0, cuda:1 DeepSpeed's collectives run on its own streams")
               for line in comm_honesty_lines(on_gpu))
    from ddpscope.viz.sharded.deepspeed_states import deepspeed_differences

    master = deepspeed_differences(trace)[0]  # the fp32 master beside bf16 parameters: no second copy to explain
    assert "beside the 2-byte parameters" in master and "float32" not in master, master
    plain = untraced(tmp_path, *script)
    for r in (0, 1):
        assert checks(report)[r]["params_sha256"] == checks(plain)[r]["params_sha256"]


def test_a_stage_ddpscope_does_not_trace_is_named_and_the_job_runs_untraced(tmp_path):
    """ZeRO stage 0 (DeepSpeed's own data parallelism) is not traced: said once as it
    happened and once at the end, run.json keeps the engine's settings, ``summary`` says
    why in one line, exit code 2."""
    proc, out, report = trace_script(tmp_path, WORKER, "--stage", "0", "--steps", "2", env=ENV)
    assert proc.returncode == 0, proc.stderr
    run = json.loads((out / fmt.RUN_FILE).read_text())
    assert run["kind"] == fmt.KIND_DEEPSPEED and run["status"] == fmt.UNTRACED
    assert run["deepspeed"]["zero_stage"] == checks(report)[0]["stage"] == 0
    said = [line for line in proc.stderr.splitlines() if "DeepSpeed ZeRO stage 0" in line]
    assert len(said) == 2 and "ddpscope traces DeepSpeed's ZeRO stages 1, 2 and 3" in said[0]
    assert not list(out.glob("rank-*.json"))
    summary = run_cli("summary", str(out))
    assert summary.returncode == 2 and len(summary.stderr.strip().splitlines()) == 1
    assert "was run but not traced" in summary.stderr and "DeepSpeed ZeRO stage 0" in summary.stderr


def test_bucket_cap_mb_sets_the_buckets_a_step_reduces(tmp_path):
    """The script reduces in buckets of 50,000 elements: 3 a step on this MLP (its
    65,536-element weight alone); ``--bucket-cap-mb 1`` (262,144 fp32 elements) holds
    every gradient in one."""
    proc, out, report = trace_script(tmp_path, WORKER, "--stage", "2", "--steps", "2",
                                     ddpscope=("--bucket-cap-mb", "1", "--grad-marks-every", "2"), env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert checks(report)[0]["reduce_bucket_size"] == 2**18
    notes = json.loads((out / "run.json").read_text())["notes"]
    assert any("--grad-marks-every applies to DDP" in n for n in notes)  # a DDP flag: said, not used
    colls = _load(out).shards.colls
    buckets = colls[colls["issued_by"] == "grad_bucket"]
    assert buckets.groupby(["rank", "step"])["bucket"].nunique().eq(1).all()
    proc, out, _ = trace_script(tmp_path, WORKER, "--stage", "2", "--steps", "2", name="script", env=ENV)
    assert proc.returncode == 0, proc.stderr
    colls = _load(out).shards.colls
    buckets = colls[colls["issued_by"] == "grad_bucket"]
    assert buckets.groupby(["rank", "step"])["bucket"].nunique().eq(3).all()


def test_zero_stage_reruns_the_script_at_another_stage_and_the_prediction_holds(deepspeed_two_then_three):
    """From a stage-2 trace the model states of stage 3 are predicted (the ZeRO model with
    DeepSpeed's precision, P/N from the trace); ``--zero-stage 3`` reruns the same script
    there (said once, the script's config untouched), and what it keeps between steps
    (parameters, the fp32 master, Adam's moments) is within 5 % of the prediction; and
    back, from the stage-3 trace to stage 2. (The pair is the session's, shared with
    tests/viz/sharded/test_rerun_check.py.)"""
    from ddpscope.viz.sharded.deepspeed_states import measured_states, predict_states

    two, three = deepspeed_two_then_three["two"], deepspeed_two_then_three["three"]
    assert checks(deepspeed_two_then_three["report3"])[0]["stage"] == 3  # the engine itself ran stage 3
    said = [line for line in deepspeed_two_then_three["stderr3"].splitlines() if "replaced by --zero-stage 3" in line]
    assert len(said) == 1 and "ZeRO stage 2 in the script's config" in said[0]
    traces = {2: _load(two), 3: _load(three)}
    assert traces[3].shards.stage == 3 and traces[3].run["sharding_requested"]["zero_stage"] == 3
    for src, dst in ((2, 3), (3, 2)):
        predicted = predict_states(traces[src], dst)["persistent_bytes"]
        for got in measured_states(traces[dst])["persistent_bytes"]:
            assert abs(got / predicted - 1) <= 0.05, (src, dst, got, predicted)
        # `ddpscope whatif` prints the same prediction (the Run page's), for every stage
        said = run_cli("whatif", str(two if src == 2 else three), "--json")
        assert said.returncode == 0, said.stderr
        rows = {r["stage"]: r for r in json.loads(said.stdout)["stages"] if r["predicted"]}
        assert sorted(rows) == [1, 2, 3] and rows[dst]["persistent_bytes"] == predicted


def test_parameters_zero3_keeps_whole_are_predicted_from_stage_2_and_measured_at_3(tmp_path):
    """With ``stage3_param_persistence_threshold`` 20,000 elements, ZeRO-3 keeps this MLP's
    small parameters whole on every rank (all but the 65,536-element weight: 18,952
    elements) beside their partitions. A stage-2 trace finds them by DeepSpeed's rule, the
    stage-3 rerun by DeepSpeed's own marks (``ds_persist``): the same count; the stage-3
    trace's parameters alive from its first step on hold exactly their bytes (the memory
    samples: the independent instrument), and the measured model states count them; the
    prediction from stage 2 holds within 5 % (without them it is 11 % short). Stage 0's
    row keeps the whole optimizer state."""
    from ddpscope.viz.sharded.deepspeed_states import measured_states, predict_states

    script = (WORKER, "--steps", "3", "--stage", "2", "--persistence-threshold", "20000")
    proc, two, _ = trace_script(tmp_path, *script, name="two", env=ENV)
    assert proc.returncode == 0, proc.stderr
    proc, three, _ = trace_script(tmp_path, *script, name="three", ddpscope=("--zero-stage", "3"), env=ENV)
    assert proc.returncode == 0, proc.stderr
    traces = {2: _load(two), 3: _load(three)}
    kept = 64 * 256 + 256 + 256 + 256 * 8 + 8
    for t in traces.values():
        assert t.run["deepspeed"]["stage3_persistent_numel"] == kept
        assert t.run["deepspeed"]["stage3_param_persistence_threshold"] == 20000
    mem = traces[3].shards.memory
    alive = mem[mem["step"] >= 1].groupby("rank")["unsharded_params_bytes"].min()
    assert alive.eq(4 * kept).all(), alive
    measured = measured_states(traces[3])
    for row in measured.itertuples():  # the fp32 partition (half of partition + master) and the whole ones alive
        partition = mem[mem["rank"] == row.rank]["sharded_params_bytes"].max() / 2
        assert row.params_bytes == partition + alive[row.rank], (row, partition, alive)
    predicted = predict_states(traces[2], 3)["persistent_bytes"]
    for got in measured["persistent_bytes"]:
        assert abs(got / predicted - 1) <= 0.05, (got, predicted)
        assert got / (predicted - 4 * kept) - 1 > 0.05  # a prediction without them: off by more
    # summary says so, in words and in --json
    said = json.loads(run_cli("summary", str(three), "--json").stdout)["model_state_notes"]
    assert any("at stage 3 DeepSpeed keeps 18,952 elements of parameters" in line for line in said), said
    assert "at stage 3 DeepSpeed keeps 18,952" in run_cli("summary", str(three)).stdout
    # stage 0 partitions nothing: the ZeRO model's K x P of optimizer state, not the partition's
    from ddpscope.viz.sharded.deepspeed_states import precision
    from ddpscope.viz.zero.model import model_state_bytes

    numel = float(traces[2].shards.units["numel"].sum())
    assert predict_states(traces[2], 0)["optimizer_state_bytes"] == \
        model_state_bytes(numel, 2, 0, precision(traces[2]))["optimizer_state_bytes"] == 12 * numel


# stage 2 with offload_param set too, which stages 1-2 never read: a stage-3 config rerun at
# stage 2 (``--zero-stage 2``, the Run page's rerun) keeps it
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_offload_is_traced_with_the_states_it_keeps_in_host_memory_apart(tmp_path, stage):
    """ZeRO-Offload (``offload_optimizer`` and ``offload_param`` to ``cpu``) is
    traced, training bit-identical: the memory samples' categories are the device's and
    ``offloaded`` holds what DeepSpeed keeps in host memory, checked against the model's
    own size (P elements, fp32, N = 2): Adam's moments (8 P/N) and the fp32 master (4 P/N)
    are all on the host, at stage 2 with a model-dtype staging copy of the partition (4 P/N)
    while the whole parameters (4 P) stay on the device (``offload_param`` is for stage 3
    only, and the run says it is unused); at stage 3 no partition is on the device. The
    measured host share of the persistent states is the one ``predict_states`` gives for
    the run's own stage."""
    from ddpscope.viz.sharded.deepspeed_states import measured_states, predict_states

    script = (WORKER, "--stage", str(stage), "--offload", "both", "--steps", "3", "--reduce-bucket-size", "20000")
    proc, out, report = trace_script(tmp_path, *script, env=ENV)
    assert proc.returncode == 0, proc.stderr
    own = checks(report)
    run = json.loads((out / fmt.RUN_FILE).read_text())
    assert run["kind"] == fmt.KIND_SHARDED and run["status"] == fmt.COMPLETE
    assert run["deepspeed"]["offload_optimizer"] == "cpu"
    assert run["deepspeed"]["offload_param"] == "cpu"  # the config's, at every stage
    reason = run["sharding"]["stage_reason"]
    assert "optimizer offload to cpu" in reason
    assert ("parameter offload to cpu" in reason) == (stage == 3)  # stages 1-2 ignore offload_param: said
    assert ("offload_param cpu set (stage 3 only: unused here)" in reason) == (stage < 3), reason
    trace = _load(out)
    part = own[0]["numel"] / 2  # elements of a rank's partition
    mem = trace.shards.memory
    after = mem[mem["step"] >= 1]
    assert len(after) and after["offloaded"].map(lambda d: isinstance(d, dict)).all()
    host = pd.DataFrame(list(after["offloaded"])).fillna(0)
    assert (after["optimizer_state_bytes"] == 0).all()  # nothing of the optimizer on the device
    assert (abs(host["optimizer_state_bytes"] - 8 * part) <= 2 * PAD).all()  # Adam's two moments
    staging = 4 * part if stage < 3 else 0  # stages 1-2: the model-dtype copy of the partition, beside the master
    assert (abs(host["sharded_params_bytes"] - 4 * part - staging - (4 * part if stage == 3 else 0))
            <= 2 * PAD).all()
    if stage < 3:  # the whole parameters stay on the device
        assert (abs(after["unsharded_params_bytes"] - 4 * own[0]["numel"]) <= 2 * PAD).all()
    else:  # offload_param: no partition on the device
        assert (after["sharded_params_bytes"] == 0).all()
    assert (after["host_bytes"] == host.sum(axis=1).to_numpy()).all()
    predicted = predict_states(trace, stage)["host_persistent_bytes"]
    for got in measured_states(trace)["host_persistent_bytes"]:
        assert abs(got - predicted) <= 2 * PAD, (got, predicted)
    # the device's part beside DeepSpeed's own estimator with offload, called here (the independent instrument)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from ddpscope.viz.sharded.deepspeed_states import compute_deepspeed_stages
    table = compute_deepspeed_stages(trace).set_index("row")
    numel, largest = float(trace.shards.units["numel"].sum()), float(trace.shards.units["numel"].max())
    theirs = estimate_zero2_model_states_mem_needs(numel, 2, 1, cpu_offload=True)[1] if stage == 2 else \
        estimate_zero3_model_states_mem_needs(numel, largest, 2, 1, cpu_offload=True, cpu_offload_params=True)[1]
    assert table.loc[f"DeepSpeed estimate (stage {stage})", "model_state_bytes"] == theirs
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0 and "host_persistent_bytes" in summary.stdout
    assert "DeepSpeed's estimator with offload says" in summary.stdout
    assert "beside the 4-byte parameters" in summary.stdout and "also when it trains in float32" in summary.stdout
    assert "with ZeRO-Offload DeepSpeed keeps" in summary.stdout  # why the gradients exceed the model's P/N
    plain = untraced(tmp_path, *script)
    for r in (0, 1):
        assert own[r]["params_sha256"] == checks(plain)[r]["params_sha256"]
        assert own[r]["losses"] == checks(plain)[r]["losses"]


def test_frozen_parameters_are_held_and_partitioned_without_gradients_or_states(tmp_path):
    """A partial fine-tune (the first two layers ``requires_grad=False``, the optimizer
    given the rest, as the Hugging Face Trainer does for a LoRA model): at stage 2 every
    parameter is held whole, at stage 3 partitioned (the frozen ones apart from the
    optimizer's flat groups), and only the last layer's 2,056 parameters have gradients, a
    master and moments. Measured against the script's own counts (``ds_numel``, each
    parameter's ``ds_tensor``), and each stage's prediction from the other's trace holds."""
    from ddpscope.viz.sharded.deepspeed_states import compute_deepspeed_stages, measured_states, predict_states

    script = (WORKER, "--steps", "3", "--stage", "2", "--freeze")
    proc, two, report_two = trace_script(tmp_path, *script, name="two", env=ENV)
    assert proc.returncode == 0, proc.stderr
    proc, three, report_three = trace_script(tmp_path, *script, name="three", ddpscope=("--zero-stage", "3"), env=ENV)
    assert proc.returncode == 0, proc.stderr
    traces, own = {2: _load(two), 3: _load(three)}, {2: checks(report_two)[0], 3: checks(report_three)[0]}
    numel, trained = own[2]["numel"], own[2]["trainable_numel"]
    assert trained == 256 * 8 + 8 and numel == trained + 64 * 256 + 256 + 256 * 256 + 256
    for t in traces.values():
        assert t.run["trainable_params"] == trained and t.run["model_params"] == numel
    measured = {s: measured_states(t) for s, t in traces.items()}
    assert (measured[2]["params_bytes"] == 4 * numel).all()  # the frozen ones whole beside the flat group
    assert (measured[3]["params_bytes"] == 4 * own[3]["partition_numel"]).all()  # every partition, frozen ones too
    for m in measured.values():  # the trained last layer's partition alone: a master and two moments
        assert (abs(m["optimizer_state_bytes"] - 12 * trained / 2) <= 3 * PAD).all(), m
        # gradients: buffers sized by the trained parameters' bucket layout (P_t/N or more), none for the frozen
        assert ((m["grads_bytes"] >= 4 * trained / 2 - PAD) & (m["grads_bytes"] <= 4 * trained + 2 * PAD)).all(), m
    for a, b in ((2, 3), (3, 2)):  # each stage predicted from the other's trace
        predicted = predict_states(traces[a], b)["persistent_bytes"]
        assert (abs(measured[b]["persistent_bytes"] - predicted) <= 2 * PAD).all(), (a, b, predicted, measured[b])
    table = compute_deepspeed_stages(traces[3]).set_index("row")
    assert table.loc["stage 0", "optimizer_state_bytes"] == 12 * trained  # not 12 x the whole model
    assert table.loc["stage 3", "params_bytes"] == 4 * own[3]["partition_numel"]
    assert ((table["measured/predicted"].dropna() - 1).abs() < 0.01).all()
    frozen = numel - trained
    said = run_cli("summary", str(three)).stdout
    assert f"{frozen:,} of the {numel:,} parameters are frozen" in said and "the gradients' D" in said


def test_hugging_face_trainer_with_peft_lora_under_zero3_counts_the_frozen_base_model(tmp_path):
    """The stack that found frozen parameters uncounted: the Trainer fine-tuning a PEFT LoRA
    model under ZeRO-3. run.json's parameter counts are PEFT's own
    (``get_nb_trainable_parameters``, the independent instrument); every rank holds its
    partition of every parameter, the frozen base model's too (each ``ds_tensor``, as the
    script counts it); each step reduces the adapters' gradients alone; the measured model
    states sit on the ZeRO model's."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    script = (str(ROOT / "tests" / "workers" / "hf_deepspeed_train.py"), "--stage", "3", "--lora", "--steps", "3")
    proc, out, report = trace_script(tmp_path, *script, env=ENV)
    assert proc.returncode == 0, proc.stderr
    own = checks(report)
    peft = own[0]["peft"]
    trace = _load(out)
    assert 0 < peft["trainable"] < peft["all"] / 10
    assert trace.run["trainable_params"] == peft["trainable"] and trace.run["model_params"] == peft["all"]
    persistent = trace.run["deepspeed"]["stage3_persistent_numel"]
    from ddpscope.viz.sharded.deepspeed_states import compute_deepspeed_stages, measured_states

    for r, row in measured_states(trace).set_index("rank").iterrows():
        assert row["params_bytes"] == 4 * (own[r]["partition_numel"] + persistent), (r, row)
    colls = trace.shards.colls
    for (rank, step), c in colls.groupby(["rank", "step"]):  # the adapters' gradients, once a step
        assert abs(c[c["issued_by"] == "grad_bucket"]["bytes"].sum() - 4 * peft["trainable"]) <= PAD, (rank, step)
    table = compute_deepspeed_stages(trace)
    assert ((table["measured/predicted"].dropna() - 1).abs() < 0.05).all(), table
    said = run_cli("summary", str(out)).stdout
    assert f"{peft['all'] - peft['trainable']:,} of the {peft['all']:,} parameters are frozen" in said
