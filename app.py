"""ddpscope dashboard: a traced run's timeline, its numbers and its buckets.

Run: ``streamlit run app.py``. All numbers and figures come from ``viz``; this file lays
out the page, caches loads and keeps widget state.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from viz.buckets import compute_bucket_table
from viz.gantt import make_timeline_figure
from viz.overlap import compute_rank_medians, compute_step_breakdown
from viz.trace import TraceError, load_run

ROOT = Path(__file__).resolve().parent
SAMPLES = ROOT / "samples"


def list_traces(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if (p / "run.json").exists()) if folder.is_dir() else []


@st.cache_data(show_spinner=False)
def load_trace(path: str, stamp: float):
    """The trace of one run folder (``stamp``, its run.json mtime, invalidates the cache)."""
    return load_run(path)


st.set_page_config(page_title="ddpscope", layout="wide")
st.title("ddpscope")
st.caption("What each DDP gradient bucket's all-reduce does against the backward pass.")

names = list_traces(SAMPLES)
if not names:
    st.error(f"No traces found in {SAMPLES}. Make one with: python -m tracer run --out samples/my-run")
    st.stop()
choice = st.sidebar.selectbox("Trace", names, key="trace")
path = SAMPLES / choice
try:
    trace = load_trace(str(path), (path / "run.json").stat().st_mtime)
except TraceError as e:
    st.error(str(e))
    st.stop()
run = trace.run

cols = st.columns(5)
cols[0].metric("model", str(run.get("model", "?")))
cols[1].metric("ranks", run.get("world_size", "?"))
cols[2].metric("bucket_cap_mb (MiB)", f"{run.get('bucket_cap_mb', float('nan')):g}")
cols[3].metric("buckets", len(run.get("bucket_layout") or []))
cols[4].metric("status", str(run.get("status", "?")))

st.subheader("Timeline: backward compute against bucket all-reduces")
all_steps = sorted(int(s) for s in trace.steps["step"].unique())
warm = set(int(s) for s in trace.steps.loc[trace.steps["warmup"], "step"])
default = next((s for s in all_steps if s not in warm), all_steps[0])
lo, hi = st.select_slider("Steps", options=all_steps, value=(default, default), key="steps")
ranks = st.multiselect("Ranks", sorted(trace.ranks), default=sorted(trace.ranks), key="ranks")
fig = make_timeline_figure(trace, steps=range(lo, hi + 1), ranks=ranks or None)
st.plotly_chart(fig, key="timeline")

st.subheader("Per rank, medians over non-warm-up steps (ms)")
st.dataframe(compute_rank_medians(trace).round(2), hide_index=True, key="medians")
with st.expander("Every step"):
    st.dataframe(compute_step_breakdown(trace, include_warmup=True).round(2), hide_index=True, key="per_step")
st.subheader("Buckets (medians over non-warm-up steps and ranks)")
st.dataframe(compute_bucket_table(trace).round(3), hide_index=True, key="buckets")
