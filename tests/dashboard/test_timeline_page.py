"""The Timeline page (dashboard/timeline_page.py) with AppTest: each rank's Gantt, the medians
and bucket tables, switching traces, ranks and steps, runs compared on one time scale,
profiler traces (ours and the shared GPU cluster's), and the collectives outside the buckets."""

from __future__ import annotations

import gzip
import json
import os
import shutil

import pytest
from streamlit.testing.v1 import AppTest

from tests.conftest import KINETO, ROOT, SAMPLES, run_cli
from tests.dashboard.app_driver import BUCKETS, MEDIANS, chart_spec, metric_value, open_page, open_traced
from tests.viz.sources.test_kineto import gpu_profile


def test_timeline_view_opens_on_a_sample_with_both_ranks(app):
    assert app.title[0].value == "ddpscope"
    medians = app.dataframe[MEDIANS].value
    assert list(medians["rank"]) == [0, 1] and (medians["step_ms"] > 0).all()
    spec = chart_spec(app)
    assert {"forward", "bucket all-reduce", "optimizer.step"} <= {t["name"] for t in spec["data"]}
    assert spec["layout"]["yaxis"]["ticktext"] == ["rank 0 · compute", "rank 0 · all-reduce",
                                                    "rank 1 · compute", "rank 1 · all-reduce"]


def test_switching_traces_ranks_and_steps(app):
    options = app.sidebar.selectbox(key="trace").options
    assert len(options) >= 3
    for name in options:
        app.sidebar.selectbox(key="trace").set_value(name).run()
        assert not app.exception and not app.error
        table = app.dataframe[BUCKETS].value
        assert len(table) == int(metric_value(app, "buckets"))
        if metric_value(app, "bucket_cap_mb (MiB)") == "1":
            assert len(table) >= 10
    app.multiselect(key="ranks").set_value([1]).run()
    assert chart_spec(app)["layout"]["yaxis"]["ticktext"] == ["rank 1 · compute", "rank 1 · all-reduce"]
    app.select_slider(key="steps").set_range(2, 5).run()
    assert not app.exception and app.select_slider(key="steps").value == (2, 5)


def test_compare_opens_on_the_users_two_newest_runs(tmp_path, monkeypatch):
    import os

    runs = tmp_path / "runs"
    for n, (name, sample) in enumerate((("old", "gpt-2rank-cap1mb"), ("mid", "gpt-2rank-cap25mb"),
                                        ("new", "gpt-2rank-cap1mb"))):
        shutil.copytree(SAMPLES / sample, runs / name)
        for f in (runs / name).iterdir():
            os.utime(f, (1_700_000_000 + 100 * n,) * 2)
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    open_page(at, "Compare runs")
    assert at.multiselect(key="compare_runs").value == ["run: mid", "run: new"]  # the older one the reference
    assert not at.exception and len(at.dataframe[0].value) == 2


def test_compare_opens_on_two_runs_of_one_kind(tmp_path):
    """A DDP run, another, then an FSDP2 run (newest): Compare sets like beside like, so it
    opens on the two DDP runs, not on the newest two (a dead end: "pick two of one kind").
    A lone run of a kind opens beside a sample of its kind; without kinds, the newest two."""
    from ddpscope.dashboard.timeline_page import compare_defaults

    traces = {}
    for n, name in enumerate(("old", "mid", "new")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text("{}")
        os.utime(tmp_path / name / "run.json", (1_700_000_000 + 100 * n,) * 2)
        traces[f"run: {name}"] = tmp_path / name
    traces["sample: gpt"] = SAMPLES / "gpt-2rank-cap1mb"
    kinds = {"run: old": "ddp", "run: mid": "ddp", "run: new": "sharded", "sample: gpt": "ddp"}
    assert compare_defaults(traces, kinds) == ["run: old", "run: mid"]
    assert compare_defaults(traces, {**kinds, "run: old": "sharded"}) == ["run: old", "run: new"]
    assert compare_defaults(traces, {**kinds, "run: mid": "sharded", "run: old": "zero"}) == \
        ["run: mid", "run: new"]
    alone = {k: v for k, v in traces.items() if k in ("run: new", "run: mid", "sample: gpt")}
    assert compare_defaults(alone, kinds) == ["run: mid", "sample: gpt"]  # no sharded sample
    assert compare_defaults(traces) == ["run: mid", "run: new"]


def test_compare_view_puts_runs_on_one_time_scale(app):
    """Two samples of one job at two caps: medians over every step with intervals, the
    layout change said before the numbers, each run's median step drawn on one scale."""
    open_page(app, "Compare runs")
    table = app.dataframe[0].value
    assert len(table) == 2 and table["step_ms_vs_first"].iloc[0] == 0
    assert sorted(table["buckets"]) == [1, 20] and table["same_job"].all()
    assert (table["step_ms_lo"] <= table["step_ms"]).all() and (table["step_ms"] <= table["step_ms_hi"]).all()
    other = table.iloc[1]
    assert other["step_ms_vs_first_lo"] <= other["step_ms_vs_first"] <= other["step_ms_vs_first_hi"]
    assert other["within_noise"] == (other["step_ms_vs_first_lo"] <= 0 <= other["step_ms_vs_first_hi"])
    assert any("buckets differ" in i.value for i in app.info)
    titles = [json.dumps(chart_spec(app, n)["layout"]["title"]) for n in (0, 1)]
    assert all("its median step" in t for t in titles)
    ranges = [chart_spec(app, n)["layout"]["xaxis"]["range"] for n in (0, 1)]
    assert ranges[0] == ranges[1] and ranges[0][1] > 50
    app.multiselect(key="compare_runs").set_value(["sample: gpt-2rank-cap1mb", "sample: mlp-2rank-cap1mb"]).run()
    assert not app.exception
    assert any("is not the same job" in w.value for w in app.warning)


def test_timeline_offers_the_merged_perfetto_trace(app):
    buttons = app.get("download_button")
    assert len(buttons) == 1 and "Perfetto" in buttons[0].proto.label


def test_upload_of_a_profiler_trace_opens_its_kernel_timeline(app):
    app.sidebar.file_uploader(key="upload").upload("worker0.pt.trace.json.gz",
                                                   gzip.compress(json.dumps(gpu_profile(0, world=8)).encode()))
    app.run()
    assert not app.exception and not app.sidebar.error
    assert app.sidebar.selectbox(key="trace").value.startswith("upload: worker0")
    assert metric_value(app, "source") == "torch.profiler" and metric_value(app, "ranks") == "1 of 8"
    lanes = chart_spec(app)["layout"]["yaxis"]["ticktext"]
    assert lanes == ["rank 0 · compute", "rank 0 · allreduce", "rank 0 · exposed comm"]
    hta = next(d.value for d in app.dataframe if "comp_comm_overlap_pct" in d.value.columns)
    assert hta["comp_comm_overlap_pct"].round(2).tolist() == [33.33]
    open_page(app, "What-if")
    assert any("No prediction for a profiler trace" in i.value for i in app.info)  # What-if says why


@pytest.mark.skipif(not KINETO.is_dir(), reason="../shared/data/kineto is absent")
def test_shared_gpu_traces_open_with_per_stream_lanes(app, tmp_path):
    (tmp_path / "runs").mkdir(exist_ok=True)
    (tmp_path / "runs" / "cluster").symlink_to(KINETO / "hta-sampled-2rank")  # read in place, never copied
    app.run()
    app.sidebar.selectbox(key="trace").set_value("run: cluster").run()
    assert not app.exception and not app.error
    assert metric_value(app, "ranks") == "2 of 128"
    assert any("2 of the job's 128 ranks" in i.value for i in app.info)
    app.toggle(key="per_stream").set_value(True).run()
    lanes = chart_spec(app)["layout"]["yaxis"]["ticktext"]
    assert "rank 1 · stream 7" in lanes and "rank 1 · sendrecv" in lanes


@pytest.mark.ddp
def test_a_profiled_run_shows_the_profiler_beside_the_tracer(app, tmp_path, profiled_run):
    shutil.copytree(profiled_run, tmp_path / "runs" / "profiled")
    app.run()
    app.sidebar.selectbox(key="trace").set_value("run: profiled").run()
    app.select_slider(key="steps").set_value((2, 3)).run()
    assert not app.exception and not app.error
    titles = [json.dumps(chart_spec(app, n)["layout"].get("title")) for n in range(len(app.get("plotly_chart")))]
    assert any("torch.profiler" in t for t in titles)
    table = next(d.value for d in app.dataframe if "end_before_done_ms" in d.value.columns)
    assert sorted(table["step"].unique()) == [2, 3] and (table["tracer_bytes"] == table["profile_bytes"]).all()


def test_a_profile_with_no_profiler_step_says_how_to_take_one(tmp_path, monkeypatch):
    """A profiler trace recorded without a schedule (no ProfilerStep): the Timeline says
    what is missing and how to record it, instead of an IndexError."""
    from tests.viz.sources.test_kineto import gpu_profile, write

    doc = gpu_profile(0, world=1, comm=False)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not e["name"].startswith("ProfilerStep")]
    write(tmp_path / "runs" / "prof", "rank-0.json", doc)
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception
    said = [w.value for w in at.warning] + [e.value for e in at.error]
    assert any("ProfilerStep" in m for m in said) and not any("IndexError" in m for m in said), said


@pytest.mark.ddp
def test_the_timeline_says_what_ran_outside_the_buckets_as_the_summary_does(tmp_path, monkeypatch):
    """A run with DDP's unused-parameter map (find_unused_parameters), its buffer broadcast
    (BatchNorm) and the script's own all-reduce of its loss: the Timeline lists each kind
    in the words and numbers `ddpscope summary` prints."""
    from tests.tracer.capture.autotrace.test_autotrace import USER

    at, out = open_traced(tmp_path, monkeypatch, USER, "--steps", "4", "--depth", "3", "--find-unused",
                           "--batchnorm", "--loss-allreduce", name="own")
    summary = run_cli("summary", str(out)).stdout
    said = [line.strip() for line in summary.split("collectives outside the buckets:", 1)[1].splitlines()
            if line.startswith("  ")]
    assert len(said) == 3, summary
    shown = next(m.value for m in at.markdown if m.value.startswith("**Collectives outside the buckets**"))
    assert [line[2:] for line in shown.splitlines()[1:]] == said
    # the model by its class, in full (a metric column cut a long one at a few letters), and the script
    run = json.loads((out / "run.json").read_text())
    assert run["model_class"] and run["model_class"] != run["model"]
    assert f"**Model** `{run['model_class']}` · script `{run['model']}`" in [m.value for m in at.markdown]
