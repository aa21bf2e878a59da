"""Sharded runs on the dashboard (dashboard/sharded_view.py) with AppTest: real FSDP2 and
DeepSpeed ZeRO runs opened on their Timeline, Memory, What-if and Run pages."""

from __future__ import annotations

import json
import shutil

import pytest
from streamlit.testing.v1 import AppTest

from ddpscope.dashboard.sharded_view import AS_THE_SCRIPT
from ddpscope.viz.sharded.deepspeed_buckets import predict_deepspeed_step_ms, reductions
from ddpscope.viz.sharded.metrics import (
    NO_UNIT,
    compute_memory_over_step,
    compute_sharded_steps,
    sharded_step_noise_ms,
)
from ddpscope.viz.sharded.trace import real_steps
from ddpscope.viz.trace import load_run
from tests.conftest import ROOT, run_cli
from tests.dashboard.app_driver import (
    chart_spec,
    chart_specs,
    metric_value,
    open_page,
    open_traced,
    wait_for_job,
)


@pytest.mark.ddp
def test_a_sharded_run_opens_on_its_timeline_memory_and_rerun_pages(tmp_path, monkeypatch):
    """A user's FSDP2 run (traced and profiled here): the Timeline draws units against all-gather and
    reduce-scatter lanes (and the gradient norm's all-reduce, of no unit: the script clips) and sets each
    collective beside the profiler's, the Memory page opens on it, the Run page predicts a rerun."""
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS

    at, out = open_traced(tmp_path, monkeypatch, str(WORKERS / "fsdp2_train.py"), "--steps", "4", "--prefetch", "2,1",
                          "--clip", "1.0", name="fsdp2", ddpscope=("--profile", "--profile-steps", "2"))
    assert at.sidebar.selectbox(key="trace").value == "run: fsdp2"  # the user's newest run
    assert metric_value(at, "ZeRO stage") == "3" and metric_value(at, "FSDP units") == "5"
    spec = chart_spec(at)
    ticks = spec["layout"]["yaxis"]["ticktext"]
    assert ticks[:3] == ["rank 0 · compute", "rank 0 · all-gather", "rank 0 · reduce-scatter"]
    assert {"layers.0", "waiting for an all-gather"} <= {t["name"] for t in spec["data"]}
    units = next(d.value for d in at.dataframe if "all_gather_ms" in d.value.columns)
    assert list(units["unit"]) == ["(root)", "layers.0", "layers.1", "layers.2", "layers.3", NO_UNIT]
    assert units.set_index("unit").loc[NO_UNIT, "all_reduces"] == 1
    (norm,) = [t for t in spec["data"] if "torch.nn.utils.clip_grad._get_total_norm" in (t.get("hovertemplate") or "")]
    assert norm["name"] == NO_UNIT
    assert any(c.value.startswith("Grey: collectives no unit issued") for c in at.caption)
    no_unit = next(d.value for d in at.dataframe if "by" in d.value.columns)  # that row, by who issued it
    assert no_unit[["by", "count"]].values.tolist() == [["all_reduce (torch.nn.utils.clip_grad._get_total_norm)", 1]]
    assert any("gloo has no reduce-scatter" in m.value for m in at.markdown)
    # profiled: each collective beside the profiler's, in the expander (2 steps x 2 ranks x 16)
    agreement = next(d.value for d in at.dataframe if "start_after_ms" in d.value.columns)
    assert len(agreement) == 2 * 2 * 16 and agreement["profile_bytes"].notna().all()
    open_page(at, "What-if")  # not a dead end: where its own settings are predicted
    assert not at.exception and any("sharded run (FSDP2)" in i.value and "Run page" in i.value
                                    and "`ddpscope whatif " in i.value for i in at.info)
    open_page(at, "Memory (ZeRO)")
    titles = [json.dumps(c["layout"].get("title")) for c in chart_specs(at)]
    assert any("memory over one step (measured)" in t for t in titles)
    assert any("beside ZeRO stages 0-3" in t for t in titles)
    open_page(at, "Run")
    # on the prefetch the units ran with (the script's own, two blocks ahead in forward): a rerun keeps it
    assert (at.slider(key="run_fwd_prefetch").value, at.slider(key="run_bwd_prefetch").value) == (2, 1)
    assert metric_value(at, "predicted peak (rank 0)").endswith("MiB")
    deltas = {m.label: m.delta for m in at.metric if m.label.startswith("predicted")}
    assert deltas == {"predicted peak (rank 0)": "as this run", "predicted step (rank 0)": "as this run"}  # not "+0.0"
    same = [m.proto for m in at.metric if m.label.startswith("predicted")]
    assert all(p.direction == p.MetricDirection.NONE for p in same)  # gray and with no arrow: nothing went up
    step = next(m for m in at.metric if m.label == "predicted step (rank 0)")
    noise = sharded_step_noise_ms(load_run(out))  # the run's step noise, said where the step is predicted
    assert step.help.startswith(f"Inside this run's noise (±{noise:.1f} ms)")
    at.selectbox(key="run_reshard").set_value("false (ZeRO-2)").run()
    assert not at.exception
    peak = next(m for m in at.metric if m.label == "predicted peak (rank 0)")
    assert peak.delta.startswith("+") and peak.delta.endswith(" MiB")  # units kept gathered: a larger peak
    assert at.button(key="run_button").label == "Rerun with reshard_after_forward = false"
    # where the script sets it (the script itself trained the model): the CLI's line
    assert "In your code: fully_shard(module, reshard_after_forward=True|False|N) for each unit." in \
        [c.value for c in at.caption]
    open_page(at, "Compare runs")  # like with like: the DDP sample is not set beside the FSDP2 run
    at.multiselect(key="compare_runs").set_value(["run: fsdp2", "sample: gpt-2rank-cap1mb"]).run()
    assert not at.exception
    assert any(w.value.startswith("sample: gpt-2rank-cap1mb not compared with run: fsdp2") for w in at.warning)
    assert not any("buckets differ" in i.value for i in at.info)
    # beside another sharded run (a copy: the pair is the point), each says the setting its units ran
    # with, though the script set it and no rerun asked for one
    again = shutil.copytree(out, out.parent / "fsdp2-again")
    try:
        at.run()
        at.multiselect(key="compare_runs").set_value(["run: fsdp2", "run: fsdp2-again"]).run()
        table = next(d.value for d in at.dataframe if "reshard_after_forward" in d.value.columns)
        assert list(table["reshard_after_forward"]) == ["true", "true"] and list(table["stage"]) == [3, 3]
    finally:
        shutil.rmtree(again)
    for r in (0, 1):  # the same run without its memory samples: the Run page says what it cannot predict
        path = out / f"rank-{r}.json"
        text = path.read_text()
        doc = json.loads(text if text.rstrip().endswith("]") else text + "]")
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        kept = [e for e in events if e.get("cat") != "memory_sample"]
        path.write_text(json.dumps({"traceEvents": kept} if isinstance(doc, dict) else kept))
        (out / f"rank-{r}.summary.jsonl").unlink(missing_ok=True)
    at = open_page(AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run(), "Run")
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert any("measured no step's memory" in i.value for i in at.info)
    for r in (0, 1):  # ... and without any step (killed in its first): every page opens, none raises
        path = out / f"rank-{r}.json"
        doc = json.loads(path.read_text())
        events = doc["traceEvents"] if isinstance(doc, dict) else doc
        kept = [e for e in events if e.get("ph") == "M"]
        path.write_text(json.dumps({"traceEvents": kept} if isinstance(doc, dict) else kept))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    said = [e.value for e in at.error] + [i.value for i in at.info] + [w.value for w in at.warning]
    assert not at.exception, said
    for page in ("Run", "What-if", "Memory (ZeRO)", "Compare runs"):
        open_page(at, page)
        assert not at.exception, (page, said)
    assert any("no finished step" in text for text in said), said  # the Timeline says why it draws nothing


@pytest.mark.ddp
def test_the_run_page_opens_on_the_setting_each_run_ran_with(tmp_path, monkeypatch):
    """A script's own reshard_after_forward, not the first choice: a ZeRO-2 run (false) opens on
    false, predicted as itself; a run whose units differ (the last block kept, torchtitan's
    way) on "as the script sets it", a rerun with no override; each when it is opened, after another."""
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS, trace_script

    script = (str(WORKERS / "fsdp2_train.py"), "--steps", "4")
    at, out = open_traced(tmp_path, monkeypatch, *script, "--reshard", "mixed", name="mixed")
    proc, _, _ = trace_script(out.parent, *script, "--reshard", "false", name="zero2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    at.run()  # the list of traces now holds it

    def run_page(trace: str) -> tuple[str, dict, str]:
        at.sidebar.selectbox(key="trace").set_value(trace).run()
        open_page(at, "Run")
        assert not at.exception, at.exception
        deltas = {m.label: m.delta for m in at.metric if m.label.startswith("predicted")}
        return at.selectbox(key="run_reshard").value, deltas, at.button(key="run_button").label

    same = {"predicted peak (rank 0)": "as this run", "predicted step (rank 0)": "as this run"}
    assert run_page("run: zero2") == ("false (ZeRO-2)", same, "Rerun with reshard_after_forward = false")
    at.selectbox(key="run_reshard").set_value("true (ZeRO-3)").run()
    assert run_page("run: mixed") == (AS_THE_SCRIPT, same, "Rerun as the script sets it")
    at.selectbox(key="run_reshard").set_value("true (ZeRO-3)").run()
    deltas = {m.label: m.delta for m in at.metric if m.label.startswith("predicted")}
    assert deltas["predicted step (rank 0)"] != "as this run"  # its last block gathered again for backward
    assert at.button(key="run_button").label == "Rerun with reshard_after_forward = true"
    assert run_page("run: zero2")[0] == "false (ZeRO-2)"  # opened again: on its own setting


@pytest.mark.deepspeed
def test_a_deepspeed_run_opens_on_its_timeline_memory_and_rerun_pages(tmp_path, monkeypatch):
    """A user's DeepSpeed ZeRO-2 run (traced here): the Timeline names DeepSpeed and draws
    its bucket all-reduces and the gather after the step, with the bucket table; the
    Memory page sets it beside the stages and DeepSpeed's estimators; the Run page offers
    another stage with its predicted model states."""
    pytest.importorskip("deepspeed")
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS

    at, out = open_traced(tmp_path, monkeypatch, str(WORKERS / "deepspeed_train.py"), "--stage", "2", "--steps", "3",
                           "--reduce-bucket-size", "20000", name="ds2", env={"DS_ACCELERATOR": "cpu"})
    assert at.sidebar.selectbox(key="trace").value == "run: ds2"
    assert metric_value(at, "ZeRO stage") == "2" and metric_value(at, "DeepSpeed units") == "4"
    model = json.loads((out / "run.json").read_text())["model_class"]
    assert any(m.value.startswith(f"**Model** `{model}`") for m in at.markdown)
    spec = chart_spec(at)
    assert spec["layout"]["title"]["text"].startswith("DeepSpeed, ZeRO stage 2")
    buckets = next(d.value for d in at.dataframe if "first_param" in d.value.columns)
    assert list(buckets["bucket"]) == [0, 1, 2] and set(buckets["collective"]) == {"all_reduce"}
    # buckets of 20,000 fp32 elements (a parameter larger than that is a bucket of its own: 256 KiB)
    # read in KiB, not 0.0xx MiB
    assert "MiB" not in buckets.columns and 1 < buckets["KiB"].min() <= buckets["KiB"].max() < 1024
    # what no unit issued, grey on the Timeline, by who issued it: the gather after the step first
    assert any(c.value.startswith("Grey: collectives no unit issued (DeepSpeed's gathers") for c in at.caption)
    no_unit = next(d.value for d in at.dataframe if "by" in d.value.columns)
    assert "ZeRO's gather of the updated partitions after the step" in set(no_unit["by"])
    assert any(t["name"].endswith(NO_UNIT) and "gather of the updated partitions" in (t.get("hovertemplate") or "")
               for t in spec["data"])
    assert any("3D x (N-1)/N for a step that reduces once" in m.value for m in at.markdown)
    open_page(at, "What-if")
    said = next(i.value for i in at.info if "sharded run (DeepSpeed)" in i.value)
    assert "ZeRO stage" in said and "reduce_bucket_size's peak memory and step time" in said
    assert not any("replayed with the buckets DDP would build" in c.value for c in at.caption)  # not of this run
    open_page(at, "Memory (ZeRO)")
    table = next(d.value for d in at.dataframe if "persistent measured/predicted" in d.value.columns)
    assert {"measured (rank 0)", "stage 3", "DeepSpeed estimate (stage 2)"} <= set(table["row"])
    assert any("DeepSpeed's estimator says" in m.value for m in at.markdown)
    open_page(at, "Run")
    at.selectbox(key="run_zero_stage").set_value(3).run()
    assert not at.exception
    assert at.button(key="run_button").label == "Rerun at ZeRO stage 3"
    states = next(d.value for d in at.dataframe if "persistent_mib" in d.value.columns)
    assert list(states[""]) == ["this run (stage 2, rank 0)", "stage 3, predicted"]
    # MiB, as its header says: the model states are a few MiB here, not a few bytes
    config = json.loads(next(d for d in at.dataframe if "persistent_mib" in d.value.columns).proto.columns)
    assert config["persistent_mib"]["label"] == "persistent (MiB)" and 0.1 < states["persistent_mib"].iloc[0] < 100
    # the peak at another reduce_bucket_size (its exactness: tests/viz/sharded/test_deepspeed_peak.py)
    peak = next(m for m in at.metric if m.label == "predicted peak at stage 2 (rank 0)")
    assert peak.delta == "as this run" and peak.value.endswith(" MiB")
    assert any("hold no bucket, so the peak they read stays" in c.value for c in at.caption)  # stage 2: said why
    # and the step there, from the buckets re-cut (its exactness against reruns: test_deepspeed_peak.py)
    step = next(m for m in at.metric if m.label == "predicted step at stage 2 (rank 0)")
    assert step.delta == "as this run" and step.value.endswith(" ms")
    at.select_slider(key="run_ds_cap").set_value(16.0).run()
    assert at.button(key="run_button").label == "Rerun at ZeRO stage 3, reduce_bucket_size 16 MiB"
    # the config's value for it: 16 MiB of fp32 gradients (the run's own 20,000 elements are 80,000 bytes)
    assert ("In your code: the DeepSpeed config's zero_optimization.reduce_bucket_size = 4194304 (16 MiB in elements "
            "of float32).") in [c.value for c in at.caption]
    assert not any("no peak is predicted" in i.value or "no step is predicted" in i.value for i in at.info)
    trace = load_run(out)
    want = predict_deepspeed_step_ms(trace, 16.0).iloc[0]
    change = round(want["predicted_step_ms"] - want["measured_step_ms"], 1)  # 0 where the run's line has no fixed cost
    step = next(m for m in at.metric if m.label == "predicted step at stage 2 (rank 0)")
    assert step.value == f"{want['predicted_step_ms']:.1f} ms"
    assert step.delta == (f"{change:+.1f} ms" if change else "as this run")
    noise = sharded_step_noise_ms(trace)  # a change within the run's noise is drawn gray, and said
    assert step.help.startswith("Inside" if abs(change) <= noise else "Beyond") and f"(±{noise:.1f} ms)" in step.help
    assert (step.proto.color == step.proto.MetricColor.GRAY) == (abs(change) <= noise)
    # the cost line under it is the one `ddpscope whatif` prints (its fixed cost and where it came from)
    said = run_cli("whatif", str(out), "--json")
    assert said.returncode == 0, said.stderr
    words = json.loads(said.stdout)["bucket_cost"]
    assert words and any(f"for their size, {words}: a model" in c.value for c in at.caption), words

    # rerun there at its own stage from the page: what it predicted, set beside what the rerun measured
    at.selectbox(key="run_zero_stage").set_value(2).run()
    shown = next(m for m in at.metric if m.label == "predicted step at stage 2 (rank 0)").value
    at.slider(key="run_steps").set_value(3)
    at.button(key="run_button").click().run()
    wait_for_job(at, timeout=240)
    reruns = [p for p in out.parent.iterdir() if p != out and (p / "run.json").exists()]
    assert len(reruns) == 1, reruns
    rerun = load_run(reruns[0])
    assert rerun.run["deepspeed"]["reduce_bucket_bytes"] == 16 * 2**20 and rerun.shards.stage == 2
    check = next(d.value for d in at.dataframe if "error_pct" in d.value.columns).set_index("quantity")
    assert list(check.index) == ["buckets a step", "step (ms)", "peak (MiB)"]
    assert any("(ZeRO stage 2, reduce_bucket_size 16 MiB; rank 0)" in m.value for m in at.markdown)
    # buckets and peak: replayed exactly, against the rerun's own reductions and memory samples
    mine = reductions(rerun)
    per_step = mine[mine["rank"] == 0].groupby("step").size().median()
    assert check.loc["buckets a step", "predicted"] == check.loc["buckets a step", "measured"] == per_step == 1
    peak = compute_memory_over_step(rerun, 0)["total_bytes"].max() / 2**20
    assert check.loc["peak (MiB)", "measured"] == pytest.approx(peak, abs=0.005)
    assert check.loc["peak (MiB)", "predicted"] == pytest.approx(peak, abs=0.005)
    # the step: the one the page showed before the rerun (to its 0.1 ms), beside the rerun's median step
    assert check.loc["step (ms)", "predicted"] == pytest.approx(want["predicted_step_ms"], abs=0.0051)
    assert shown == f"{want['predicted_step_ms']:.1f} ms"
    steps = compute_sharded_steps(rerun)
    steps = steps[(steps["rank"] == 0) & steps["step"].isin(real_steps(rerun))]
    assert check.loc["step (ms)", "measured"] == pytest.approx(steps["step_ms"].median(), abs=0.005)
    # the error from the unrounded values (the shown ones are rounded: 2 decimals, 1 for the error)
    step_ms = want["predicted_step_ms"], steps["step_ms"].median()
    assert check.loc["step (ms)", "error_pct"] == pytest.approx((step_ms[0] / step_ms[1] - 1) * 100, abs=0.051)


@pytest.mark.deepspeed
def test_a_deepspeed_run_whose_units_share_one_bucket_shows_those_that_communicated(tmp_path, monkeypatch):
    """ZeRO-2 with one bucket for the whole model (1,000,000 elements): the bucket is named
    for its first parameter's unit, so the two other layers issued nothing. The unit table
    leaves them out and says how many; its switch shows every unit."""
    pytest.importorskip("deepspeed")
    from tests.tracer.capture.autotrace.test_autotrace import WORKERS

    at, _ = open_traced(tmp_path, monkeypatch, str(WORKERS / "deepspeed_train.py"), "--stage", "2", "--steps", "3",
                         "--reduce-bucket-size", "1000000", name="ds1b", env={"DS_ACCELERATOR": "cpu"})

    def units():
        return next(d.value for d in at.dataframe if {"unit", "params"} <= set(d.value.columns))

    assert list(units()["unit"]) == ["(root)", "4", NO_UNIT]  # the bucket opens with the last layer's gradients
    assert any(c.value.startswith("2 more units issued no collective") for c in at.caption)
    at.toggle(key="sharded_every_unit").set_value(True).run()
    assert not at.exception
    assert list(units()["unit"]) == ["(root)", "0", "2", "4", NO_UNIT]
