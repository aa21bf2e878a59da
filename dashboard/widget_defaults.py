"""Widgets that start from what the page opened (a trace's own settings, a preset's
numbers): a keyed widget keeps what it held before, so each control set is reset when
another trace or preset is opened, and left to the user while it stays open."""

from __future__ import annotations

import streamlit as st


def start_from(tag: str, source, **values) -> None:
    """Set the widgets ``values`` (key -> value) when ``source`` (a trace's path, a preset's
    name) is not the one the ``tag`` controls last started from (``st.session_state[tag + "_for"]``)."""
    seen = f"{tag}_for"
    if st.session_state.get(seen) != str(source):
        st.session_state.update({seen: str(source), **values})
