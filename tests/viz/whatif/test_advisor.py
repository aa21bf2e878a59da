"""The bucket advisor: the lists it writes build the layouts it claims (DDP's own
bucketing), its recommendations on traces with known answers, the noise rule, the
``whatif`` output's shape, ``--apply`` rerunning for real, and the A/B tables."""

from __future__ import annotations

import inspect
import json
import shutil
from dataclasses import replace

import numpy as np
import pytest

from ddpscope.tracer.launch.jobs import JobManager
from ddpscope.tracer.launch.rerun import rerun_settings
from ddpscope.tracer.launch.runner import RunConfig
from ddpscope.viz.ddp.overlap import compute_step_breakdown
from ddpscope.viz.trace import load_run
from ddpscope.viz.whatif.ab import compute_ab_steps, compute_bucket_ab, compute_bucket_timing, make_ab_timeline_figure
from ddpscope.viz.whatif.advisor import advise, list_for_layout, setting_text, step_noise_ms
from ddpscope.viz.whatif.cost import AllReduceCost
from ddpscope.viz.whatif.model import WhatIfModel
from ddpscope.viz.whatif.search import LayoutSearch
from ddpscope.viz.whatif.simulate import predict_run
from tests.conftest import SAMPLES, run_cli
from tests.viz.whatif.test_whatif import MIB, model, synthetic


def test_a_written_list_builds_exactly_its_layout_with_ddps_bucketing():
    """Random parameter sizes, random partitions of the ready order: the list written for
    each, put through DDP's ``compute_bucket_assignment_by_size``, gives that partition."""
    rng = np.random.default_rng(1)
    t = synthetic()
    search = LayoutSearch(t, model())
    for _ in range(300):
        n = int(rng.integers(1, 30))
        search.sizes = [int(x) * 4 for x in rng.integers(1, 2**20, n)]
        search.dtypes, search.order = ["float32"] * n, [int(i) for i in rng.permutation(n)]
        k = int(rng.integers(0, n))
        cuts = sorted(set(int(c) for c in rng.integers(1, n, k))) if n > 1 else []
        layout = [search.order[a:b] for a, b in zip([0, *cuts], [*cuts, n])]
        cap = list_for_layout(search, layout)
        assert cap is not None and search.layout(cap) == layout
        assert all(c == round(c, 6) for c in cap)  # short decimals, not bytes / 2**20 to 15 digits


def test_one_bucket_after_backward_gets_split_and_the_gain_is_the_exposed_tail():
    """Traced as one bucket (every all-reduce after backward), at 2 ns a byte and no
    steal: smaller buckets hide all but the last one's all-reduce; identical steps: no
    noise, so the change is worth it."""
    t = synthetic(bucket_of=[0, 0, 0, 0])
    t.run["bucket_cap_mb"] = 100.0
    a = advise(t, model(latency_us=100.0, us_per_byte=2e-3))
    assert a.change and a.noise_ms == 0.0 and a.buckets >= 2
    one = 100.0 + MIB * 2e-3  # one parameter's all-reduce, µs
    assert a.gain_ms == pytest.approx((4 * MIB * 2e-3 + 100.0 - one) / 1e3, abs=0.05)
    assert a.interval_ms == (a.gain_ms, a.gain_ms)
    j = a.as_json()
    assert j["change"] and j["step_ms"] == pytest.approx(a.step_ms) and j["traced"] == {"bucket_cap_mb": 100.0}
    assert ("bucket_cap_mb" in j) != ("bucket_cap_mb_list" in j)
    assert a.candidates["label"].is_unique and a.searched["uniform"] == 12


def test_no_communication_means_no_change():
    t = synthetic(bucket_of=[0, 0, 0, 0])
    t.run["bucket_cap_mb"] = 100.0
    a = advise(t, model())
    assert not a.change and a.setting == 100.0 and "no change is worth it" in a.why


def test_a_gain_inside_the_noise_changes_nothing():
    """The same trace with one step in three 40 ms slower: the noise outgrows the gain."""
    t = synthetic(bucket_of=[0, 0, 0, 0], steps=6)
    t.run["bucket_cap_mb"] = 100.0
    slow = t.steps["step"] % 3 == 0
    t.steps.loc[slow, "end_us"] += 40e3
    assert step_noise_ms(t) > 5
    a = advise(t, model(latency_us=100.0, us_per_byte=2e-3))
    assert a.gain_ms > 0 and not a.change and "inside the noise" in a.why and a.setting == 100.0
    assert a.best != 100.0  # what was found is still said


def test_local_search_beats_every_uniform_cap_and_growing_list_where_one_exists():
    """Five parameters of uneven sizes (1.3, 0.9, 3.6, 3.2, 0.6 MiB) ready at 9, 13, 21,
    24 and 29 ms, all-reduces of 3 ms + 4 ms/MiB one at a time (found by a random search
    over such traces): no uniform cap and no growing list cuts them as well as a
    per-bucket layout, which the advisor finds, recommends (more than 0.5 % faster) and
    writes as a list that builds it."""
    t = synthetic(ready_ms=(9, 13, 21, 24, 29), bucket_of=[0] * 5)
    t.run["bucket_cap_mb"] = 100.0
    t.run["param_bytes"] = [n * 4096 for n in (335, 238, 914, 821, 143)]
    m = model(latency_us=3e3, us_per_byte=4e3 / MIB)
    a = advise(t, m)
    c = a.candidates
    local = c[c["kind"] == "per-bucket list"]["step_ms"].min()
    assert local < 0.99 * c[c["kind"] != "per-bucket list"]["step_ms"].min()
    assert len(a.best) > 1 and a.change
    for row in c.itertuples():  # every candidate's setting builds as many buckets as it says
        assert len(predict_run(t, row.setting, m).run["bucket_layout"]) == row.buckets


@pytest.mark.breadth  # a real job (~19 s); the recommendation's apply path stays in the default suite
def test_whatif_json_carries_the_recommendation():
    proc = run_cli("whatif", str(SAMPLES / "gpt-2rank-cap25mb"), "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    rec = out["recommended"]
    assert rec["change"] and ("bucket_cap_mb" in rec) != ("bucket_cap_mb_list" in rec)
    assert rec["step_ms"] < rec["traced_step_ms"] and len(rec["gain_interval_ms"]) == 2
    lo, hi = rec["gain_interval_ms"]
    assert lo < rec["gain_ms"] < hi and rec["noise_ms"] > 0
    assert set(rec["searched"]) == {"uniform", "growing list", "per-bucket list"}
    assert out["candidates"] and {"kind", "setting", "buckets", "step_ms", "within_noise"} <= set(out["candidates"][0])
    caps = {c["bucket_cap_mb"]: c["step_ms"] for c in out["caps"] if c["bucket_cap_mb_list"] is None}
    uniform = [c for c in out["candidates"] if c["kind"] == "uniform"]
    assert uniform
    for c in uniform:  # one replay, one number
        assert c["step_ms"] == pytest.approx(caps[float(c["setting"].split("=")[1])], rel=1e-9)
    assert all("within_noise" in c for c in out["caps"])
    assert out["all_reduce_cost"]["calibrated"] and out["all_reduce_cost"]["latency_fitted"]
    mlp = json.loads(run_cli("whatif", str(SAMPLES / "mlp-2rank-cap1mb"), "--json").stdout)
    keep = mlp["recommended"]
    assert not keep["change"] and keep["bucket_cap_mb"] == 1.0 and "no change" in keep["why"]
    # its buckets all of one size, no calibration: a line through the origin, and the advice says what that hides
    cost = mlp["all_reduce_cost"]
    assert not cost["latency_fitted"] and not cost["calibrated"] and cost["latency_us"] == 0
    assert "fewer, larger buckets may be faster than predicted" in keep["why"]


def test_apply_with_nothing_to_change_reruns_nothing(tmp_path):
    run = tmp_path / "mlp"
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", run)
    proc = run_cli("whatif", str(run), "--apply")
    assert proc.returncode == 0 and "nothing rerun" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlp"]


@pytest.mark.parametrize("extra, change, message", [
    (["--json"], None, "leave out --json"),
    ([], {"model": "not-a-demo"}, "does not say which script ran"),
    ([], {"nnodes": 2, "nproc_per_node": 1}, "real nodes"),
])
def test_apply_refuses_with_one_line(tmp_path, extra, change, message):
    run = tmp_path / "gpt"
    shutil.copytree(SAMPLES / "gpt-2rank-cap25mb", run)
    if change:
        r = json.loads((run / "run.json").read_text())
        r.update(change)
        (run / "run.json").write_text(json.dumps(r))
    proc = run_cli("whatif", str(run), "--apply", *extra)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, \
        proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt"]


@pytest.mark.ddp
def test_apply_reruns_with_the_recommendation_and_prints_a_b(tmp_path):
    """The GPT sample traced at 25 MiB (one bucket after backward): the recommendation is
    rerun for real (the demo, 2 ranks, the sample's 12 steps); B's run.json has the
    setting and where it came from; the A/B tables are printed."""
    run, out = tmp_path / "gpt", tmp_path / "b"
    shutil.copytree(SAMPLES / "gpt-2rank-cap25mb", run)
    rec = json.loads(run_cli("whatif", str(run), "--json").stdout)["recommended"]
    proc = run_cli("whatif", str(run), "--apply", "--apply-out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    b = load_run(out)
    assert b.status == "complete" and b.run["steps"] == 12 and b.world_size == 2
    if "bucket_cap_mb_list" in rec:
        assert b.run["bucket_cap_bytes_list"] == [int(c * MIB) for c in rec["bucket_cap_mb_list"]]
    else:
        assert b.run["bucket_cap_mb"] == pytest.approx(rec["bucket_cap_mb"], rel=1e-6)
    assert b.run["advice"]["from"] == str(run.resolve())
    assert b.run["advice"]["predicted_step_ms"] == pytest.approx(rec["step_ms"])
    text = proc.stdout
    assert "B predicted" in text and "exposed_ms A" in text and "measured: B" in text
    assert "over every step" in text and "B - A lo" in text  # the measured gain with its interval
    assert len(b.run["bucket_layout"]) >= 2  # the recommendation split the traced single bucket
    assert "layouts: A 1 bucket, B " in text


def test_a_b_steps_carry_the_measured_differences_interval():
    a, b = load_run(SAMPLES / "gpt-2rank-cap1mb"), load_run(SAMPLES / "gpt-2rank-cap25mb")
    steps = compute_ab_steps(a, b, b).set_index("median")
    for k, row in steps.iterrows():
        assert row["B - A lo"] <= row["B - A measured"] <= row["B - A hi"], k
        assert row["within noise"] == (row["B - A lo"] <= 0 <= row["B - A hi"])


def test_a_b_tables_and_the_diff_timeline():
    a = synthetic(bucket_of=[0, 0, 0, 0], comm_ms=8.0)
    b = synthetic(comm_ms=2.0)
    t = compute_bucket_timing(a)
    # one bucket: launched at 40 ms (the last gradient), 8 ms in flight, all of it after backward
    assert t[["launch_ms", "flight_ms", "exposed_ms"]].iloc[0].tolist() == pytest.approx([40.0, 8.0, 8.0])
    tb = compute_bucket_timing(b)
    assert tb["exposed_ms"].sum() == pytest.approx(2.0)  # the buckets' exposed parts add up to the wait
    ab = compute_bucket_ab(a, b)
    assert list(ab["bucket"]) == [0, 1, 2, 3] and ab["mib A"].isna().sum() == 3
    steps = compute_ab_steps(a, b, b).set_index("median")
    assert steps.loc["step_ms", "error %"] == 0 and steps.loc["exposed_ms", "B - A measured"] == pytest.approx(-6.0)
    fig = make_ab_timeline_figure({"A": a, "B": b})
    assert {"A: all-reduce", "B: all-reduce", "A: exposed", "B: exposed"} <= {d.name for d in fig.data}


def test_the_buckets_exposed_parts_add_up_to_the_steps_exposed_communication():
    """A backward span that runs on past its last gradient (DDP's finalize waiting for the
    all-reduces inside autograd, as seen in the wild): each bucket's exposed part is cut
    at backward compute's end, as the step's exposed communication is, so a step's buckets
    add up to it, and the backward drawn is compute."""
    t = synthetic(bucket_of=[0, 0, 1, 1], comm_ms=8.0, finalize_ms=1.0)
    stretch = {k: getattr(t, k).assign(compute_end_us=getattr(t, k)["backward_end_us"],
                                       backward_end_us=getattr(t, k)["sync_end_us"]) for k in ("steps", "passes")}
    t = replace(t, **stretch, cache={})
    per = compute_bucket_timing(t, per_step=True)
    sums = per.groupby(["rank", "step"]).agg(exposed_ms=("exposed_ms", "sum"), backward_ms=("backward_ms", "first"))
    steps = compute_step_breakdown(t).set_index(["rank", "step"]).loc[sums.index]
    assert len(sums) == 2 * 3 and (steps["exposed_ms"] > 5).all()
    assert sums["exposed_ms"].to_numpy() == pytest.approx(steps["exposed_ms"].to_numpy())
    assert (sums["backward_ms"] == 40.0).all()  # compute: the span's 9 ms of waiting is not in it
    assert compute_bucket_timing(t)["exposed_ms"].sum() == pytest.approx(steps["exposed_ms"].median())
    # predicted at 1 MiB with a steal (all-reduces beside compute make it longer): the
    # prediction's backward is its own compute, from its start to its compute end
    pred = predict_run(t, 1, model(latency_us=4e3, steal_us_per_allreduce=2e3, steal_us_per_mib=1e3))
    ps = pred.steps.set_index(["rank", "step"])
    drawn = compute_step_breakdown(pred).set_index(["rank", "step"])["backward_ms"].loc[ps.index]
    assert ps["compute_end_us"].to_numpy() == pytest.approx(ps["backward_end_us"].to_numpy())
    assert drawn.to_numpy() == pytest.approx(((ps["compute_end_us"] - ps["backward_start_us"]) / 1e3).to_numpy())
    assert (drawn > 40.5).all()


def test_rerun_settings_follow_run_json():
    base = {"kind": "ddp", "nproc_per_node": 2, "world_size": 4, "nnodes": 2, "steps_requested": 20,
            "demo": "mlp", "emulation": {"nodes": 2, "link": "200mbit"}}
    assert rerun_settings(base) == {"nproc": 2, "steps": 20, "emulate_nodes": 2, "link": "200mbit", "demo": "mlp"}
    marked = rerun_settings({**base, "grad_marks_every": 4})  # a rerun marks gradients as the run did
    assert marked["grad_marks_every"] == 4
    inspect.signature(JobManager.start).bind(None, bucket_cap_mb=None, **marked)  # the page's rerun takes them ...
    assert RunConfig(out="/tmp/never-made", **marked).grad_marks_every == 4  # ... and so does whatif --apply
    for bad in (0, -2, "4", True, 2.5):
        assert "grad_marks_every" not in rerun_settings({**base, "grad_marks_every": bad})
    with pytest.raises(ValueError, match="fsdp2 run"):
        rerun_settings({**base, "kind": "fsdp2"})
    with pytest.raises(ValueError, match="folder .* is gone"):
        rerun_settings({"kind": "ddp", "script": {"argv": ["t.py"], "cwd": "/nonexistent/x"}})


@pytest.mark.breadth  # a real job (~26 s): the default suite keeps the apply/rerun path
def test_what_turning_find_unused_parameters_off_would_give_is_predicted_only_where_it_would_do(tmp_path):
    """A script that sets ``find_unused_parameters=True`` though every parameter is used
    (Hugging Face Trainer's default case): the advisor predicts the run with the flag off,
    where DDP rebuilds in gradient-ready order; that predicted layout is the one DDP builds
    in a real run without the flag. Where a parameter really is unused, no such prediction,
    and the unused ones are named."""
    from ddpscope.viz.whatif.advisor import unused_parameters
    from ddpscope.viz.whatif.simulate import predict_layout
    from tests.tracer.capture.autotrace.test_autotrace import USER, trace_script

    base = (USER, "--steps", "4", "--depth", "4", "--width", "256", "--bucket-cap-mb", "0.5")
    runs = {}
    for name, flags in [("flag", ("--find-unused-flag-only",)), ("none", ()), ("unused", ("--find-unused",))]:
        proc, out, _ = trace_script(tmp_path, *base, *flags, name=name)
        assert proc.returncode == 0, proc.stderr
        runs[name] = load_run(out)
    flagged = runs["flag"]
    assert flagged.run["find_unused_parameters"] is True and unused_parameters(flagged) == []
    advice = advise(flagged, local_budget=0)
    off = advice.flag_off
    assert off is not None and off.flag == "find_unused_parameters=False"
    assert "find_unused_parameters=False would do" in advice.as_json()["flag_off"]["text"]
    # the layout it predicts with the flag off, at the traced cap: DDP's own without the flag
    unflagged = {**flagged.run, "find_unused_parameters": False}
    from dataclasses import replace

    assert sorted(map(sorted, predict_layout(replace(flagged, run=unflagged), 0.5))) == \
        sorted(map(sorted, runs["none"].run["bucket_layout"]))
    assert sorted(map(sorted, predict_layout(flagged, 0.5))) == sorted(map(sorted, flagged.run["bucket_layout"]))
    unused = runs["unused"]
    assert advise(unused, local_budget=0).flag_off is None
    assert [n.split(".")[-2:] for n in unused_parameters(unused)] == [["unused_head", "weight"], ["unused_head", "bias"]]
    out = run_cli("whatif", str(flagged.path))
    assert out.returncode == 0 and "  flag: every parameter had its gradient in every traced step" in out.stdout
    # and where the script turns it off: its own DDP(...) line
    from pathlib import Path

    line = next(i for i, t in enumerate(Path(USER).read_text().splitlines(), 1) if "ddp = DDP(model, **kw)" in t)
    said = f"; in your code: DistributedDataParallel(..., find_unused_parameters=False) at user_train.py:{line}"
    assert off.in_code == said[2:] and said in out.stdout


@pytest.mark.parametrize("sample", ["mlp-2rank-cap1mb", "gpt-2rank-cap25mb"])
def test_every_candidate_step_is_the_tables_for_that_setting(sample):
    """One replay, one number: the advisor's step for a setting is the sweep table's (both
    replay every usable step), and so is its recommendation's and the traced setting's; a
    row within the noise of the fastest is marked the same way in both."""
    from ddpscope.viz.whatif.advisor import mark_within_noise
    from ddpscope.viz.whatif.sweep import DEFAULT_CAPS, _medians, compute_cap_sweep

    trace = load_run(SAMPLES / sample)
    sweep = compute_cap_sweep(trace, DEFAULT_CAPS)
    advice = advise(trace, sweep.attrs["model"], local_budget=20)
    sweep = mark_within_noise(sweep, advice.noise_ms)
    table = {(float(r.bucket_cap_mb), bool(r.traced)): float(r.step_ms) for r in sweep.itertuples()}
    cands = advice.candidates
    uniform = cands[cands["kind"] == "uniform"]
    assert len(uniform) >= len(DEFAULT_CAPS) - 1  # one may be the traced row (deduplicated by label)
    for r in uniform.itertuples():
        assert r.step_ms == pytest.approx(table[(float(r.setting), float(r.setting) == advice.traced)], rel=1e-9)
    traced = float(sweep[sweep["traced"]]["step_ms"].iloc[0])
    assert float(cands[cands["kind"] == "traced"]["step_ms"].iloc[0]) == pytest.approx(traced, rel=1e-9)
    assert advice.traced_step_ms == pytest.approx(traced, rel=1e-9)
    best = cands[cands["label"] == setting_text(advice.best)]
    replayed = _medians(predict_run(trace, advice.best, sweep.attrs["model"]))["step_ms"]
    assert float(best["step_ms"].iloc[0]) == pytest.approx(replayed, rel=1e-9)
    for frame in (cands, sweep):
        assert (frame["within_noise"] == (frame["step_ms"] - frame["step_ms"].min() <= advice.noise_ms)).all()
    assert sweep["within_noise"].any() and not sweep["within_noise"].all()


def test_more_buckets_are_not_recommended_on_a_cost_with_no_measured_fixed_part():
    """One bucket after backward, split, gains its exposed tail on a line of 2 ns a byte.
    Where that line went through the origin because nothing measured a fixed cost per
    all-reduce (one bucket size, no calibration), each added bucket's fixed cost is missing
    from the gain: the advisor keeps the setting, says why and what measures it. Measured
    as 0 µs by a calibration, the same numbers recommend the split."""
    t = synthetic(bucket_of=[0, 0, 0, 0])
    t.run["bucket_cap_mb"] = 100.0
    bare = WhatIfModel(cost=AllReduceCost(latency_us=0.0, us_per_byte=2e-3, latency_fitted=False))
    a = advise(t, bare)
    assert not a.change and a.setting == 100.0 and a.best != 100.0 and a.gain_ms > 1.0
    assert "until a fixed cost per all-reduce is measured" in a.why and "ddpscope calibrate" in a.why
    assert f"{a.gain_ms:.1f} ms faster a step with {len(predict_run(t, a.best, bare).run['bucket_layout']) - 1} more" \
        in a.why
    measured = advise(t, replace(bare, cost=replace(bare.cost, latency_fitted=True)))
    assert measured.change and measured.gain_ms == pytest.approx(a.gain_ms)
    # kept for no gain: fewer, larger buckets, predicted too slow on such a line, may still be faster
    keep = advise(t, WhatIfModel(cost=AllReduceCost(latency_us=0.0, us_per_byte=1e-12, latency_fitted=False)))
    assert not keep.change and "layouts of fewer, larger buckets may be faster than predicted" in keep.why
    assert "may be faster" not in advise(t, model()).why


def test_a_gain_that_needs_an_unmeasured_steal_of_zero_changes_nothing():
    """The steal not measured (CPU, no calibration, no fit: ``steal_max_us_per_mib``):
    one bucket after backward, split, gains its exposed tail only if the all-reduces
    beside backward take none of its compute; at the bound (each takes all it overlaps:
    2.2 ms a MiB at 2 ns a byte) splitting gains nothing. The advisor keeps the setting
    and says both ends; with a bound too small to matter it recommends the split."""
    t = synthetic(bucket_of=[0, 0, 0, 0])
    t.run["bucket_cap_mb"] = 100.0
    flight = 100.0 + MIB * 2e-3  # µs a 1 MiB all-reduce is in flight
    a = advise(t, model(latency_us=100.0, us_per_byte=2e-3, steal_max_us_per_mib=flight))
    assert not a.change and a.setting == 100.0 and a.best != 100.0
    assert a.gain_ms > 1.0 and a.gain_if_overlap_lost_ms is not None and a.gain_if_overlap_lost_ms <= 0.05
    assert "until communication's cost to backward is measured" in a.why and "ddpscope calibrate" in a.why
    assert a.as_json()["gain_if_overlap_lost_ms"] == a.gain_if_overlap_lost_ms
    small = advise(t, model(latency_us=100.0, us_per_byte=2e-3, steal_max_us_per_mib=1.0))
    assert small.change and small.gain_ms == pytest.approx(a.gain_ms)
    assert small.gain_if_overlap_lost_ms == pytest.approx(small.gain_ms, abs=0.05)
    measured = advise(t, model(latency_us=100.0, us_per_byte=2e-3))  # steal measured: no bound, no check
    assert measured.change and measured.gain_if_overlap_lost_ms is None
