"""Tables as every page shows them: readable headers, a missing value as "–"."""

from __future__ import annotations

import inspect
import math

import pandas as pd
import streamlit as st

#: st.dataframe's text for a missing value (a newer Streamlit's; older ones show "None")
_HAS_PLACEHOLDER = "placeholder" in inspect.signature(st.dataframe).parameters
#: column names kept as they are: the names of the settings users pass
_KEPT_NAMES = frozenset({"bucket_cap_mb", "bucket_cap_mb_list", "reshard_after_forward", "find_unused_parameters",
                         "reduce_bucket_size"})
_NAMED = {"mib": "MiB", "num_params": "parameters", "within_noise": "within noise"}
_WORDS = {"lo": "low", "hi": "high", "vs": "vs", "num": "number of"}
_UNIT_SUFFIXES = (("_ms", "ms"), ("_us", "µs"), ("_pct", "%"), ("_mib", "MiB"), ("_mb", "MiB"), ("_gbps", "GB/s"),
                  ("_bytes", "bytes"), ("_gib", "GiB"), ("_gb", "GB"))


def column_label(name: str) -> str:
    """A table header for people: ``step_ms_vs_first`` -> "step vs first (ms)" (the unit
    from the name's unit suffix, wherever it stands), a setting's name as users write it."""
    if name in _KEPT_NAMES:
        return name
    if name in _NAMED:
        return _NAMED[name]
    if "_" not in name:
        return name
    words, unit = name.split("_"), None
    for suffix, text in _UNIT_SUFFIXES:
        if f"_{suffix[1:]}" in f"_{name}" and suffix[1:] in words:
            words.remove(suffix[1:])
            unit = text
            break
    words = [_WORDS.get(w, w) for w in words]
    return " ".join(words) + (f" ({unit})" if unit else "")


def show_table(df: pd.DataFrame, *, key: str, where=None) -> None:
    """``st.dataframe`` as every page shows a table: no index, readable headers (the
    frame's own column names stay, for whoever reads it), an empty cell shown as "–",
    not "None" (a text cell here; a missing number by Streamlit's ``placeholder``)."""
    shown = df.copy()
    for c in shown.columns[shown.dtypes == object]:
        present = shown[c].dropna()
        if all(isinstance(v, str) for v in present):  # text (or nothing): a dash; bools and numbers: blank
            shown[c] = shown[c].map(lambda v: "–" if v is None or (isinstance(v, float) and math.isnan(v)) else v)
    config = {c: st.column_config.Column(column_label(c)) for c in shown.columns if isinstance(c, str)}
    extra = {"placeholder": "–"} if _HAS_PLACEHOLDER else {}  # a missing number, as a missing text
    (where or st).dataframe(shown, hide_index=True, key=key, column_config=config, **extra)
