"""The ``app`` fixture: the dashboard in AppTest on a runs folder of its own."""

from __future__ import annotations

import pytest
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT


@pytest.fixture
def app(tmp_path, monkeypatch):
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp_path / "runs"))
    st_config.set_option("server.address", "127.0.0.1")  # as .streamlit/config.toml and `ddpscope dashboard`
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and not at.error
    return at
