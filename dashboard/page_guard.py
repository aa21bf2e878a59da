"""A page that fails says so in one line where it would have been, and the other pages
stay: never a traceback on the page."""

from __future__ import annotations

import contextlib

import streamlit as st

from ddpscope.viz.trace import TraceError


def one_line(e: Exception) -> str:
    """What went wrong, in one line (a ``TraceError``'s own words; else the exception's
    type and text, made one line as a ``TraceError`` makes it)."""
    return str(e) if isinstance(e, TraceError) else str(TraceError(f"{type(e).__name__}: {e}"))


@contextlib.contextmanager
def page_guard(what: str):
    """Draw a page; if it fails, say so in one line where it would have been and keep the
    other pages (a trace no check foresaw, or a bug: never a traceback on the page).
    Streamlit's own stop and rerun pass (they are not ``Exception``s)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        st.error(f"{what} could not be drawn: {one_line(e)}")
