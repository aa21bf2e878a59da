"""The Memory (ZeRO) page (dashboard/memory_page.py) with AppTest: a ZeRO run beside the
model, the paper's Figure 1 projection and its widgets, a broken run, and a real ZeRO-1 run."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SAMPLES, run_cli
from tests.dashboard.app_driver import chart_spec, chart_specs, chart_titled, open_page, open_traced, table_with


def test_memory_page_shows_the_zero_sample_beside_the_model(app):
    open_page(app, "Memory (ZeRO)")
    assert app.selectbox(key="zero_trace").value == "sample: zero-gpt-2rank"
    run = chart_titled(app, "measured vs predicted per ZeRO stage (MiB)")  # binary units by default
    bars = {t["name"]: t for t in run["data"]}
    assert {"parameters", "gradients", "optimizer state"} <= set(bars)
    assert bars["parameters"]["x"][1][:4] == ["measured"] * 4 and bars["parameters"]["x"][1][4:] == ["predicted"] * 4
    table = next(d.value for d in app.dataframe if {"measured/predicted", "name"} <= set(d.value.columns))
    assert len(table) == 4 and ((table["measured/predicted"] - 1).abs() < 0.05).all()
    comm = table_with(app, "collective")
    assert set(comm["collective"]) == {"all_reduce", "broadcast", "all_gather"}
    # the open run (a DDP sample: stage 0) first, beside the ZeRO model; the sample predates the
    # optimizer's name in run.json, so K is read off the measurement, and the page says so
    ddp = table_with(app, "measured/predicted")
    assert list(ddp["row"]) == ["measured (rank 0)", "measured (rank 1)", "stage 0", "stage 1", "stage 2", "stage 3"]
    assert any("K unknown to ddpscope, read off the measurement" in m.value for m in app.markdown)
    # one unit family for the whole page: the open run's figure and table follow the choice too
    assert chart_titled(app, "MiB per rank")["layout"]["legend"]["yref"] == "container"  # below the axis title
    mib = ddp["model_state_MiB"]
    app.radio(key="zero_unit").set_value("decimal").run()
    assert not app.exception
    assert table_with(app, "model_state_MB")["model_state_MB"].tolist() == pytest.approx((mib * 2**20 / 1e6).tolist(),
                                                                                     abs=1e-3)
    chart_titled(app, "MB per rank"), chart_titled(app, "measured vs predicted per ZeRO stage (MB)")
    assert not any(c.endswith(("MiB", "GiB")) for d in app.dataframe for c in d.value.columns)


def test_memory_projection_reproduces_figure_1_and_reacts_to_widgets(app):
    open_page(app, "Memory (ZeRO)")
    # the paper's 7.5B parameters (the default), N = 64, mixed precision, K = 12, in its GB
    app.radio(key="zero_unit").set_value("decimal").run()
    table = table_with(app, "per device (GB)")
    assert table["per device (GB)"].round(1).tolist() == [120.0, 31.4, 16.6, 1.9]
    assert chart_titled(app, "per device (GB)")["layout"]["yaxis"]["title"]["text"] == "per device (GB)"
    app.radio(key="zero_unit").set_value("binary").run()
    assert table_with(app, "per device (GiB)")["per device (GiB)"].iloc[0] == pytest.approx(120e9 / 2**30, abs=1e-3)
    assert app.number_input(key="proj_device").label == "device memory (GiB)"
    app.radio(key="zero_unit").set_value("decimal").run()
    app.select_slider(key="proj_n").set_value(8).run()
    assert table_with(app, "per device (GB)")["per device (GB)"].round(3).tolist()[3] == 15.0
    app.selectbox(key="proj_preset").set_value("GPT-3 (175B)").run()
    assert app.select_slider(key="proj_params_b").value == 175.0
    app.select_slider(key="proj_params_b").set_value(1000.0).run()
    assert table_with(app, "per device (GB)")["per device (GB)"].iloc[0] == pytest.approx((2 + 2 + 12) * 1000)
    app.radio(key="proj_precision").set_value("fp32").run()
    assert app.slider(key="proj_k").value == 8
    app.checkbox(key="proj_act").check().run()
    assert not app.exception
    fits = table_with(app, "largest model that fits (B params)")["largest model that fits (B params)"]
    assert fits.is_monotonic_increasing


def test_a_broken_zero_run_shows_a_readable_error(app, tmp_path):
    bad = tmp_path / "runs" / "broken-zero"
    bad.mkdir(parents=True)
    (bad / "run.json").write_bytes((SAMPLES / "zero-gpt-2rank" / "run.json").read_bytes())
    (bad / "rank-0.json").write_text(json.dumps({"traceEvents": [], "otherData": {"ddpscope": {
        "format": "ddpscope-trace", "version": 1, "rank": 0, "world_size": 2}}}))
    (bad / "rank-1.json").write_bytes((SAMPLES / "zero-gpt-2rank" / "rank-1.json").read_bytes())
    open_page(app, "Memory (ZeRO)")
    app.selectbox(key="zero_trace").set_value("run: broken-zero").run()
    assert not app.exception
    assert any("rank-0.json holds no ZeRO stage measurements" in e.value for e in app.error)


@pytest.mark.ddp
def test_a_zero1_run_shows_its_broadcasts_and_its_stage_on_the_memory_page(tmp_path, monkeypatch):
    """DDP with ZeroRedundancyOptimizer (traced here): the Timeline draws its parameter
    broadcasts and says what they cost; the Memory page sets the run beside stages 0-3."""
    from tests.tracer.capture.ddp.test_hooks import SETUPS

    at, out = open_traced(tmp_path, monkeypatch, SETUPS, "zero", "--steps", "4", name="zero1")
    assert at.sidebar.selectbox(key="trace").value == "run: zero1"
    assert "parameter broadcast (ZeRO-1)" in {t["name"] for t in chart_spec(at)["data"]}
    line = next(i.value for i in at.info if "ZeRO-1 (ZeroRedundancyOptimizer)" in i.value)
    summary = run_cli("summary", "--json", str(out))  # the same steps (warm-up left out), the same numbers
    assert summary.returncode == 0, summary.stderr
    said = json.loads(summary.stdout)["zero1"]
    assert f"{said['param_sync_ms']:.2f} ms a step" in line and f"{said['pct_of_step']:.1f} % of the step" in line
    open_page(at, "Memory (ZeRO)")
    titles = [json.dumps(c["layout"].get("title")) for c in chart_specs(at)]
    assert any("beside ZeRO stages 0-3" in t for t in titles)
    table = next(d.value for d in at.dataframe if "measured/predicted" in d.value.columns)
    assert list(table["row"])[-4:] == ["stage 0", "stage 1", "stage 2", "stage 3"]
    assert any("ZeroRedundancyOptimizer partitions whole parameters" in m.value for m in at.markdown)


def test_a_partial_fine_tune_shows_its_frozen_parameters_held_and_not_trained(tmp_path, monkeypatch):
    """DDP with its first 3 layers frozen (traced here): the Memory page sets the run beside
    a ZeRO model that holds every parameter and trains the rest, and says so."""
    from tests.tracer.capture.autotrace.test_autotrace import USER

    at, out = open_traced(tmp_path, monkeypatch, USER, "--freeze", "3", "--width", "128", "--depth", "4",
                          "--steps", "3", name="lora")
    run = json.loads((out / "run.json").read_text())
    trained, frozen = run["model_params"], run["frozen_params"]
    assert frozen == 3 * (128 * 128 + 128)
    open_page(at, "Memory (ZeRO)")
    assert not at.exception
    assert any(f"{trained + frozen:,} parameters ({trained:,} of them trained)" in c.value for c in at.caption)
    assert any(f"{frozen:,} of the {trained + frozen:,} parameters are frozen" in m.value for m in at.markdown)
    table = next(d.value for d in at.dataframe if "measured/predicted" in d.value.columns).set_index("row")
    assert (table["measured/predicted"].dropna() - 1).abs().max() < 1e-3
    held = [c for c in table.columns if c.startswith("params_")][0]  # in the page's unit
    assert table.loc["stage 3", held] == pytest.approx(table.loc["stage 0", held] / 2, abs=1e-4)  # all sharded (rounded)
