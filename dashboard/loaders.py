"""The pages' cached loaders: each takes everything it depends on as arguments (a run
folder's path, and ``stamp``, its newest file time, which renews the cache when the run
changes); and the step a page opens a loaded trace at (``first_real_step``)."""

from __future__ import annotations

import json
from pathlib import Path

import streamlit as st

from ddpscope.viz.ddp.rank_overview import ranks_to_show
from ddpscope.viz.perfetto import merge_run
from ddpscope.viz.ring.trace import load_ring
from ddpscope.viz.sources import load_training_trace
from ddpscope.viz.sources.rank_events import select_ranks, with_events
from ddpscope.viz.trace import TraceError
from ddpscope.viz.zero.trace import load_zero

#: the Gantt draws every rank of a run up to this many; beyond it, rank 0 and the slowest
GANTT_RANKS = 8


@st.cache_data(show_spinner=False, max_entries=16)
def load_trace(path: str, stamp: float):
    """The training trace in a folder, ddpscope's or a profiler's (``stamp``, the newest
    file time there, renews the cache). A ddpscope run opens summary first: every rank's
    steps from its summary, the events of the ranks drawn first (``ranks_to_show``:
    all of a run of up to ``GANTT_RANKS``; else rank 0 and the three slowest)."""
    trace = load_training_trace(path, events_for=())
    if trace.source != "ddpscope":
        return trace
    return with_events(trace, ranks_to_show(trace, GANTT_RANKS), missing_ok=True)  # a folder may hold summaries only


def events_trace(path: str, stamp: float):
    """``load_trace``'s trace cut to the ranks whose events it holds (the run's world
    size kept): what a model that needs every rank's buckets and gradients reads."""
    trace = load_trace(path, stamp)
    return trace if trace.all_events else select_ranks(trace, trace.event_ranks)


@st.cache_data(show_spinner="Reading the events of the ranks shown...", max_entries=16)
def load_events(path: str, stamp: float, ranks: tuple[int, ...]):
    """``load_trace``'s trace with the events of ``ranks`` read too (a cached trace
    already holds the ranks drawn first); ranks whose events are not in the folder
    (only their summaries) are left out: ``trace.event_ranks`` says which are in."""
    return with_events(load_trace(path, stamp), ranks, missing_ok=True)


@st.cache_data(show_spinner=False, max_entries=8)
def load_ring_trace(path: str, stamp: float):
    """The ring trace in a folder made by ``ddpscope ring`` (cached as ``load_trace``)."""
    return load_ring(path)


@st.cache_data(show_spinner=False, max_entries=8)
def load_zero_trace(path: str, stamp: float):
    """The ZeRO run in a folder made by ``ddpscope zero`` (cached as ``load_trace``)."""
    return load_zero(path)


def merged_trace_bytes(path: str) -> bytes:
    """Every rank of the run in one Chrome trace on rank 0's clock, for Perfetto."""
    return json.dumps(merge_run(path), separators=(",", ":")).encode()


def first_real_step(trace) -> int:
    """The first step past warm-up (else the first step); ``TraceError`` if the run
    recorded none (every page that draws a step says so in one line)."""
    s = trace.steps
    if not len(s):
        raise TraceError(f"{Path(str(trace.path)).name} holds no finished step: nothing to draw (the run ended "
                         "before its first step closed)")
    ok = s[~s["warmup"] & ~s["incomplete"]]
    return int(ok["step"].min()) if len(ok) else int(s["step"].min())
