"""The Timeline's overview of every rank (above the Gantt): a heatmap of ranks x steps,
the spread per step, the ranks that hold the others back; a click on a rank puts it in
the Gantt."""

from __future__ import annotations

import streamlit as st

from ddpscope.dashboard.loaders import GANTT_RANKS
from ddpscope.dashboard.tables import show_table
from ddpscope.viz.ddp.rank_overview import (
    METRICS,
    cached_rank_overview,
    compute_slow_ranks,
    make_rank_heatmap_figure,
    make_step_spread_figure,
    ranks_to_show,
    slow_rank_line,
)


def default_ranks(trace) -> list[int]:
    """The ranks the Gantt opens with: all of a small run; of a big one, rank 0 and the
    three ranks that held the others back most."""
    return ranks_to_show(trace, GANTT_RANKS)


def render_rank_overview(trace, ranks_key: str = "ranks") -> None:
    """Above the Gantt, for runs of more than two ranks (two are both in the Gantt, with
    the straggler table below). A click on a heatmap cell adds its rank to the Gantt's
    ranks (the multiselect under ``ranks_key``, drawn after this)."""
    overview = cached_rank_overview(trace)  # once per loaded trace (load_trace caches the trace)
    n = overview["rank"].nunique() if len(overview) else 0
    if n <= 2:
        return
    with st.expander(f"All {n} ranks: where each one stands", expanded=True):
        slow = compute_slow_ranks(overview)
        if (line := slow_rank_line(slow)) is not None:
            st.warning(line.capitalize() + ".")
        metric = st.radio("Show", list(METRICS), format_func=METRICS.get, horizontal=True, key="overview_metric")
        event = st.plotly_chart(make_rank_heatmap_figure(overview, metric), key="overview_heatmap",
                                on_select="rerun", selection_mode="points")
        picked = sorted({int(p["y"]) for p in (event.selection.points if event else []) if "y" in p})
        if picked:
            shown = set(st.session_state.get(ranks_key) or [])
            if not set(picked) <= shown:
                st.session_state[ranks_key] = sorted(shown | set(picked))
            st.caption(f"Rank {', '.join(map(str, picked))} put in the timeline below.")
        else:
            st.caption("Click a cell to put its rank in the timeline below.")
        st.plotly_chart(make_step_spread_figure(overview, metric), key="overview_spread")
        show_table(slow.head(20).round(2), key="overview_slow")
