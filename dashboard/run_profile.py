"""A run's own torch.profiler traces (``ddpscope run --profile``) on a page: loaded once,
cached as every trace is, or why not said on the page."""

from __future__ import annotations

import streamlit as st

from ddpscope.dashboard.catalog import stamp_of
from ddpscope.dashboard.loaders import load_trace
from ddpscope.viz.sources.run_profile import profile_folder
from ddpscope.viz.trace import TraceError


def load_run_profile_or_say(trace):
    """The run's profiler traces as a trace (``load_trace``, cached); None, said on the
    page, when they cannot be read."""
    folder = profile_folder(trace)
    try:
        return load_trace(str(folder), stamp_of(folder))
    except TraceError as e:
        st.error(f"The profiler traces of this run cannot be read: {e}")
        return None
