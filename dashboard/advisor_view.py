"""The What-if page's advisor: the recommended bucket layout (uniform or per bucket) and
whether it is worth a change, "Apply" (the run again with it), and A against B: a run
and its applied rerun, predicted against measured, bucket by bucket, a diff timeline."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import streamlit as st

from ddpscope.dashboard.catalog import label_of, stamp_of
from ddpscope.dashboard.job_controls import CommandPolicy, job_button
from ddpscope.dashboard.loaders import events_trace
from ddpscope.dashboard.run_page import page_rerun
from ddpscope.dashboard.tables import show_table
from ddpscope.tracer.format import RUN_FILE
from ddpscope.tracer.launch.jobs import JobManager
from ddpscope.tracer.writer import read_json
from ddpscope.viz.trace import TraceError
from ddpscope.viz.whatif.ab import compute_ab_steps, compute_bucket_ab, make_ab_timeline_figure
from ddpscope.viz.whatif.advisor import SIMPLER, advise, setting_text
from ddpscope.viz.whatif.model import fit_model
from ddpscope.viz.whatif.report import cap_argument, searched_text
from ddpscope.viz.whatif.simulate import predict_run, traced_cap


@st.cache_data(show_spinner="Searching bucket layouts...", max_entries=8)
def advice_for(path: str, stamp: float, _model) -> tuple[dict, pd.DataFrame, object]:
    """(the recommendation as ``whatif --json`` gives it, the candidates searched, the
    setting) for the trace at ``path``; ``_model``: the model the page fitted to it (not
    hashed: ``path`` and ``stamp`` decide it)."""
    trace = events_trace(path, stamp)
    a = advise(trace, _model)
    return a.as_json(), a.candidates.drop(columns="setting"), a.setting


@st.cache_data(show_spinner="Comparing A and B...", max_entries=8)
def ab_tables(a_path: str, a_stamp: float, b_path: str, b_stamp: float):
    """(steps table, bucket table, diff timeline) of A against B, B predicted from A."""
    a, b = events_trace(a_path, a_stamp), events_trace(b_path, b_stamp)
    pred = predict_run(a, traced_cap(b), fit_model(a))
    fig = make_ab_timeline_figure({"A (measured)": a, "B predicted": pred, "B (measured)": b})
    return compute_ab_steps(a, pred, b), compute_bucket_ab(a, b), fig, setting_text(traced_cap(a)), \
        setting_text(traced_cap(b))


def render_advisor(path: Path, stamp: float, trace, model, jobs: JobManager, busy: bool,
                   policy: CommandPolicy) -> None:
    try:
        rec, candidates, setting = advice_for(str(path), stamp, model)
    except (TraceError, ValueError) as e:
        st.info(f"No advice for this trace: {e}")
        return
    lo, hi = rec["gain_interval_ms"]
    if rec["change"]:
        st.success(f"Advisor: **{setting_text(setting)}**, predicted step {rec['step_ms']:.1f} ms against "
                   f"{rec['traced_step_ms']:.1f} ms at the traced setting: {rec['gain_ms']:.1f} ms "
                   f"({rec['gain_pct']:.1f} %) faster, 95 % interval {lo:.1f}..{hi:.1f} ms from this run's "
                   "step-to-step noise.")
        if rec.get("in_code"):
            st.caption(rec["in_code"][0].upper() + rec["in_code"][1:] + ".")
    else:
        st.info(f"Advisor: keep {setting_text(setting)}. {rec['why'][0].upper()}{rec['why'][1:]}.")
    if rec.get("flag_off"):
        st.info(f"Without find_unused_parameters: {rec['flag_off']['text']}.")
    n = rec["searched"]
    with st.expander(f"What the advisor searched: {searched_text(n)}"):
        st.caption("Every candidate's step_ms is its replay on all of this trace's steps: the table's number for the "
                   "same setting (search_ms: the up to 8 steps the search compared layouts on). Layouts are "
                   "built by DDP's own bucketing from the gradients' ready order; a per-bucket layout is written as "
                   f"the bucket_cap_mb_list that builds it. The simplest setting within {100 * SIMPLER:.1f} % of the "
                   "fastest is the one recommended. A gain is worth a change when it exceeds √2 x the half-width "
                   "of the 95 % interval of this run's median step (bootstrapped over its steps).")
        if rec.get("note"):
            st.caption(f"Note: {rec['note']}.")
        show_table(candidates.round(2), key="advice_candidates")
    if rec["change"]:
        _apply_button(path, trace, rec, setting, jobs, busy, policy)


def _apply_button(path: Path, trace, rec: dict, setting, jobs: JobManager, busy: bool,
                  policy: CommandPolicy) -> None:
    settings, blocked = page_rerun(path, trace.run, policy)
    if settings is None:
        st.info(f"Apply is off: {blocked}.")
        return
    if blocked:
        st.info(f"Apply is off: {blocked}.")
    facts = {"advice": {"from": str(Path(path).resolve()), "predicted_step_ms": rec["step_ms"],
                        "predicted_exposed_ms": rec["exposed_ms"], "gain_ms": rec["gain_ms"],
                        "gain_interval_ms": rec["gain_interval_ms"]}}
    cap = {"bucket_cap_mb": None, **cap_argument(setting)}
    job_button(f"Apply: run it again with {setting_text(setting)}", "advice_apply", jobs.start,
               lambda: dict(**settings, **cap, source=path, facts=facts),
               disabled=busy or bool(blocked), type="primary",
               help="Runs the same job again for real (same ranks, steps, emulated nodes) with the recommendation; "
                    "open the new run here to see A against B.")


def render_ab(path: Path, stamp: float, trace, traces: dict[str, Path]) -> None:
    """A against B when the open run is an applied recommendation (B) or has one (A)."""
    pair = _pair(path, trace, traces)
    if pair is None:
        return
    a_path, b_path = pair
    st.subheader("A against B: the recommendation applied")
    try:
        steps, buckets, fig, a_setting, b_setting = ab_tables(str(a_path), stamp_of(a_path), str(b_path),
                                                              stamp_of(b_path))
    except (TraceError, ValueError) as e:
        st.info(f"A and B cannot be compared: {e}")
        return
    st.caption(f"A = {label_of(a_path)} ({a_setting}); B = {label_of(b_path)} ({b_setting}). "
               "B predicted from A, and B measured; medians over steps, each step the rank it waited for.")
    show_table(steps.round(2), key="ab_steps")
    st.plotly_chart(fig, key="ab_timeline")
    st.caption("Per bucket (medians over steps and ranks, ms from the rank's backward start): launch, time in "
               "flight, and exposed time, the part of the wait after backward that ends with this bucket.")
    show_table(buckets.round(2), key="ab_buckets")


def _pair(path: Path, trace, traces: dict[str, Path]) -> tuple[Path, Path] | None:
    """(A, B): this run and its newest applied rerun, or the run this one applied advice to."""
    came_from = _advised_from(trace.run)
    if came_from and Path(came_from).is_dir():
        return Path(came_from), path
    here = str(Path(path).resolve())
    for p in sorted(traces.values(), key=stamp_of, reverse=True):
        if p != path and _advised_from(_run_json(p)) == here:
            return path, p
    return None


def _advised_from(run: dict) -> str | None:
    """The run an applied recommendation came from (run.json's ``advice.from``)."""
    advice = run.get("advice")
    return advice.get("from") if isinstance(advice, dict) else None


def _run_json(path: Path) -> dict:
    try:
        run = read_json(path / RUN_FILE)
    except (OSError, ValueError):
        return {}
    return run if isinstance(run, dict) else {}
