"""The Ring page (dashboard/ring_page.py) with AppTest: the ring all-reduce animated on a
sample, its what-if inputs, ring runs started from the page (on emulated nodes too), and
broken or partial ring traces shown as one readable line."""

from __future__ import annotations

import json

import pytest

from ddpscope.tracer.launch.lab import lab_leftovers, why_not
from tests.conftest import SAMPLES
from tests.dashboard.app_driver import metric_value, open_page, table_with, wait_for_job, zip_bytes


def _ring_specs(app) -> dict[str, dict]:
    """The Ring page's charts: animation (has frames), steps and what-if, by what they show."""
    specs = [json.loads(c.proto.spec) for c in app.get("plotly_chart")]
    out = {}
    for s in specs:
        if s.get("frames"):
            out["animation"] = s
        elif any(t.get("name") == "2M (limit)" for t in s["data"]):
            out["whatif"] = s
        elif "Time per ring step and rank" in json.dumps(s["layout"].get("title")):
            out["steps"] = s
    return out


def test_ring_page_animates_the_sample(app):
    assert metric_value(app, "ranks") == "2"  # the timeline's run
    open_page(app, "Ring all-reduce")
    assert app.selectbox(key="ring_trace").value == "sample: ring-4rank-4mb"
    assert "sample: ring-4rank-4mb" not in app.sidebar.selectbox(key="trace").options  # not a DDP run
    assert [str(m.value) for m in app.metric if m.label == "ranks"][:1] == ["4"]  # the ring's
    assert float(metric_value(app, "ring, median (ms)")) > 0 and float(metric_value(app, "dist.all_reduce, median (ms)")) > 0
    specs = _ring_specs(app)
    assert len(specs["animation"]["frames"]) == 2 * 3 + 1
    assert len(specs["steps"]["data"]) == 4
    summary = table_with(app, "ring_ms")  # the ring summary (no other table has that column)
    assert list(summary["bytes"]) == [4096, 2**18, 2**22]


def test_ring_round_and_whatif_inputs(app):
    open_page(app, "Ring all-reduce")
    rounds = app.select_slider(key="ring_round").options
    other = next(r for r in rounds if str(r) != str(app.select_slider(key="ring_round").value))
    app.select_slider(key="ring_round").set_value(int(other)).run()
    assert not app.exception
    assert _ring_specs(app)["animation"]["layout"]["meta"]["round"] == int(other)
    whatif = _ring_specs(app)["whatif"]
    assert any(t.get("name") == "measured (median)" for t in whatif["data"])  # at the traced size
    app.number_input(key="whatif_mb").set_value(64.0)
    app.number_input(key="whatif_alpha").set_value(0.0)
    app.number_input(key="whatif_bw").set_value(2.0).run()
    assert not app.exception
    whatif = _ring_specs(app)["whatif"]
    names = [t.get("name") for t in whatif["data"]]
    assert "measured (median)" not in names  # another size: nothing measured to show
    latency = whatif["data"][names.index("latency term 2(N-1)·a")]
    assert latency["x"][-1] == 64
    sent = whatif["data"][names.index("sent per rank (MiB)")]
    assert sent["y"][0] == 64.0 and 2 * 64 * 0.96 < sent["y"][-1] < 128.0  # approaching 2M


@pytest.mark.ddp
@pytest.mark.lab
@pytest.mark.skipif(why_not() is not None, reason=f"no emulated nodes here: {why_not()}")
def test_a_ring_run_from_the_page_on_emulated_nodes_is_fitted_against_the_link(app, tmp_path):
    open_page(app, "Ring all-reduce")
    app.toggle(key="ring_lab").set_value(True).run()
    app.select_slider(key="ring_lab_link").set_value("200mbit")
    app.slider(key="ring_run_nproc").set_value(1)
    app.select_slider(key="ring_run_mb").set_value(0.5)
    app.slider(key="ring_run_repeat").set_value(2)
    app.button(key="ring_run_button").click().run()
    wait_for_job(app)
    runs = [p for p in (tmp_path / "runs").iterdir() if p.name != "uploads"]
    assert len(runs) == 1 and runs[0].name.endswith("-ring-1r-0.5mb-2x200mbit"), runs
    run = json.loads((runs[0] / "run.json").read_text())
    assert run["status"] == "complete" and run["world_size"] == 2 and run["emulation"]["link"] == "200mbit"
    app.selectbox(key="ring_trace").set_value(f"run: {runs[0].name}").run()
    assert not app.exception
    caption = next(c.value for c in app.caption if "alpha-beta fit" in c.value)
    assert "over 2 emulated nodes' 200mbit links (0.025 GB/s): B is" in caption
    fit = table_with(app, "model_ms")
    assert list(fit["bytes"]) == [4096, 2**15, 2**19]
    assert not lab_leftovers()


def test_a_broken_ring_trace_shows_a_readable_error(app, tmp_path):
    bad = tmp_path / "runs" / "broken-ring"
    bad.mkdir(parents=True)
    for p in (SAMPLES / "ring-4rank-4mb").iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / "rank-3.json").write_bytes(b'{"traceEvents": [')
    open_page(app, "Ring all-reduce")
    app.selectbox(key="ring_trace").set_value("run: broken-ring").run()
    assert not app.exception
    assert any("rank-3.json is not valid JSON" in e.value and "\n" not in e.value for e in app.error)


def test_upload_of_a_ring_archive_opens_the_ring_page(app):
    files = {f"ring/{p.name}": p.read_bytes() for p in (SAMPLES / "ring-4rank-4mb").iterdir()}
    app.sidebar.file_uploader(key="upload").upload("my-ring.zip", zip_bytes(files), "application/zip")
    open_page(app, "Ring all-reduce")
    assert not app.exception and not app.sidebar.error
    assert app.selectbox(key="ring_trace").value.startswith("upload: my-ring-")
    assert len(_ring_specs(app)["animation"]["frames"]) == 7


def test_a_ring_run_with_no_complete_round_says_so(app, tmp_path):
    bad = tmp_path / "runs" / "no-rounds"
    bad.mkdir(parents=True)
    for p in (SAMPLES / "ring-4rank-4mb").iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    doc = json.loads((bad / "rank-3.json").read_text())
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "ring_step"]
    (bad / "rank-3.json").write_text(json.dumps(doc))
    open_page(app, "Ring all-reduce")
    app.selectbox(key="ring_trace").set_value("run: no-rounds").run()
    assert not app.exception
    assert any("no ring round finished on every rank" in e.value for e in app.error)


def test_a_ring_round_whose_sends_do_not_add_up_says_so_and_the_page_goes_on(app, tmp_path):
    """Rank 1 receives its own chunk at every round's first step (an edited trace): the
    replay would count its data twice; the page says so and draws the rest."""
    bad = tmp_path / "runs" / "twice"
    bad.mkdir(parents=True)
    for p in (SAMPLES / "ring-4rank-4mb").iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    doc = json.loads((bad / "rank-1.json").read_text())
    for e in doc["traceEvents"]:
        if e.get("cat") == "ring_step" and e["args"]["step"] == 0:
            e["args"].update(recv_from=1, recv_chunk=e["args"]["send_chunk"])
    (bad / "rank-1.json").write_text(json.dumps(doc))
    open_page(app, "Ring all-reduce")
    app.selectbox(key="ring_trace").set_value("run: twice").run()
    assert not app.exception
    assert any("cannot be replayed" in e.value and "twice" in e.value for e in app.error)
    assert any(d.value is not None and len(d.value) for d in app.dataframe)  # the summary table is still drawn


@pytest.mark.ddp
def test_ring_and_zero_runs_start_from_their_pages(app, tmp_path):
    open_page(app, "Ring all-reduce")
    app.slider(key="ring_run_nproc").set_value(2)
    app.select_slider(key="ring_run_mb").set_value(0.5)
    app.slider(key="ring_run_repeat").set_value(2)
    app.button(key="ring_run_button").click().run()
    assert app.get("progress") and app.button(key="ring_run_button").disabled  # one job at a time
    open_page(app, "Memory (ZeRO)")
    # A 2-rank ring run can end within the page switch (it did in CI): the button follows the job.
    assert app.button(key="zero_run_button").disabled == bool(app.get("progress"))
    wait_for_job(app)
    open_page(app, "Ring all-reduce")
    assert any("on the Ring all-reduce tab" in s.value for s in app.sidebar.success)
    ring_label = next(o for o in app.selectbox(key="ring_trace").options if o.startswith("run: "))
    app.selectbox(key="ring_trace").set_value(ring_label).run()
    assert not app.exception and len(_ring_specs(app)["animation"]["frames"]) == 3  # 2 ranks: 2 steps + start

    open_page(app, "Memory (ZeRO)")
    app.selectbox(key="zero_run_model").set_value("mlp")
    app.button(key="zero_run_button").click().run()
    assert app.get("progress") and app.button(key="zero_run_button").disabled
    open_page(app, "Ring all-reduce")  # four stages one after another: still running here
    assert app.get("progress") and app.button(key="ring_run_button").disabled
    open_page(app, "Memory (ZeRO)")
    wait_for_job(app)
    assert any("on the Memory (ZeRO) tab" in s.value for s in app.sidebar.success)
    zero_label = next(o for o in app.selectbox(key="zero_trace").options if o.startswith("run: "))
    app.selectbox(key="zero_trace").set_value(zero_label).run()
    table = next(d.value for d in app.dataframe if {"measured/predicted", "name"} <= set(d.value.columns))
    assert len(table) == 4 and ((table["measured/predicted"] - 1).abs() < 0.05).all()
