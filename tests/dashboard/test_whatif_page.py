"""The What-if page (dashboard/whatif_page.py, dashboard/advisor_view.py) with AppTest: the
predicted curve with the measured runs on it, the projection, the advisor, and runs at the
predicted cap and from Apply, run for real."""

from __future__ import annotations

import json
import shutil

import pytest
from streamlit import config as st_config

from tests.conftest import SAMPLES, run_cli
from tests.dashboard.app_driver import chart_specs, chart_titled, open_page, open_traced, wait_for_job


def _predict_chart(app, title_part="Predicted step time against bucket_cap_mb") -> dict:
    return chart_titled(app, title_part)


def _vs_table(app):
    """The What-if page's predicted-beside-measured table (dataframes carry no key)."""
    return next(d.value for d in app.dataframe if "run" in d.value.columns
                and any(str(r).startswith("predicted at") for r in d.value["run"]))


def _proj_table(app):
    """The projection's table: the last cap sweep on the page (the first is the prediction's)."""
    return [d.value for d in app.dataframe if "traced" in d.value.columns][-1]


def test_whatif_page_draws_the_predicted_curve_with_the_measured_runs_on_it(app):
    """The open sample (GPT, 1 MiB) predicted at every cap; the other GPT sample (25 MiB,
    same job) is a measured point; the best cap is starred; a predicted timeline shows
    beside the measured run at the chosen cap."""
    open_page(app, "What-if")
    assert any("replayed with the buckets DDP would build" in c.value for c in app.caption)  # what it shows
    spec = _predict_chart(app)
    traces = {t["name"]: t for t in spec["data"]}
    assert {"step (predicted)", "exposed communication (predicted)", "step (measured runs)",
            "best cap (predicted)", "traced cap (replayed)"} <= set(traces)
    assert spec["layout"]["xaxis"]["type"] == "log"
    assert spec["layout"]["xaxis"]["ticktext"][:4] == ["0.25", "0.5", "1", "2"]  # the caps, not 2 5 1 2 5
    assert sorted(traces["step (measured runs)"]["x"]) == [1.0, 25.0]
    assert traces["traced cap (replayed)"]["x"] == [1.0]
    # under the curve, the traced cap's replay beside what the open run measured (the CLI's replay_check)
    check = json.loads(run_cli("whatif", str(SAMPLES / "gpt-2rank-cap1mb"), "--caps", "1", "--json").stdout)
    check = check["replay_check"]
    said = next(c.value for c in app.caption if c.value.startswith("At its own setting the replay reads"))
    assert (f"{check['step_ms']['replayed']:.1f} ms a step and {check['exposed_ms']['replayed']:.1f} ms exposed where "
            f"this run measured {check['step_ms']['measured']:.1f} and {check['exposed_ms']['measured']:.1f} ms") in said
    app.select_slider(key="predict_cap").set_value(25.0).run()
    assert not app.exception
    vs = _vs_table(app)
    assert list(vs["run"]) == ["predicted at 25 MiB", "sample: gpt-2rank-cap25mb (measured)"]
    assert list(vs["buckets"]) == [1, 1]  # as DDP built it: an explicit 25 MiB caps the first bucket too
    titles = [json.dumps(c["layout"].get("title")) for c in chart_specs(app)]
    assert any("predicted at 25 MiB" in t for t in titles) and any("(measured)" in t for t in titles)


@pytest.mark.breadth
def test_whatif_projection_reacts_to_world_size_and_link(app):
    open_page(app, "What-if")
    assert "64 ranks" in json.dumps(_predict_chart(app, "Projection:")["layout"]["title"])
    app.selectbox(key="predict_proj_link").set_value("NVLink (H100 SXM, one node)").run()
    fast = _proj_table(app)
    assert app.number_input(key="predict_proj_bw").value == 360.0
    app.selectbox(key="predict_proj_link").set_value("Ethernet 25 Gb/s (TCP)").run()
    app.number_input(key="predict_proj_n").set_value(1024).run()
    assert not app.exception
    slow = _proj_table(app)
    assert "1024 ranks" in json.dumps(_predict_chart(app, "Projection:")["layout"]["title"])
    assert (slow["exposed_ms"].to_numpy() > fast["exposed_ms"].to_numpy()).all()
    app.number_input(key="predict_proj_bw").set_value(1e4).run()  # edited by hand
    app.number_input(key="predict_proj_lat").set_value(0.0).run()
    assert (_proj_table(app)["exposed_ms"] < slow["exposed_ms"]).all()


def test_whatif_refuses_a_trace_it_cannot_predict_in_one_line(app, tmp_path):
    bad = tmp_path / "runs" / "no-sizes"
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", bad)
    run = json.loads((bad / "run.json").read_text())
    run.pop("param_bytes")
    (bad / "run.json").write_text(json.dumps(run))
    open_page(app, "What-if")  # lists the new folder
    app.sidebar.selectbox(key="trace").set_value("run: no-sizes").run()
    assert not app.exception
    assert any("No prediction for this trace" in i.value and "param" in i.value for i in app.info)


@pytest.mark.ddp
def test_run_at_the_predicted_cap_puts_the_real_run_on_the_curve(app, tmp_path):
    open_page(app, "What-if")
    app.select_slider(key="predict_cap").set_value(4.0).run()
    app.button(key="predict_run").click().run()
    assert app.get("progress")
    wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and json.loads((runs[0] / "run.json").read_text())["bucket_cap_mb"] == 4.0
    app.select_slider(key="predict_cap").set_value(4.0).run()
    measured = {t["name"]: t for t in _predict_chart(app)["data"]}["step (measured runs)"]
    assert 4.0 in measured["x"] and f"run: {runs[0].name}" in measured["text"]
    vs = _vs_table(app)
    assert list(vs["run"]) == ["predicted at 4 MiB", f"run: {runs[0].name} (measured)"]


@pytest.mark.ddp
def test_at_the_traced_cap_a_run_at_ddps_default_is_predicted_matched_and_rerun_as_ddps_default(tmp_path, monkeypatch):
    """A script traced with DDP's default buckets (no bucket_cap_mb: 25 MiB, its first bucket
    1 MiB): at 25 on the slider the prediction is that layout, and so is the rerun its button
    starts; a run at an explicit 25 MiB (the first bucket capped at 25 too: another layout)
    is never the measured run set beside it."""
    from tests.tracer.capture.autotrace.test_autotrace import USER, trace_script

    st_config.set_option("server.address", "127.0.0.1")  # commands on, as the app fixture has them
    at, out = open_traced(tmp_path, monkeypatch, USER, "--steps", "4", "--depth", "3", name="own")
    run = json.loads((out / "run.json").read_text())
    assert run["bucket_cap_default"] and run["bucket_cap_mb"] == 25
    open_page(at, "What-if")
    at.select_slider(key="predict_cap").set_value(25.0).run()
    assert not at.exception
    vs = _vs_table(at)
    assert list(vs["run"]) == ["predicted at DDP's default (25 MiB, first bucket 1)", "run: own (measured)"]
    assert vs["buckets"].iloc[0] == vs["buckets"].iloc[1] == len(run["bucket_layout"]) > 1  # its 1 MiB first bucket
    assert at.button(key="predict_run").label == "Run with DDP's default buckets (25 MiB, first bucket 1)"
    at.button(key="predict_run").click().run()
    wait_for_job(at)
    (rerun,) = [p for p in (tmp_path / "runs").iterdir() if (p / "run.json").is_file() and p.name != "own"]
    again = json.loads((rerun / "run.json").read_text())
    assert again["bucket_cap_default"] and again["bucket_layout"] == run["bucket_layout"]
    # an explicit 25 MiB, traced beside them (listed first: newest names first): one bucket, on the curve at
    # 25, never the measured run set beside DDP's default
    proc, explicit, _ = trace_script(tmp_path / "runs", USER, "--steps", "4", "--depth", "3", name="zz-explicit",
                                     ddpscope=("--bucket-cap-mb", "25"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(json.loads((explicit / "run.json").read_text())["bucket_layout"]) == 1
    at.select_slider(key="predict_cap").set_value(25.0).run()
    assert not at.exception
    measured = {t["name"]: t for t in _predict_chart(at)["data"]}["step (measured runs)"]
    assert {"run: zz-explicit", f"run: {rerun.name}", "run: own"} <= set(measured["text"])
    said = dict(zip(measured["text"], measured["customdata"]))  # both at x = 25: each cross says which it is
    assert said["run: zz-explicit"] == "25 MiB" and said["run: own"] == "DDP's default (25 MiB, first bucket 1)"
    vs = _vs_table(at)
    assert vs["run"].iloc[1] in ("run: own (measured)", f"run: {rerun.name} (measured)")
    assert vs["buckets"].iloc[1] == vs["buckets"].iloc[0] > 1


def test_whatif_and_run_offer_a_torch_compiled_model_no_cap_its_ddp_optimizer_refuses(app, tmp_path):
    """A run whose run.json says torch.compile's DDPOptimizer splits its graphs (the fact
    set here on a sample; tests/tracer/capture/autotrace/test_torch_compile.py records it
    from a real compiled run): no cap under 1 MiB on the curve, and the page says why."""
    compiled = tmp_path / "runs" / "compiled"
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", compiled)
    run = json.loads((compiled / "run.json").read_text())
    run["torch_compile"] = {"graphs": 2, "inside": True, "optimize_ddp": "ddp_optimizer"}
    (compiled / "run.json").write_text(json.dumps(run))
    open_page(app, "What-if")
    app.sidebar.selectbox(key="trace").set_value("run: compiled").run()
    assert not app.exception
    xs = {x for t in _predict_chart(app)["data"] if t["name"] == "step (predicted)" for x in t["x"]}
    assert min(xs) == 1.0 and 0.25 not in xs and 0.5 not in xs
    assert any("DDPOptimizer refuses a bucket cap under 1 MiB" in c.value for c in app.caption)
    open_page(app, "Run")  # its rerun offers none either
    assert not app.exception
    assert [float(o) for o in app.select_slider(key="run_cap").options][:2] == [1.0, 2.0]
    assert any("torch.compile'd" in c.value and "start at 1 MiB" in c.value for c in app.caption)
    app.toggle(key="run_cap_default").set_value(False).run()
    app.text_input(key="run_cap_list").set_value("0.25,0.5").run()
    app.button(key="run_button").click().run()  # refused on the page, nothing started
    assert not app.exception
    assert any("largest entry is under 1 MiB" in e.value for e in app.error)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["compiled"]


def test_whatif_page_gives_one_number_per_setting_and_shades_the_noise(app):
    """The curve's table and the advisor's candidates come from one replay: each uniform
    cap's step is the same in both; the caps whose steps cannot be told apart from the
    fastest one are shaded on the curve and named under it."""
    open_page(app, "What-if")
    table = next(d.value for d in app.dataframe if {"bucket_cap_mb", "within_noise"} <= set(d.value.columns))
    cands = next(d.value for d in app.dataframe if {"kind", "label", "step_ms"} <= set(d.value.columns))
    by_cap = {float(r.bucket_cap_mb): float(r.step_ms) for r in table.itertuples() if not r.traced}
    uniform = cands[cands["kind"] == "uniform"]
    assert len(uniform) >= 10
    for r in uniform.itertuples():
        assert r.step_ms == pytest.approx(by_cap[float(r.label.split("=")[1])], abs=0.006)  # both rounded to 0.01
    spec = _predict_chart(app)
    bands = [s for s in spec["layout"].get("shapes", []) if s.get("y1", 0) > s.get("y0", 0)]
    assert len(bands) == 1 and bands[0]["y0"] == pytest.approx(table["step_ms"].min(), abs=0.01)
    alike = table[table["within_noise"]]
    assert 1 < len(alike) < len(table)  # some caps are alike, not all
    assert set(table["bucket_cap_mb_list"]) == {"–"}  # an empty cell, not "None"
    assert {d.proto.placeholder for d in app.dataframe} == {"–"}  # a missing number too, on every table
    config = json.loads(next(d for d in app.dataframe if "within_noise" in d.value.columns).proto.columns)
    assert config["step_ms"]["label"] == "step (ms)" and config.get("bucket_cap_mb", {}).get("label") in (None, "bucket_cap_mb")
    assert any("cannot be told apart from it" in c.value for c in app.caption)


def test_whatif_advisor_says_keep_or_change(app):
    """The MLP sample: no change worth it; the 25 MiB GPT sample (one bucket after
    backward, with its calibration): a change, with its interval, and its Apply button."""
    app.sidebar.selectbox(key="trace").set_value("sample: mlp-2rank-cap1mb").run()
    open_page(app, "What-if")
    assert any(i.value.startswith("Advisor: keep bucket_cap_mb=1") and "noise" in i.value for i in app.info)
    searched = next(e.label for e in app.expander if e.label.startswith("What the advisor searched"))
    for part in searched.split(": ", 1)[1].replace(" and ", ", ").split(", "):  # "1 per-bucket layout" (this sample's)
        count, word = part.split(" ", 1)
        assert word.endswith("s") == (int(count) != 1), searched
    app.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap25mb").run()
    assert not app.exception
    said = next(s.value for s in app.success if s.value.startswith("Advisor:"))
    assert "95 % interval" in said and "faster" in said
    assert app.button(key="advice_apply").label.startswith("Apply: run it again with bucket_cap_mb")
    assert len(next(d.value for d in app.dataframe if {"kind", "label", "step_ms"} <= set(d.value.columns))) > 40


def test_the_advisors_change_says_where_the_users_code_sets_it(tmp_path, monkeypatch):
    """A run Lightning built (run.json's ``ddp_built_by``, as the tracer writes it): under the
    advisor's change, the line that says how DDPStrategy takes it, the CLI's own."""
    from streamlit.testing.v1 import AppTest

    from tests.conftest import ROOT

    runs = tmp_path / "runs"
    shutil.copytree(SAMPLES / "gpt-2rank-cap25mb", runs / "mine")
    meta = json.loads((runs / "mine" / "run.json").read_text())
    meta["ddp_built_by"] = {"framework": "lightning", "module": "lightning.pytorch.strategies.ddp",
                            "file": "/x/ddp.py", "line": 1, "function": "_setup_model"}
    (runs / "mine" / "run.json").write_text(json.dumps(meta))
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    app = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    app.sidebar.selectbox(key="trace").set_value("run: mine").run()
    open_page(app, "What-if")
    assert not app.exception
    said = next(c.value for c in app.caption if c.value.startswith("In your code: "))
    cli = run_cli("whatif", str(runs / "mine"), "--json")
    assert said == "I" + json.loads(cli.stdout)["recommended"]["in_code"][1:] + "."
    assert "Trainer(strategy=DDPStrategy(bucket_cap_mb" in said


@pytest.mark.ddp
def test_apply_on_the_page_reruns_and_shows_a_against_b(app, tmp_path):
    """Apply on the 25 MiB sample: a real rerun with the recommendation whose run.json
    says where it came from; opening it shows A against B: steps, the diff timeline, the
    bucket table."""
    open_page(app, "What-if")
    app.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap25mb").run()
    app.button(key="advice_apply").click().run()
    wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["advice"]["from"] == str((SAMPLES / "gpt-2rank-cap25mb").resolve()) and run["status"] == "complete"
    app.sidebar.selectbox(key="trace").set_value(f"run: {runs[0].name}").run()
    assert not app.exception
    steps = next(d.value for d in app.dataframe if "B predicted" in d.value.columns)
    assert list(steps["median"]) == ["step_ms", "exposed_ms", "comm_ms", "backward_ms"]
    assert {"A measured", "B predicted", "B measured", "error %"} <= set(steps.columns)
    assert any("exposed_ms B" in d.value.columns for d in app.dataframe)
    names = {t.get("name") for t in chart_titled(app, "A against B")["data"]}
    assert {"A (measured): all-reduce", "B (measured): all-reduce"} <= names


def test_the_sweeps_caption_names_the_fastest_cap_and_why_another_stays_marked():
    """The caption says the table's fastest cap; where it beats the traced cap by under
    MIN_GAIN, the traced one stays marked best (the figure's marker) and the caption says
    why, not that the marked cap is the fastest."""
    import pandas as pd

    from ddpscope.dashboard.whatif_page import sweep_caption
    from ddpscope.viz.whatif.sweep import recommend_cap

    close = pd.DataFrame({"bucket_cap_mb": [1.0, 25.0, 64.0], "step_ms": [99.0, 100.0, 101.0],
                          "exposed_ms": [1.0, 2.0, 3.0], "traced": [False, True, False]})
    best = recommend_cap(close)
    assert best["bucket_cap_mb"] == 25.0  # 1 % better: not worth a change
    text = sweep_caption(close, best, float("nan"))
    assert text.startswith("Of the uniform caps on the curve, 1 MiB is predicted fastest (99.0 ms a step), under 2 % "
                           "faster than the traced 25 MiB (100.0 ms), which stays marked best")
    far = close.assign(step_ms=[80.0, 100.0, 101.0])
    text = sweep_caption(far, recommend_cap(far), float("nan"))
    assert "1 MiB is predicted fastest (80.0 ms a step)." in text and "stays marked" not in text


def test_a_run_at_other_settings_than_the_cap_is_not_a_measured_point_and_is_said_so(tmp_path, monkeypatch):
    """A run of the same job at 25 MiB but with find_unused_parameters flipped (its
    run.json edited: a trace's data) is another setting, not the curve's 25 MiB: it is left
    off the curve and out of the table beside the prediction, and a caption names it, what
    it changed and its step."""
    from streamlit.testing.v1 import AppTest

    from tests.conftest import ROOT

    runs = tmp_path / "runs"
    flipped = runs / "fup-25"
    shutil.copytree(SAMPLES / "gpt-2rank-cap25mb", flipped)
    run = json.loads((flipped / "run.json").read_text())
    run["find_unused_parameters"] = not run["find_unused_parameters"]
    (flipped / "run.json").write_text(json.dumps(run))
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    st_config.set_option("server.address", "127.0.0.1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    at.sidebar.selectbox(key="trace").set_value("sample: gpt-2rank-cap1mb").run()
    open_page(at, "What-if")
    assert not at.exception
    measured = {t["name"]: t for t in _predict_chart(at)["data"]}["step (measured runs)"]
    assert sorted(measured["x"]) == [1.0, 25.0] and "run: fup-25" not in measured["text"]
    said = next(c.value for c in at.caption if c.value.startswith("Not on the curve"))
    assert f"run: fup-25 (find_unused_parameters={run['find_unused_parameters']}), " in said and " ms a step" in said
    at.select_slider(key="predict_cap").set_value(25.0).run()
    assert list(_vs_table(at)["run"]) == ["predicted at 25 MiB", "sample: gpt-2rank-cap25mb (measured)"]


@pytest.mark.ddp
def test_a_run_without_a_calibration_says_what_its_prediction_lacks_and_calibrates_it_here(tmp_path, monkeypatch):
    """The MLP's 1 MiB buckets are all one size: the page says the prediction has no fixed
    cost per all-reduce, and its button runs `ddpscope calibrate` on the run (real ranks,
    into the run's folder); the page then predicts from the calibration and says nothing
    more. The bundled sample ran elsewhere: no button, and why."""
    from streamlit.testing.v1 import AppTest

    from tests.conftest import ROOT

    runs = tmp_path / "runs"
    shutil.copytree(SAMPLES / "mlp-2rank-cap1mb", runs / "mlp")
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(runs))
    st_config.set_option("server.address", "127.0.0.1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    at.sidebar.selectbox(key="trace").set_value("sample: mlp-2rank-cap1mb").run()
    open_page(at, "What-if")
    assert any(w.value.startswith("No calibration of these ranks") and "one size" in w.value for w in at.warning)
    assert any("Calibrating is off for this run" in c.value for c in at.caption)
    assert "predict_calibrate" not in [b.key for b in at.button]
    at.sidebar.selectbox(key="trace").set_value("run: mlp").run()
    assert any("fewer, larger ones too slow" in w.value for w in at.warning)
    at.button(key="predict_calibrate").click().run()
    assert at.get("progress")
    wait_for_job(at)
    assert (runs / "mlp" / "calibration.json").is_file() and [p.name for p in runs.iterdir()] == ["mlp"]
    assert any("whose predictions now use it" in s.value for s in at.sidebar.success)
    assert not any(w.value.startswith("No calibration") for w in at.warning)
    assert "predict_calibrate" not in [b.key for b in at.button] and not at.exception
    assert any(c.value.startswith("all-reduce cost from calibration") for c in at.caption)  # the model's notes
