"""The Streamlit page, run headless with AppTest."""

from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT


def test_page_opens_on_a_sample_and_switches_traces():
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=60).run()
    assert not at.exception and not at.error
    assert at.title[0].value == "ddpscope"
    options = at.sidebar.selectbox(key="trace").options
    assert len(options) >= 2
    medians = at.dataframe[0].value
    assert list(medians["rank"]) == [0, 1] and (medians["step_ms"] > 0).all()
    for name in options:
        at.sidebar.selectbox(key="trace").set_value(name).run()
        assert not at.exception and not at.error
        layout = at.dataframe[1].value
        cap = next(m.value for m in at.metric if m.label == "bucket_cap_mb (MiB)")
        assert len(layout) == int(next(m.value for m in at.metric if m.label == "buckets"))
        if cap == "1":
            assert len(layout) >= 10
