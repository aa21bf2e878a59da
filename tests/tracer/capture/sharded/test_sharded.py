"""Sharded training traced end to end: real 2-rank FSDP2 jobs on gloo (the user's own
torchtitan-style script, ``workers/fsdp2_train.py``), each checked against an
independent instrument: the untraced run (bit-identical parameters), PyTorch's own
``FSDPMemTracker`` on the same run, the model's shapes (padded shard and message
sizes), the ZeRO paper's formulas, and a rerun for every prediction."""

from __future__ import annotations

import gzip
import json
import math
import shutil

import pandas as pd
import pytest

from ddpscope.viz.run_files import TraceError, clock_alignment
from ddpscope.viz.sharded.comm_volume import comm_honesty_lines, compute_comm_volume
from ddpscope.viz.sharded.exposed import exposed_per_step, with_exposed
from ddpscope.viz.sharded.figures import make_sharded_timeline_figure
from ddpscope.viz.sharded.metrics import (
    compute_memory_over_step,
    compute_no_unit_table,
    compute_sharded_steps,
    compute_stage_comparison,
    compute_unit_table,
    sharded_step_noise_ms,
    stage_differences,
)
from ddpscope.viz.sharded.predict import compute_reshard_whatif, predict_memory, predict_peak, reshard_choices
from ddpscope.viz.sharded.profile_check import compute_sharded_profile_agreement
from ddpscope.viz.sources.run_profile import load_run_profile
from ddpscope.viz.trace import load_run
from tests.conftest import run_cli
from tests.tracer.capture.autotrace.test_autotrace import WORKERS, checks, trace_script, untraced

pytestmark = pytest.mark.ddp
SCRIPT = str(WORKERS / "fsdp2_train.py")
DIM, LAYERS, VOCAB, N = 64, 4, 256, 2


def _padded_bytes(shape: tuple[int, ...], item: int = 4) -> int:
    """A parameter's gathered bytes: FSDP pads dim 0 to a multiple of N."""
    rows = math.ceil(shape[0] / N) * N
    return rows * math.prod(shape[1:]) * item


def _expected_units(item: int = 4) -> dict[str, int]:
    block = [(DIM,), (DIM,), (4 * DIM, DIM), (4 * DIM,), (DIM, 4 * DIM), (DIM,)]
    root = [(VOCAB, DIM), (DIM,), (DIM,), (VOCAB, DIM)]
    units = {"(root)": sum(_padded_bytes(s, item) for s in root)}
    units.update({f"layers.{k}": sum(_padded_bytes(s, item) for s in block) for k in range(LAYERS)})
    return units


def assert_trained_alike(report, plain) -> None:
    """Every rank's final parameters and losses, traced (``report``) and untraced (``plain``), bit for bit."""
    for r in range(N):
        traced, base = (json.loads((d / f"rank{r}.json").read_text()) for d in (report, plain))
        assert traced["params_sha256"] == base["params_sha256"] and traced["losses"] == base["losses"]


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero3")
    proc, out, report = trace_script(tmp, SCRIPT, "--steps", "4", "--memtracker")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out, report


def test_traced_fsdp2_trains_bit_identically_and_is_cut_per_unit(zero3):
    tmp, out, report = zero3
    plain = untraced(tmp, SCRIPT, "--steps", "4", "--memtracker")
    assert_trained_alike(report, plain)
    trace = load_run(out)
    sh = trace.shards
    assert trace.run["kind"] == "sharded" and sh.stage == 3 and trace.status == "complete"
    assert dict(zip(sh.units["name"], sh.units["unsharded_bytes"])) == _expected_units()
    assert (trace.steps.groupby("rank").size() == 4).all()
    colls = sh.colls[sh.colls["step"] == 2]
    for name, nbytes in _expected_units().items():  # messages as the model's shapes say
        mine = colls[(colls["rank"] == 0) & (colls["name"] == name)]
        assert sorted(mine["collective"]) == ["all_gather", "all_gather", "reduce_scatter"]  # ZeRO-3: forward, backward
        assert (mine["bytes"] == nbytes).all()
        assert set(mine[mine["collective"] == "all_gather"]["phase"]) == {"forward", "backward"}
    assert (sh.colls[sh.colls["collective"] == "reduce_scatter"]["sent_as"] == "all_reduce").all()  # gloo
    # compute is cut per unit and never overlaps a collective on the training thread (gloo)
    table = compute_unit_table(trace)
    assert (table["forward_ms"] > 0).all() and (table["backward_ms"] > 0).all()
    steps = compute_sharded_steps(trace)
    real = steps[~steps["warmup"]]
    assert (real["compute_ms"] + real["all_gather_ms"] + real["reduce_scatter_ms"] <= real["step_ms"] + 1e-6).all()
    # the optimizer's step apart from them (FSDP2's units compute nothing in it), on the
    # Timeline's compute lanes as DDP's is: one bar a rank and step, its span
    assert (real["optimizer_ms"] > 0).all()
    assert (real["compute_ms"] + real["optimizer_ms"] + real["all_gather_ms"] + real["reduce_scatter_ms"]
            <= real["step_ms"] + 1e-6).all()
    (opt,) = [d for d in make_sharded_timeline_figure(trace, steps=[1, 2]).data if d.name == "optimizer.step"]
    spans = trace.steps[trace.steps["step"].isin([1, 2])]
    assert sorted(opt.x) == pytest.approx(sorted((spans["optimizer_end_us"] - spans["optimizer_start_us"]) / 1e3))
    # one definition of exposed: on gloo no unit's collectives run beside another's, so the
    # units' exposed parts of a step add up to the step's exposed communication
    colls = with_exposed(trace)
    per_unit = [exposed_per_step(colls[colls["unit"] == u], sh.waits[sh.waits["unit"] == u], sh.segments)
                for u in sh.units["unit"]]
    by_step = steps.set_index(["rank", "step"])["exposed_ms"]
    total = sum(per_unit).reindex(by_step.index)
    assert total.to_numpy() == pytest.approx(by_step.to_numpy(), abs=1e-6) and (by_step > 0).all()
    # and the unit table's exposed is that, per unit (median over non-warm-up steps and ranks),
    # not the sum of its parts' medians
    real_steps = set(real["step"])
    for u, name in zip(sh.units["unit"], sh.units["name"]):
        mine = per_unit[list(sh.units["unit"]).index(u)]
        mine = mine[mine.index.get_level_values("step").isin(real_steps)]
        assert table.set_index("unit").loc[name, "exposed_ms"] == pytest.approx(float(mine.median()), abs=1e-9)


def test_memory_by_category_agrees_with_fsdp_mem_tracker_and_the_zero_model(zero3):
    _, out, report = zero3
    trace = load_run(out)
    for r in range(N):
        tracker = json.loads((report / f"rank{r}.json").read_text())["memtracker"]["cpu"]
        mine = trace.shards.memory[trace.shards.memory["rank"] == r]
        assert mine["sharded_params_bytes"].max() == tracker["_FSDPRefType.SHARDED_PARAM"]
        assert mine["optimizer_state_bytes"].max() == tracker["_FSDPRefType.OPT"]
        # activations saved for backward are part of what the tracker calls activations; the
        # tracker also sees temporaries, which CPU has no counter for
        assert 0.5 * tracker["_FSDPRefType.ACT"] <= mine["activations_bytes"].max() <= tracker["_FSDPRefType.ACT"]
        assert 0.6 * tracker["Total"] <= mine["total_bytes"].max() <= tracker["Total"]
    cmp = compute_stage_comparison(trace)
    measured = cmp[cmp["rank"].notna()]
    assert ((measured["measured/predicted"] >= 1.0) & (measured["measured/predicted"] <= 1.05)).all()  # padding only
    stage3 = cmp[cmp["row"] == "stage 3"].iloc[0]
    assert stage3["params_bytes"] * N == pytest.approx(4 * trace.shards.units["numel"].sum())  # 4P/N, fp32
    samples = compute_memory_over_step(trace, 0)
    peak = samples[samples["peak"]].iloc[0]
    assert peak["total_bytes"] == samples["total_bytes"].max() and peak["phase"] in ("forward", "backward")
    # the gathered parameters split by unit: each unit holds its whole gathered size or nothing (True), a
    # unit resharded at its own forward's end and gathered from its backward's start to its end
    size = trace.shards.units.set_index("unit")["unsharded_bytes"].to_dict()
    for row in trace.shards.memory.itertuples():
        assert all(n == size[u] for u, n in row.unsharded_by_unit.items()), row
        if row.unit > 0 and row.phase == "forward" and row.at == "end":
            assert row.unit not in row.unsharded_by_unit, row
    # and the replay at the run's own settings is each sample as measured
    for r in range(N):
        replayed, measured = predict_memory(trace, r), compute_memory_over_step(trace, r)
        assert replayed["total_bytes"].tolist() == measured["total_bytes"].tolist()


@pytest.mark.parametrize("split, said", [
    ([[99, 1]], "unsharded_by_unit names unit 99"),
    ({"0": 1}, "is not a list of [unit, bytes] pairs"),
    ([[0, 1]], "adds up to 1 bytes, not the sample's"),
])
def test_a_damaged_split_of_the_gathered_bytes_is_one_line(zero3, tmp_path, split, said):
    _, out, _ = zero3
    folder = tmp_path / "run"
    shutil.copytree(out, folder, ignore=shutil.ignore_patterns("logs", "live"))
    events = json.loads((folder / "rank-1.json").read_text())  # a JSON array of events, as Perfetto reads it
    sample = next(e for e in events if e.get("cat") == "memory_sample" and e["args"]["unsharded_params_bytes"])
    sample["args"]["unsharded_by_unit"] = split
    (folder / "rank-1.json").write_text(json.dumps(events))
    with pytest.raises(TraceError) as e:
        load_run(folder)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_communication_volume_says_what_gloo_sent_and_what_a_ring_would(zero3):
    trace = load_run(zero3[1])
    vol = compute_comm_volume(trace).set_index("collective")
    d = sum(_expected_units().values())
    assert vol.attrs["D_bytes"] == d
    assert vol.loc["all_gather", "message_D"] == pytest.approx(2.0)  # forward and backward: ZeRO-3's 2 of 3D
    assert vol.loc["reduce_scatter", "ran_as"] == "all_reduce"
    assert vol.loc["reduce_scatter", "sent_D"] == pytest.approx(2 * (N - 1) / N)  # the whole gradient, all-reduced
    assert vol.loc["total", "ring_D"] == pytest.approx(3 * (N - 1) / N)  # the ZeRO model: 3D x (N-1)/N
    proc = run_cli("summary", str(zero3[1]))
    assert proc.returncode == 0 and "gloo has no reduce-scatter" in proc.stdout and "ZeRO stage 3" in proc.stdout
    assert proc.stdout.splitlines()[-1] == f"at another reshard_after_forward: `ddpscope whatif {zero3[1]}`"


def test_an_unshard_the_script_calls_before_forward_is_the_next_steps(zero3, tmp_path):
    """PyTorch's FSDP2 example calls ``model.unshard()`` before each forward: the root's
    forward all-gather runs between steps, issued by the script. It is the next step's,
    which starts at it, so each step gathers and reduces what the same script without the
    call does; an evaluation forward between steps (unsharded first too) is no step's.
    Training is the untraced run's, bit for bit. The example's own prefetching (two blocks
    ahead each way) is read from the units, and the what-if predicts at it."""
    args = ("--steps", "4", "--unshard-first", "--prefetch", "2,2")
    proc, out, report = trace_script(tmp_path, SCRIPT, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, SCRIPT, *args)
    assert_trained_alike(report, plain)

    def per_step(trace):  # from step 1: tracing attaches in the first forward, after the first unshard()
        c = trace.shards.colls[trace.shards.colls["step"] >= 1]
        return c.groupby(["rank", "step", "name", "collective", "phase"])["bytes"].agg(["size", "sum"])

    trace, base = load_run(out), load_run(zero3[1])
    assert per_step(trace).equals(per_step(base))
    # the root's parameters are named though FSDP's lazy init found them unsharded (it names sharded ones)
    assert trace.run["sharding"]["units"][0]["params"] == ["tok.weight", "norm.weight", "norm.bias", "out.weight"]
    c = trace.shards.colls
    early = c[(c["step"] >= 1) & (c["name"] == "(root)") & (c["phase"] == "forward")]
    assert len(early) == N * 3
    steps = trace.steps.set_index(["rank", "step"])
    for _, g in early.iterrows():
        step = steps.loc[(g["rank"], g["step"])]
        assert g["start_us"] == pytest.approx(step["start_us"], abs=1e-3) and g["end_us"] <= step["forward_start_us"]
    waits = trace.shards.waits
    assert ((waits["unit"] == 0) & (waits["phase"] == "forward") & (waits["step"] >= 1)).sum() == N * 3
    # the script's prefetch, as the units ran it: the what-if's measured row and its predictions (which
    # a rerun with --reshard-after-forward alone keeps) are at it; FSDP's defaults where the script set none
    sharding = trace.run["sharding"]
    assert (sharding["forward_prefetch"], sharding["backward_prefetch"]) == (2, 2)
    assert (base.run["sharding"]["forward_prefetch"], base.run["sharding"]["backward_prefetch"]) == (0, 1)
    ahead = trace.shards.colls
    ahead = ahead[(ahead["step"] >= 1) & (ahead["collective"] == "all_gather") & ahead["prefetch"]]
    assert set(ahead["phase"]) == {"forward", "backward"}
    table = compute_reshard_whatif(trace)
    assert set(zip(table["forward_prefetch"], table["backward_prefetch"])) == {(2, 2)}
    assert (compute_reshard_whatif(trace, [{"reshard_after_forward": False, "forward_prefetch": 0}])
            .query("predicted")[["forward_prefetch", "backward_prefetch"]].drop_duplicates().values.tolist() == [[0, 2]])


@pytest.mark.breadth  # ~30 s; the default suite keeps a clipped FSDP2 run, profiled (test_sharded_view.py)
def test_the_gradient_norms_and_the_scripts_all_reduce_are_collectives_of_no_unit(zero3, tmp_path):
    """``clip_grad_norm_`` over FSDP2's DTensor gradients all-reduces their norms (DTensor's
    functional collective), and the script all-reduces its loss (``dist.all_reduce``), both
    after backward, before the optimizer step. Each is a collective of no unit in its step,
    named for who issued it, with its bytes, exposed whole (no unit computes beside it);
    FSDP's own collectives are the run's without them, none counted twice; the volume
    leaves them out and says them; torch.profiler on the same run (an instrument apart)
    ran each on gloo's thread inside the span we gave it, with our bytes; training is the
    untraced run's, bit for bit."""
    args = ("--steps", "4", "--clip", "1.0", "--loss-allreduce")
    proc, out, report = trace_script(tmp_path, SCRIPT, *args, ddpscope=("--profile", "--profile-steps", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, SCRIPT, *args)
    assert_trained_alike(report, plain)
    for r in range(N):
        traced, base = (json.loads((d / f"rank{r}.json").read_text()) for d in (report, plain))
        assert traced["norms"] == base["norms"] and traced["loss_means"] == base["loss_means"]
        assert len(traced["norms"]) == 4

    def per_step(colls):
        return colls.groupby(["rank", "step", "name", "collective", "phase"])["bytes"].agg(["size", "sum"])

    trace, base = load_run(out), load_run(zero3[1])
    c = trace.shards.colls
    assert per_step(c[c["unit"] >= 0]).equals(per_step(base.shards.colls))
    own = c[c["unit"] == -1]
    params = sum(len(u["params"]) for u in trace.run["sharding"]["units"])
    assert params == 4 + LAYERS * 6
    line = next(k for k, text in enumerate(open(SCRIPT).read().splitlines(), 1) if "dist.all_reduce(mean)" in text)
    script_, clip = f"all_reduce (the script, fsdp2_train.py:{line})", \
        "all_reduce (torch.nn.utils.clip_grad._get_total_norm)"
    assert sorted(own.groupby("by").size().items()) == [(script_, N * 4), (clip, N * 4)]
    assert (own["collective"] == "all_reduce").all() and (own["issued_by"] == "other").all()
    assert set(own[own["by"] == script_]["bytes"]) == {4}  # a float32 loss: the script's own count
    # DTensor stacks each parameter's partial norm (float32) and all-reduces the stack
    assert set(own[own["by"] == clip]["bytes"]) == {4 * params}
    steps = trace.steps.set_index(["rank", "step"])
    segs = trace.shards.segments
    for _, g in own.iterrows():
        step = steps.loc[(g["rank"], g["step"])]
        assert step["backward_end_us"] <= g["start_us"] <= g["end_us"] <= step["optimizer_start_us"]
        mine = segs[(segs["rank"] == g["rank"]) & (segs["step"] == g["step"])]
        assert not ((mine["start_us"] < g["end_us"]) & (mine["end_us"] > g["start_us"])).any()
    table = compute_unit_table(trace).set_index("unit")
    assert table.loc["(no unit)", "all_reduces"] == 2 and table.loc["(no unit)", "all_reduce_bytes"] == \
        4 + 4 * params
    assert table.loc["(no unit)", "exposed_ms"] == pytest.approx(table.loc["(no unit)", "all_reduce_ms"], rel=1e-6)
    assert table.loc["(no unit)", "exposed_ms"] > 0
    # the row broken down by who issued each: one a step each, with its bytes, exposed whole
    parts = compute_no_unit_table(trace).set_index("by")
    assert parts[["collective", "count", "bytes"]].to_dict("index") == {
        script_: {"collective": "all_reduce", "count": 1, "bytes": 4},
        clip: {"collective": "all_reduce", "count": 1, "bytes": 4 * params}}
    assert parts["exposed_ms"].to_numpy() == pytest.approx(parts["ms"].to_numpy(), rel=1e-6)
    assert compute_comm_volume(trace)["message_bytes"].tolist() == compute_comm_volume(base)["message_bytes"].tolist()
    agree = compute_sharded_profile_agreement(trace, load_run_profile(trace))
    mine = agree[agree["unit"] == -1]
    assert len(mine) == N * 2 * 2 and mine["profile_bytes"].notna().all(), agree  # 2 profiled steps, 2 a step
    assert (mine["profile_bytes"] == mine["tracer_bytes"]).all() and (mine["collective"] == "allreduce").all()
    assert (mine["start_after_ms"] >= 0).all() and (mine["end_before_ms"] >= 0).all(), mine
    said = [t for t in comm_honesty_lines(trace) if t.startswith("Besides FSDP's own")]
    assert said == [f"Besides FSDP's own, {4 + 4 * params} bytes a step in collectives no "
                    f"unit issued, not counted above: {script_} (1 a step), {clip} (1 a step)."]


def test_rerun_with_reshard_false_is_stage_2_as_predicted(zero3, tmp_path):
    _, out, _ = zero3
    proc, out2, _ = trace_script(tmp_path, SCRIPT, "--steps", "4", ddpscope=("--reshard-after-forward", "false",
                                                                          "--grad-marks-every", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = load_run(out), load_run(out2)
    assert any("--grad-marks-every applies to DDP" in n for n in second.run["notes"])  # a DDP flag: said, not used
    assert second.shards.stage == 2
    assert not second.shards.units[~second.shards.units["root"]]["reshard_after_forward"].any()
    bwd = second.shards.colls[(second.shards.colls["collective"] == "all_gather")
                              & (second.shards.colls["phase"] == "backward") & (second.shards.colls["step"] > 0)]
    assert set(bwd["name"]) <= {"(root)"}  # the blocks stay gathered from forward to backward
    predicted = predict_peak(first, reshard_after_forward=False)
    measured = predict_peak(second)  # its own settings: the measured peak
    err = (predicted["predicted_peak_bytes"] / measured["measured_peak_bytes"] - 1).abs()
    assert (err <= 0.05).all(), (predicted, measured)
    assert (predicted["predicted_peak_bytes"] > predicted["measured_peak_bytes"]).all()  # ZeRO-2 holds more
    # `ddpscope whatif` prints the Run page's predictions, every choice, from the same functions:
    # its row for false is this prediction, its first row the run as measured
    proc = run_cli("whatif", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    rows = pd.DataFrame(body["settings"])
    assert body["step_noise_ms"] == sharded_step_noise_ms(first)
    assert rows[~rows["predicted"]]["reshard_after_forward"].unique().tolist() == ["true"]
    assert rows[~rows["predicted"]].set_index("rank")["peak_bytes"].to_dict() == \
        predicted.set_index("rank")["measured_peak_bytes"].to_dict()
    cli = rows[rows["predicted"] & (rows["reshard_after_forward"] == "false")].set_index("rank")["peak_bytes"]
    assert cli.to_dict() == predicted.set_index("rank")["predicted_peak_bytes"].to_dict()
    assert set(rows[rows["predicted"]]["reshard_after_forward"]) == {"true", "false"}  # 2 ranks: no hybrid
    steps = rows[rows["predicted"] & (rows["reshard_after_forward"] == "false")]["step_ms"]
    assert (steps < rows[~rows["predicted"]]["step_ms"].to_numpy()).all()  # no backward all-gathers on gloo


def test_whatif_prints_each_setting_and_refuses_flags_the_run_does_not_take(zero3, capsys):
    """The table: the run as measured, then each setting the flags name; and one line, exit
    2, for a flag that is not this run's (in-process: the parser and the dispatch are the
    command's)."""
    from ddpscope.cli.main import main

    out = str(zero3[1])
    assert main(["whatif", out, "--reshard-after-forward", "FALSE", "--forward-prefetch", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "FSDP2, ZeRO stage 3" in lines[0]
    measured, predicted = lines[2].split(), lines[3].split()
    assert measured[:4] == ["measured", "true", "0", "1"] and predicted[:4] == ["predicted", "false", "1", "1"]
    trace = load_run(out)
    peak = predict_peak(trace, reshard_after_forward=False, forward_prefetch=1).set_index("rank")
    assert float(predicted[4]) == round(peak.loc[0, "predicted_peak_bytes"] / 2**20, 3)
    # the settings a rerun can take: 2 ranks hold no hybrid N (FSDP2 reads 2 as true)
    assert lines[-1].startswith("rerun one: `ddpscope run --nproc 2 --reshard-after-forward true|false --out DIR -- ")
    # where the script sets it: the script trained its FSDP2 model itself (no framework on the stack)
    assert trace.run["fsdp_trained_by"] == {"framework": "script"}
    assert lines[-2] == "  in your code: fully_shard(module, reshard_after_forward=True|False|N) for each unit"
    assert f"{SCRIPT} --steps 4 --memtracker --report" in lines[-1]  # the run's own line, its script's arguments
    # a run that measured no memory: its peak column reads "-", and says why
    import argparse
    from dataclasses import replace

    from ddpscope.cli.sharded_whatif import sharded_whatif

    blind = replace(trace, shards=replace(trace.shards, memory=trace.shards.memory.iloc[0:0]), cache={})
    args = argparse.Namespace(json=False, caps=None, cap_list=None, reshard_after_forward=None,
                              forward_prefetch=None, backward_prefetch=None)
    assert sharded_whatif(blind, args) == 0
    text = capsys.readouterr().out
    assert "no peak is predicted" in text and text.splitlines()[2].split()[4:6] == ["-", "-"]
    assert "step resharded to N ranks" not in text  # 2 ranks: no N to reshard to
    # the step's noise, said beside the predictions: this run's (3 real steps), and unknown from one
    noise = sharded_step_noise_ms(trace)
    assert 0 < noise < float(compute_sharded_steps(trace)["step_ms"].max())
    assert f"noise: a predicted step within ±{noise:.1f} ms of this run's cannot be told from it" in text
    one = replace(trace, steps=trace.steps.assign(warmup=trace.steps["step"] != trace.steps["step"].max()), cache={})
    assert sharded_whatif(one, args) == 0
    assert "noise: this run has fewer than 2 real steps" in capsys.readouterr().out
    for flags, said in ((["--caps", "1"], "--caps sets a bucket size"),
                        (["--cap-list", "1,2"], "--cap-list is DDP's"),
                        (["--reshard-after-forward", "2"], "on a run whose units are sharded over 2 ranks is true or false"),
                        (["--reshard-after-forward", "maybe"], "--reshard-after-forward takes true, false"),
                        (["--backward-prefetch", "0"], "--backward-prefetch must be in 1..64"),
                        (["--apply"], "--apply reruns DDP runs")):
        assert main(["whatif", out, *flags]) == 2, flags
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and said in err, (flags, err)


@pytest.mark.breadth
def test_a_rerun_resharded_to_n_ranks_is_fully_shards_own_and_peaks_where_predicted(tmp_path):
    """reshard_after_forward=2 on 4 ranks (each rank keeps a 1/2 shard of every block from
    forward to backward): ``--reshard-after-forward 2`` over a script that sets True trains
    bit-identically to the script setting 2 in ``fully_shard`` itself, and holds the same
    bytes at every sample but the root's (the flag leaves the root as the script set it: True
    here, 2 there); the kept shards are measured (FSDP keeps them outside
    all_gather_outputs); the peak predicted from the True run (its CLI row too) is the one
    measured, to the byte, and back."""
    script = (SCRIPT, "--steps", "3")
    runs = {}
    for name, extra, flags in (("own2", ("--reshard", "2"), ()), ("true", (), ()),
                               ("over2", (), ("--reshard-after-forward", "2"))):
        proc, out, report = trace_script(tmp_path, *script, *extra, ddpscope=("--nproc", "4", *flags), name=name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (load_run(out), report)
    own, over, true = runs["own2"][0], runs["over2"][0], runs["true"][0]
    for r in range(4):
        a, b = (json.loads((runs[k][1] / f"rank{r}.json").read_text()) for k in ("own2", "over2"))
        assert a["params_sha256"] == b["params_sha256"] and a["losses"] == b["losses"]
    blocks = own.shards.units[~own.shards.units["root"]]
    assert set(blocks["reshard_after_forward"]) == {2} == set(over.shards.units[~over.shards.units["root"]][
        "reshard_after_forward"])
    held = {k: compute_memory_over_step(t, 0).set_index("where")["unsharded_params_bytes"]
            for k, t in (("own2", own), ("over2", over))}
    root = int(own.shards.units[own.shards.units["root"]]["unsharded_bytes"].sum())
    differ = (held["own2"] - held["over2"])[lambda d: d != 0]
    assert differ.to_dict() == {"(root) forward end": root // 2, "(root) backward start": root // 2}
    # between forward and backward each rank keeps half of every block
    assert held["over2"]["(root) backward start"] == blocks["unsharded_bytes"].sum() // 2
    predicted = predict_peak(true, reshard_after_forward=2).set_index("rank")["predicted_peak_bytes"]
    assert predicted.to_dict() == predict_peak(over).set_index("rank")["measured_peak_bytes"].to_dict()
    back = predict_peak(over, reshard_after_forward=True).set_index("rank")["predicted_peak_bytes"]
    assert back.to_dict() == predict_peak(true).set_index("rank")["measured_peak_bytes"].to_dict()
    assert (predicted > back).all()  # the kept halves
    said = run_cli("whatif", str(runs["true"][0].path), "--json")
    assert said.returncode == 0, said.stderr
    rows = pd.DataFrame(json.loads(said.stdout)["settings"])
    assert set(rows[rows["predicted"]]["reshard_after_forward"]) == {"true", "false", "2"}  # 4 ranks: the hybrid
    row = rows[rows["predicted"] & (rows["reshard_after_forward"] == "2")].set_index("rank")["peak_bytes"]
    assert row.to_dict() == predicted.to_dict()
    # its step is true's, and the text says so (docs/sharded.md has the reruns behind it)
    steps = rows[rows["predicted"]].pivot(index="rank", columns="reshard_after_forward", values="step_ms")
    assert (steps["2"] == steps["true"]).all()
    text = run_cli("whatif", str(runs["true"][0].path)).stdout
    assert "step resharded to N ranks: as true's" in text


def test_accumulation_and_mixed_precision_are_traced(tmp_path):
    proc, out, _ = trace_script(tmp_path, SCRIPT, "--steps", "3", "--accum", "2", "--bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = load_run(out)
    assert (trace.steps["micro_batches"] == 2).all()
    assert trace.run["sharding"]["param_dtype"] == "bfloat16"
    colls = trace.shards.colls
    ag = colls[(colls["collective"] == "all_gather") & (colls["name"] == "layers.0")]
    assert (ag["bytes"] == _expected_units(item=2)["layers.0"]).all()  # gathered in bf16
    rs = colls[(colls["collective"] == "reduce_scatter") & (colls["rank"] == 0)].groupby("step").size()
    assert (rs == len(_expected_units())).all()  # one reduction per unit per step: the last micro-batch's
    # each collective in D of its own dtype: gathered in bf16, reduced in fp32 (twice the bytes)
    vol = compute_comm_volume(trace).set_index("collective")
    assert trace.run["sharding"]["reduce_dtype"] == "float32"
    assert vol.attrs["D_reduce_bytes"] == 2 * vol.attrs["D_bytes"]
    assert vol.loc["all_gather", "message_D"] == pytest.approx(2 * 2)  # ZeRO-3: forward and backward, per micro-batch
    assert vol.loc["reduce_scatter", "message_D"] == pytest.approx(1.0)  # once, the last micro-batch's
    assert vol.loc["total", "ring_D"] == pytest.approx(5 * (N - 1) / N)
    assert any("Mixed precision" in line for line in comm_honesty_lines(trace))
    said = [line for line in comm_honesty_lines(trace) if line.startswith("A step here is 2 micro-batches")]
    assert len(said) == 1 and "reduced 1.00 times a step" in said[0] and "4.00 D of parameters gathered" in said[0]


def test_a_loss_that_runs_its_own_backward_inside_forward_is_backward(tmp_path):
    """torchtitan's chunked loss: ``norm`` and the head are one unit; the head runs per
    chunk, each chunk's ``backward()`` inside the loss call (no pre-backward hook of FSDP's
    for chunks 2..N). Its compute and its reduce-scatter are backward, as autograd says;
    the body's backward stays the body's; training is bit-identical."""
    args = ("--steps", "3", "--chunked-loss", "4")
    proc, out, report = trace_script(tmp_path, SCRIPT, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, SCRIPT, *args)
    assert_trained_alike(report, plain)
    sh = load_run(out).shards
    head = int(sh.units.loc[sh.units["name"] == "norm, out", "unit"].iloc[0])
    colls = sh.colls[sh.colls["step"] >= 1]
    assert set(colls[colls["collective"] == "reduce_scatter"]["phase"]) == {"backward"}
    for (rank, step), s in sh.segments[sh.segments["step"] >= 1].groupby(["rank", "step"]):
        assert (s[s["unit"] == head]["phase"] == "backward").sum() >= 4, (rank, step)  # each chunk's, not chunk 1's
        assert ((s["unit"] == 0) & (s["phase"] == "backward")).any()  # the embedding's backward is the root's
    # the script's own clock around each chunk's backward() (rank 0: the trace's clock, offset 0):
    # the head's compute inside it is booked as backward, never as forward
    head0 = sh.segments[(sh.segments["rank"] == 0) & (sh.segments["unit"] == head)]
    calls = json.loads((report / "rank0.json").read_text())["chunk_backward_us"]
    assert len(calls) == 3 * 4
    over = []
    for a, b in calls:
        inside = head0.assign(us=lambda d: (d["end_us"].clip(upper=b) - d["start_us"].clip(lower=a)).clip(lower=0))
        fwd, bwd = (inside[(inside["phase"] == ph) & (inside["us"] > 0)] for ph in ("forward", "backward"))
        if fwd["us"].sum() > 0.05 * (b - a) + 20:
            over.append((a, b, fwd["us"].sum()))
        assert len(bwd), (a, b, inside)
        # what is booked forward inside the call comes before its backward began, never after
        assert not len(fwd) or fwd["end_us"].max() <= bwd["start_us"].min() + 1, (a, b, inside)
    # a thread of the tracer's (its writer, its live file) may take the GIL between the
    # script's clock and the first hook inside backward() (75.8 µs of a 792 µs call seen once
    # in CI): a few chunks of the 12 may show it; the head's backward booked as forward would
    # show in every one
    assert len(over) <= 3, over


def test_meta_device_initialisation_is_traced(tmp_path):
    proc, out, _ = trace_script(tmp_path, SCRIPT, "--steps", "3", "--meta-init")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_run(out).shards.stage == 3


@pytest.mark.breadth  # ~20 s each; the FSDP2 tracer's other real jobs stay in the default suite
@pytest.mark.parametrize("hsdp", [(), ("--hsdp",)], ids=["fsdp", "hsdp"])
def test_hooks_are_gone_when_the_trace_closes(tmp_path, hsdp):
    proc, _, report = trace_script(tmp_path, str(WORKERS / "fsdp_hooks_check.py"), *hsdp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, str(WORKERS / "fsdp_hooks_check.py"), *hsdp)
    for r in range(N):
        traced, base = (json.loads((d / f"rank{r}.json").read_text()) for d in (report, plain))
        assert traced["during"][0] == ["post_backward", "pre_forward"]  # it was traced
        assert traced["stand_in_during"] == bool(hsdp)  # HSDP's all-reduce timed through a stand-in
        assert traced["collectives_dist_is_torch"]  # and torch.distributed again after
        assert traced["backward_call_patched_during"] and traced["backward_call_is_torch"]  # torch's own again
        during = ("during", "stand_in_during", "backward_call_patched_during")
        assert {k: v for k, v in traced.items() if k not in during} == {k: v for k, v in base.items() if k not in during}


@pytest.mark.parametrize("flags, said", [
    (("--mix-ddp",), "the script mixes DDP and FSDP"),
    (("--fsdp1",), "FSDP1 (FullyShardedDataParallel) is not traced"),
])
def test_setups_ddpscope_does_not_trace_are_named_and_train_on(tmp_path, flags, said):
    proc, out, report = trace_script(tmp_path, SCRIPT, "--steps", "3", *flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert said in proc.stderr and "Traceback" not in proc.stderr
    assert all((report / f"rank{r}.json").exists() for r in range(N))  # it trained to its end
    assert any(said in n for n in json.loads((out / "run.json").read_text())["notes"])


def test_units_that_differ_between_ranks_are_named(tmp_path):
    proc, out, _ = trace_script(tmp_path, SCRIPT, "--steps", "2", "--differ", ddpscope=("--timeout", "60"))
    assert "the FSDP units differ between ranks" in proc.stderr  # then FSDP's own collectives fail, untraced
    assert "Traceback" not in proc.stderr.split("ddpscope run:")[-1]


@pytest.mark.failures
def test_a_hang_inside_a_unit_is_named_by_the_watchdog(tmp_path):
    proc, out, _ = trace_script(tmp_path, SCRIPT, "--steps", "5", "--hang", "1:2:1",
                                ddpscope=("--hang-timeout", "4", "--timeout", "90"))
    assert proc.returncode != 0
    assert "rank 1: step 2, forward of unit layers.1" in proc.stderr
    assert "all-gather of unit layers.2 (forward)" in proc.stderr  # where rank 0 waits for it
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and run["failure"]["hung"]
    # the steps that finished before the hang are kept, though the ranks were killed: the
    # live file's thread wrote the steps the recorder held for its next batch
    steps = load_run(out).steps
    assert {r: sorted(set(steps[steps["rank"] == r]["step"]) & {0, 1}) for r in range(N)} == {0: [0, 1], 1: [0, 1]}


@pytest.mark.frameworks
def test_lightning_model_parallel_strategy_fsdp2_is_traced_bit_identical(tmp_path):
    """Lightning's ModelParallelStrategy (FSDP2 applied in configure_model) on CPU: traced per
    unit, one step per optimizer step (Lightning steps with a closure), weights unchanged."""
    script = str(WORKERS / "lightning_fsdp2.py")
    proc, out, report = trace_script(tmp_path, script, "--steps", "4", name="lightning-fsdp2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, script, "--steps", "4")
    for r in range(N):
        assert checks(report)[r] == checks(plain)[r]  # the same weights, and global_step 4
    trace = load_run(out)
    assert trace.status == "complete" and trace.shards.stage == 3
    assert list(trace.shards.units["name"]) == ["(root)", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert trace.steps.groupby("rank").size().to_dict() == {0: 4, 1: 4}
    colls = trace.shards.colls
    per_step = colls[(colls["rank"] == 0) & (colls["collective"] == "all_gather")].groupby("step").size()
    assert (per_step == 1 + 2 * 4).all()  # the root kept gathered for backward; each block gathered twice


@pytest.mark.breadth
def test_hsdp_all_reduce_across_replicas_is_timed_apart(tmp_path):
    """HSDP on 4 ranks (2 replicas of 2 shards): each unit's gradient shard is all-reduced
    across replicas after its reduce-scatter; timed on its own, counted in D, and the
    model states set beside ZeRO with N = the shard group."""
    args = (SCRIPT, "--steps", "3", "--hsdp", "2")
    proc, out, report = trace_script(tmp_path, *args, ddpscope=("--nproc", "4"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = untraced(tmp_path, *args, nproc=4)
    for r in range(4):
        traced, base = (json.loads((d / f"rank{r}.json").read_text()) for d in (report, plain))
        assert traced["params_sha256"] == base["params_sha256"]
    trace = load_run(out)
    units = trace.shards.units
    assert (units["shard_size"] == 2).all() and (units["replicate_size"] == 2).all()
    colls = trace.shards.colls
    expected = _expected_units()  # the model's shapes, padded to the shard group of 2
    ar = colls[colls["collective"] == "all_reduce"]
    assert len(ar) == 4 * 3 * len(expected)  # every rank, step and unit
    assert all(b == expected[n] // 2 for n, b in zip(ar["name"], ar["bytes"]))  # this rank's fp32 gradient shard
    rs = colls[colls["collective"] == "reduce_scatter"].set_index(["rank", "step", "unit"])
    for row in ar.itertuples():  # after its own unit's reduce-scatter
        assert row.start_us >= rs.loc[(row.rank, row.step, row.unit), "end_us"] - 1.0
    vol = compute_comm_volume(trace).set_index("collective")
    assert vol.loc["all_reduce", "message_D"] == pytest.approx(0.5)  # D / S
    assert vol.loc["total", "ring_D"] == pytest.approx(3 * 1 / 2 + 2 * 1 / 2 * 0.5)  # ZeRO-3 in S = 2, + replicas
    stages = compute_stage_comparison(trace)
    measured = stages[stages["rank"].notna()]
    assert ((measured["measured/predicted"] - 1).abs() < 0.05).all()  # N = 2, not 4
    assert any("HSDP: 2 replicas of 2 ranks" in line for line in stage_differences(trace))
    # a rerun resharding to N ranks needs N a factor of the shard group below it: none here (2 is True),
    # though 2 divides the world; `whatif` refuses it in one line and its rerun line offers true|false
    assert reshard_choices(trace) == [True, False]
    proc = run_cli("whatif", str(out), "--reshard-after-forward", "2")
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "--reshard-after-forward on a run whose units are sharded over 2 ranks is true or false "
        "(FSDP2 takes N as a factor of them between 2 and 2 - 1: there is none), got 2"), proc.stderr
    proc = run_cli("whatif", str(out))
    assert proc.returncode == 0 and "--reshard-after-forward true|false --out DIR" in proc.stdout, proc.stdout


def test_shard_groups_of_one_rank_are_ddp_by_fsdp2_stage_0(tmp_path):
    """HSDP with a shard dimension of 1 (2 replicas of 1 rank: torchtitan's
    ``data_parallel_shard_degree 1``, DDP done by FSDP2): nothing is sharded, so FSDP2
    runs no all-gather and no reduce-scatter (torch's ``foreach_reduce`` copies the
    gradient on a group of one) and all-reduces each unit's whole fp32 gradient. The run is
    stage 0, its volume DDP's (2D x (N-1)/N), its model states the ZeRO model's at N = 1;
    training bit-identical to the untraced run's."""
    args = (SCRIPT, "--steps", "3", "--hsdp", "2")
    proc, out, report = trace_script(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_trained_alike(report, untraced(tmp_path, *args))
    run = json.loads((out / "run.json").read_text())
    assert run["sharding"]["stage"] == 0 and run["sharding"]["reduce_scatter_sent_as"] is None
    assert "nothing is sharded" in run["sharding"]["stage_reason"] and "2 replicas" in run["sharding"]["stage_reason"]
    trace = load_run(out)
    units = trace.shards.units
    assert trace.shards.stage == 0 and (units["shard_size"] == 1).all() and (units["replicate_size"] == 2).all()
    colls = trace.shards.colls
    own = colls[colls["unit"] >= 0]
    assert set(own["collective"]) == {"all_reduce"}  # no all-gather, no reduce-scatter on a group of one
    # and no wait for one: a unit's wait_for_unshard is the copy-in of its parameters, its own compute
    assert trace.shards.waits.empty and (compute_sharded_steps(trace)["wait_ms"] == 0).all()
    whole = dict(zip(units["name"], units["numel"] * 4))  # each unit's fp32 gradient, unpadded (S = 1)
    assert len(own) == N * 3 * len(units) and all(b == whole[n] for n, b in zip(own["name"], own["bytes"]))
    vol = compute_comm_volume(trace).set_index("collective")
    assert vol.loc["all_reduce", "message_D"] == pytest.approx(1.0)
    assert vol.loc["total", "ring_D"] == pytest.approx(2 * (N - 1) / N)  # DDP's
    lines = comm_honesty_lines(trace)
    assert not any("gloo has no reduce-scatter" in line for line in lines)
    assert any("Shard groups of 1 rank" in line and "DDP's volume" in line for line in lines)
    stages = compute_stage_comparison(trace).set_index("row")
    for r in range(N):  # every rank holds whole model states: the ZeRO model at N = 1, stage 0's
        assert stages.loc[f"measured (rank {r})", "measured/predicted"] == pytest.approx(1.0, rel=0.01)
    assert stages.loc["stage 0", "model_state_bytes"] == stages.loc["stage 3", "model_state_bytes"]
    assert any("shard groups of 1 rank (2 replicas): nothing is sharded" in line for line in stage_differences(trace))
    # FSDP2 copies a unit in at its own wait on a group of one, so its backward prefetch
    # allocates nothing early: the replay at the run's own settings is every sample measured
    assert trace.shards.backward_prefetch in (None, 1)  # FSDP's default: one unit ahead in backward
    for r in range(N):
        measured, replayed = compute_memory_over_step(trace, r), predict_memory(trace, r)
        assert len(measured) > 2 * len(units)
        assert replayed["unsharded_params_bytes"].tolist() == measured["unsharded_params_bytes"].tolist()
    # a trace that says stage 0 of units sharded over 2 ranks contradicts itself: refused in one line
    for u in run["sharding"]["units"]:
        u["shard_size"] = 2
    (out / "run.json").write_text(json.dumps(run))
    said = (r"malformed sharded trace \(ValueError: sharding.stage 0 \(nothing sharded\) "
            r"but units are sharded over 2 ranks\)$")
    with pytest.raises(ValueError, match=said):
        load_run(out)


def test_collective_bytes_match_the_profilers_allocations_on_the_same_run(tmp_path):
    """torch.profiler (``ddpscope run --profile``, with its memory events) on the same run:
    every all-gather and reduce-scatter we timed on a profiled step holds an allocation
    the profiler saw, of exactly the bytes we recorded, inside the span we timed."""
    proc, out, _ = trace_script(tmp_path, SCRIPT, "--steps", "4", ddpscope=("--profile", "--profile-steps", "2"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    trace = load_run(out)
    meta = trace.ranks[0]
    assert meta["profile"]["status"] == "saved"
    raw = json.loads(gzip.open(out / meta["profile"]["file"]).read())
    base_us, offset = raw["baseTimeNanoseconds"] / 1e3, meta["profile"]["unix_minus_host_us"]
    align = clock_alignment(meta)
    allocs = [(align(e["ts"] + base_us - offset), e["args"]["Bytes"]) for e in raw["traceEvents"]
              if e.get("name") == "[memory]" and e["args"]["Bytes"] > 0]
    colls = trace.shards.colls
    profiled = colls[(colls["rank"] == 0) & colls["step"].isin([1, 2])]
    assert set(profiled["collective"]) == {"all_gather", "reduce_scatter"} and len(profiled) >= 2 * 2 * 5
    for c in profiled.itertuples():
        assert any(c.start_us - 5 <= ts <= c.end_us + 5 and b == c.bytes for ts, b in allocs), \
            f"{c.collective} of {c.name} (step {c.step}, {c.bytes} bytes): no such allocation in the profile"
