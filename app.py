"""ddpscope dashboard: trace a DDP run, look at it, predict and try another bucket_cap_mb,
rerun, compare;
watch a traced ring all-reduce step by step; see what each ZeRO stage does to memory.

Run: ``ddpscope dashboard [RUNS_DIR]`` or ``streamlit run app.py``. This file is the
page's outline; each page lives in ``dashboard/`` and lays out what ``viz`` computes.
"""

from __future__ import annotations

import os

import streamlit as st

from ddpscope.dashboard.serve import wait_for_preload

# `ddpscope dashboard`'s server imports the page's heavy modules on a thread as it starts
# (dashboard/serve.py): its first page run waits for them rather than import beside it
wait_for_preload()

from ddpscope.dashboard.catalog import (  # noqa: E402 - after the wait
    TRAINING_KINDS,
    handle_upload,
    list_runs,
    newest_run,
    of_kind,
    runs_dir,
    runs_note,
    stamp_of,
)
from ddpscope.dashboard.environment import OPEN_RUN_ENV, WARM_LAUNCHER_ENV  # noqa: E402 - after the wait
from ddpscope.dashboard.job_controls import command_policy, job_manager, job_status  # noqa: E402 - after the wait
from ddpscope.dashboard.loaders import load_trace  # noqa: E402 - after the wait
from ddpscope.dashboard.memory_page import render_memory  # noqa: E402 - after the wait
from ddpscope.dashboard.page_guard import page_guard  # noqa: E402 - after the wait
from ddpscope.dashboard.ring_page import render_ring  # noqa: E402 - after the wait
from ddpscope.dashboard.run_page import render_run  # noqa: E402 - after the wait
from ddpscope.dashboard.timeline_page import render_compare, render_timeline  # noqa: E402 - after the wait
from ddpscope.dashboard.whatif_page import render_whatif  # noqa: E402 - after the wait
from ddpscope.viz.trace import TraceError  # noqa: E402 - after the wait

st.set_page_config(page_title="ddpscope", layout="wide")
st.title("ddpscope")
st.caption("What each DDP gradient bucket's all-reduce does against the backward pass, how a ring "
           "all-reduce moves data, and what each ZeRO stage does to memory.")

# -- sidebar: which trace, uploads, the current job ---------------------------------------
handle_upload(st.sidebar.file_uploader("Upload a run (.zip / .tar.gz of a run folder) or profiler traces "
                                       "(a .json / .json.gz, or an archive of one per rank)",
                                       type=["zip", "tar", "gz", "tgz", "json"], key="upload"))
if "upload_error" in st.session_state:
    st.sidebar.error(st.session_state["upload_error"])
all_runs = list_runs()
traces = of_kind(all_runs, *TRAINING_KINDS)
if not traces:
    st.error(f"No traces found. Make one with: ddpscope run --out {runs_dir() / 'first'} -- train.py")
    st.stop()
if st.session_state.get("trace") not in traces:  # the run asked for, the user's newest, else the first sample
    asked = os.environ.get(OPEN_RUN_ENV)
    st.session_state["trace"] = (f"run: {asked}" if asked and f"run: {asked}" in traces else None) \
        or newest_run(traces) or next(iter(traces))
if (note := runs_note()) is not None:
    st.sidebar.info(note)
choice = st.sidebar.selectbox("Trace", list(traces), key="trace")
jobs = job_manager(str(runs_dir()), warm=os.environ.get(WARM_LAUNCHER_ENV, "1") != "0")
busy = jobs.current is not None and jobs.current.running
with st.sidebar:
    st.subheader("Runs")
    # the Run page refreshes its own view of the job: one refresher a page
    job_status(jobs, runs_dir(), refresh=st.session_state.get("page") != "Run")

path = traces[choice]

# -- the pages ------------------------------------------------------------------------------
# Only the open page computes: the tabs keep their state (a switch reruns the script) and
# are bound to the URL (?page=Memory+(ZeRO) opens that page: a deep link).
PAGES = ["Timeline", "Compare runs", "What-if", "Run", "Ring all-reduce", "Memory (ZeRO)"]
timeline_tab, compare_tab, whatif_tab, run_tab, ring_tab, memory_tab = st.tabs(PAGES, key="page",
                                                                             bind="query-params")
trace = None
if timeline_tab.open or whatif_tab.open or run_tab.open or memory_tab.open:  # the pages that show the open run
    try:
        trace = load_trace(str(path), stamp_of(path))
    except Exception as e:  # noqa: BLE001 - TraceError, or anything no check foresaw: one line, the page stays
        st.error(str(e) if isinstance(e, TraceError) else f"{choice} could not be read: {type(e).__name__}: {e}")
if run_tab.open:
    with run_tab, page_guard("The Run page"):
        render_run(path, trace, jobs, busy, command_policy())
if timeline_tab.open and trace is not None:
    with timeline_tab, page_guard("The Timeline"):
        render_timeline(path, trace)
if compare_tab.open:
    with compare_tab, page_guard("The comparison"):
        render_compare(traces, {label: kind for label, (_, kind) in all_runs.items()})
if whatif_tab.open and trace is not None:
    with whatif_tab, page_guard("The What-if page"):
        render_whatif(path, trace, traces, jobs, busy, command_policy())
if ring_tab.open:
    with ring_tab, page_guard("The Ring page"):
        render_ring(all_runs, jobs, busy)
if memory_tab.open:
    with memory_tab, page_guard("The Memory page"):
        render_memory(all_runs, jobs, busy, trace)
