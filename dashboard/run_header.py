"""The top of a run's Timeline: the model by its name, in full, then a row of the run's
numbers (DDP's and the sharded runs' alike)."""

from __future__ import annotations

import streamlit as st


def show_run_header(run: dict, metrics: list[tuple[str, object, str | None]]) -> None:
    """The model's class on a line of its own, with the script beside it (a metric column
    cut a long class at a few letters: "BertForM…"; the script's name, torchtitan's
    "train", says little alone), then ``metrics``, each ``(label, value, help)``, in a row."""
    model, script = run.get("model_class") or run.get("model") or "?", run.get("model")
    st.markdown(f"**Model** `{model}`" + (f" · script `{script}`" if script and script != model else ""))
    for col, (label, value, helptext) in zip(st.columns(len(metrics)), metrics):
        col.metric(label, value, help=helptext)
