"""ddpscope dashboard (first page: a traced run's summary; the full dashboard follows).

Run: ``streamlit run app.py``. All numbers come from ``viz``; this file lays out the page.
"""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from viz.buckets import compute_bucket_layout
from viz.overlap import compute_rank_medians
from viz.trace import TraceError, load_run

ROOT = Path(__file__).resolve().parent
SAMPLES = ROOT / "samples"


def list_traces(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if (p / "run.json").exists()) if folder.is_dir() else []


@st.cache_data(show_spinner=False)
def load_tables(path: str, stamp: float):
    """Everything the page shows for one run folder (``stamp`` invalidates the cache)."""
    trace = load_run(path)
    return trace.run, compute_rank_medians(trace), compute_bucket_layout(trace)


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
    run, medians, layout = load_tables(str(path), (path / "run.json").stat().st_mtime)
except TraceError as e:
    st.error(str(e))
    st.stop()

cols = st.columns(5)
cols[0].metric("model", str(run.get("model", "?")))
cols[1].metric("ranks", run.get("world_size", "?"))
cols[2].metric("bucket_cap_mb (MiB)", f"{run.get('bucket_cap_mb', float('nan')):g}")
cols[3].metric("buckets", len(layout))
cols[4].metric("status", str(run.get("status", "?")))

st.subheader("Per rank, medians over non-warm-up steps (ms)")
st.dataframe(medians.round(2), hide_index=True, key="medians")
st.subheader("Bucket layout after DDP's rebuild")
st.dataframe(layout.round({"mib": 3}), hide_index=True, key="layout")
