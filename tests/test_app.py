"""The Streamlit page, run headless with AppTest."""

from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT


def _app():
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    assert not at.exception and not at.error
    return at


def _chart_traces(at):
    import json

    chart = at.get("plotly_chart")[0]
    return json.loads(chart.proto.spec)["data"]


def test_page_opens_on_a_sample_with_a_timeline_for_both_ranks():
    at = _app()
    assert at.title[0].value == "ddpscope"
    medians = at.dataframe[0].value
    assert list(medians["rank"]) == [0, 1] and (medians["step_ms"] > 0).all()
    traces = _chart_traces(at)
    names = {t["name"] for t in traces}
    assert {"forward", "bucket all-reduce", "optimizer.step"} <= names
    buckets = next(t for t in traces if t["name"] == "bucket all-reduce")
    assert buckets["type"] == "bar"


def test_switching_traces_ranks_and_steps():
    at = _app()
    options = at.sidebar.selectbox(key="trace").options
    assert len(options) >= 2
    for name in options:
        at.sidebar.selectbox(key="trace").set_value(name).run()
        assert not at.exception and not at.error
        table = at.dataframe[-1].value  # bucket table
        cap = next(m.value for m in at.metric if m.label == "bucket_cap_mb (MiB)")
        assert len(table) == int(next(m.value for m in at.metric if m.label == "buckets"))
        if cap == "1":
            assert len(table) >= 10
    at.multiselect(key="ranks").set_value([1]).run()
    assert not at.exception
    import json

    layout = json.loads(at.get("plotly_chart")[0].proto.spec)["layout"]
    assert layout["yaxis"]["ticktext"] == ["rank 1 · compute", "rank 1 · all-reduce"]
    at.select_slider(key="steps").set_range(2, 5).run()
    assert not at.exception and at.select_slider(key="steps").value == (2, 5)
