"""The dashboard's frame (app.py) with AppTest: only the open page computes, and a link opens
any page."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT


def test_only_the_open_page_computes_and_a_link_opens_any_page(app):
    """The first chart comes sooner: a page's content is built only while it is open. The
    open page is in the URL (``?page=...``): a link opens that page."""
    assert app.session_state["page"] == "Timeline" and app.get("plotly_chart")
    for key in ("ring_trace", "zero_trace"):  # the Ring and Memory pages: not built
        with pytest.raises(KeyError):
            app.selectbox(key=key)
    linked = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90)
    linked.query_params["page"] = "Memory (ZeRO)"
    linked.run()
    assert not linked.exception and linked.session_state["page"] == "Memory (ZeRO)"
    assert linked.selectbox(key="zero_trace").value == "sample: zero-gpt-2rank"
    assert not linked.get("download_button")  # the Timeline's Perfetto download: not built
