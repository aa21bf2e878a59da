"""The What-if page: predicted step time against bucket_cap_mb from the open trace, the
real runs of the same job on the same axes, a predicted timeline beside a measured one,
"Run at this cap" (the live loop), and a projection to another world size and link."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import streamlit as st

from ddpscope.dashboard.advisor_view import render_ab, render_advisor
from ddpscope.dashboard.catalog import SAMPLES, label_of, stamp_of, uploads_dir
from ddpscope.dashboard.job_controls import CommandPolicy, job_button, widget_now
from ddpscope.dashboard.loaders import events_trace, first_real_step, load_trace
from ddpscope.dashboard.run_page import page_rerun
from ddpscope.dashboard.tables import show_table
from ddpscope.dashboard.widget_defaults import start_from
from ddpscope.tracer.launch.jobs import JobManager
from ddpscope.viz.ddp.compare import compute_run_comparison, same_job, settings_apart
from ddpscope.viz.ddp.gantt import make_timeline_figure
from ddpscope.viz.lanes import timeline_extent_ms
from ddpscope.viz.trace import TraceError
from ddpscope.viz.whatif.advisor import gain_noise_ms, mark_within_noise
from ddpscope.viz.whatif.cost import read_calibration
from ddpscope.viz.whatif.figures import make_cap_sweep_figure
from ddpscope.viz.whatif.layout import cap_label, is_cap_list
from ddpscope.viz.whatif.model import UNFITTED_LATENCY, fit_model
from ddpscope.viz.whatif.projection import LINK_PRESETS, Link, project_model
from ddpscope.viz.whatif.report import regime
from ddpscope.viz.whatif.simulate import predict_run, traced_cap
from ddpscope.viz.whatif.sweep import (
    DEFAULT_CAPS,
    MIN_GAIN,
    compute_cap_sweep,
    compute_measured_points,
    compute_replay_check,
    recommend_cap,
    replay_check_text,
)


@st.cache_data(show_spinner="Fitting the model to the trace...", max_entries=8)
def whatif_model(path: str, stamp: float):
    """The model fitted to the trace at ``path`` (and its calibration), once per trace."""
    return fit_model(events_trace(path, stamp))


@st.cache_data(show_spinner="Predicting every cap...", max_entries=8)
def cap_sweep(path: str, stamp: float, caps: tuple[float, ...], world_size: int | None = None,
              bandwidth_gbps: float | None = None, latency_us: float | None = None):
    """(sweep table, recommendation, model notes) for the trace at ``path``; with a world
    size and link, the projection instead."""
    trace = events_trace(path, stamp)
    fitted = whatif_model(path, stamp)
    model = fitted
    if world_size is not None:
        model = project_model(fitted, world_size, Link(bandwidth_gbps=bandwidth_gbps, latency_us=latency_us))
    sweep = compute_cap_sweep(trace, caps, model, fitted)
    best = recommend_cap(sweep)
    if world_size is None:  # this run's step-to-step noise; a projection's is not this run's
        best["noise_ms"] = gain_noise_ms(trace)
        sweep = mark_within_noise(sweep, best["noise_ms"])
        best["replay_check"] = replay_check_text(compute_replay_check(trace, sweep))  # a projection has no own run
    note = sweep.attrs.get("note")  # a torch.compile'd model: caps it refuses are left out
    table = pd.DataFrame(sweep)
    table.attrs = {}  # the predicted traces stay out of the cache
    return table, best, list(model.notes) + ([note] if note else [])


def sweep_caption(sweep: pd.DataFrame, best: dict, noise: float) -> str:
    """What the curve says, in the table's numbers: the fastest cap on it, the one marked
    (the traced cap stays marked unless another beats it by ``MIN_GAIN``), and the caps
    within this run's noise of the fastest."""
    fastest = sweep.loc[sweep["step_ms"].idxmin()]
    text = (f"Of the uniform caps on the curve, {fastest['bucket_cap_mb']:g} MiB is predicted fastest "
            f"({fastest['step_ms']:.1f} ms a step)")
    if best["gain_ms"] == 0 and fastest["step_ms"] < best["step_ms"]:
        text += (f", under {100 * MIN_GAIN:g} % faster than the traced {best['bucket_cap_mb']:g} MiB "
                 f"({best['step_ms']:.1f} ms), which stays marked best: no cap is worth the change")
    alike = sweep[sweep["within_noise"]]["bucket_cap_mb"] if "within_noise" in sweep else []
    if len(alike) > 1:
        text += (f"; {', '.join(f'{c:g}' for c in sorted(set(alike)))} MiB cannot be told apart from it: their "
                 f"steps are within this run's noise ({noise:.1f} ms, the shaded band)")
    return text + ". The advisor below also searches per-bucket layouts; its numbers are this table's."


@st.cache_data(show_spinner=False, max_entries=16)
def predicted_trace(path: str, stamp: float, cap: float | str):
    """The trace predicted at ``cap`` MiB (at its own cap: replayed as it ran, DDP's
    default first bucket included; a text: the traced ``bucket_cap_mb_list``)."""
    trace = events_trace(path, stamp)
    if isinstance(cap, str):
        cap = traced_cap(trace)
    elif at_ddps_default(trace, cap):
        cap = None  # DDP's default, as it ran
    return predict_run(trace, cap, whatif_model(path, stamp))


def at_ddps_default(trace, cap: float | str) -> bool:
    """Whether ``cap`` on the slider is the trace's own setting and that was DDP's default
    (no bucket_cap_mb passed: 25 MiB, the first bucket 1 MiB), which an explicit 25 is not:
    then it is predicted, matched to real runs and rerun as DDP's default."""
    return (not isinstance(cap, str) and traced_cap(trace) is None
            and cap == float(trace.run.get("bucket_cap_mb") or 25.0))


def render_whatif(path: Path, trace, traces: dict[str, Path], jobs: JobManager, busy: bool,
                  policy: CommandPolicy) -> None:
    if trace.source != "ddpscope":
        st.info("No prediction for a profiler trace: the what-if model needs each gradient's ready time, which "
                "only a ddpscope trace records. Trace the job with `ddpscope run` to predict other caps.")
        return
    shards = getattr(trace, "shards", None)
    if shards is not None:  # what a sharded run can change is not a bucket cap: the Run page predicts it
        name, what = (("DeepSpeed", "another ZeRO stage's model states, and another reduce_bucket_size's peak "
                       "memory and step time, predicted from this trace")
                      if shards.framework == "deepspeed" else
                      ("FSDP2", "reshard_after_forward and the prefetch depths: peak memory and step time, predicted"))
        st.info(f"This is a sharded run ({name}): the What-if predicts DDP's bucket caps. Its own settings are on "
                f"the Run page ({what}), beside a rerun that checks them; `ddpscope whatif {trace.path}` prints "
                "them for every choice; the Memory (ZeRO) page sets it among ZeRO's stages.")
        return
    # said only of a trace it replays (a profiler trace's or a sharded run's page says why not, alone)
    st.caption("Every step of the open trace replayed with the buckets DDP would build at another bucket_cap_mb: "
               "gradients ready when they were, all-reduces costing what this run's cost, compute slowed by "
               "communication as measured. Predictions, not measurements: the crosses are real runs.")
    stamp = stamp_of(path)
    if not trace.all_events:
        st.caption(f"{trace.world_size} ranks: predicted from the events of ranks "
                   f"{', '.join(map(str, trace.event_ranks))} (rank 0 and the slowest), at the run's world size; "
                   "the measured rows and the advisor's traced step are those ranks' too (`ddpscope whatif` reads "
                   "every rank's events).")
        trace = events_trace(str(path), stamp)
    try:
        sweep, best, notes = cap_sweep(str(path), stamp, tuple(DEFAULT_CAPS))
    except (TraceError, ValueError) as e:
        st.info(f"No prediction for this trace: {e}")
        return
    st.caption(regime(trace))
    _calibration(path, stamp, trace, jobs, busy)
    render_ab(path, stamp, trace, traces)
    measured, apart = _measured_runs(trace, traces)
    points = compute_measured_points(measured)
    noise = best.get("noise_ms", float("nan"))
    st.plotly_chart(make_cap_sweep_figure(sweep, points, best["bucket_cap_mb"], noise_ms=noise), key="predict_curve")
    st.caption(sweep_caption(sweep, best, noise))
    if apart:
        said = [f"{r.run} ({settings_apart(trace, apart[r.run])})" + (f", {r.step_ms:.1f} ms a step"
                                                                      if math.isfinite(r.step_ms) else "")
                for r in compute_measured_points(apart).itertuples()]
        st.caption("Not on the curve: runs of this job with other settings than the cap, which the curve holds as "
                   f"this run ran them: {'; '.join(said)} (medians over steps, each step the rank it waited for). "
                   "Compare runs sets them side by side.")
    if best.get("replay_check"):
        st.caption(best["replay_check"][0].upper() + best["replay_check"][1:] + ".")
    render_advisor(path, stamp, trace, whatif_model(str(path), stamp), jobs, busy, policy)
    with st.expander("Predicted table and how the model was fitted"):
        show_table(sweep.round(2), key="predict_table")
        for note in notes:
            st.caption(note)
        st.caption("`ddpscope calibrate RUN` measures all-reduce times and contention on these ranks; the "
                   "prediction uses it when the run folder has one.")
    caps = sorted(set(sweep["bucket_cap_mb"].tolist()))
    own = traced_cap(trace)
    if is_cap_list(own):  # a list-traced run: its list is a setting of its own, beside the uniform caps
        caps = [cap_label(own)] + caps
    start_from("predict", path, predict_cap=best["bucket_cap_mb"])
    cap = st.select_slider("A cap to look at (MiB; a list: the traced bucket_cap_mb_list)", options=caps,
                           key="predict_cap")
    _predicted_beside_measured(path, stamp, trace, cap, measured)
    _run_at_cap(path, trace, cap, jobs, busy, policy)
    with st.expander("Projection: another world size and link"):
        _projection(path, stamp, trace)


def _calibration(path: Path, stamp: float, trace, jobs: JobManager, busy: bool) -> None:
    """Without a calibration of these ranks: what the prediction lacks, and a button that
    measures it here (``ddpscope calibrate``, into the run's folder, which renews the page's
    model). Not for a run from elsewhere: this machine's links are not the ones it ran on."""
    cost = whatif_model(str(path), stamp).cost
    if cost.calibrated:
        return
    calibration = read_calibration(path)  # read by the model without an error: there, not used
    if calibration is not None:
        st.caption(f"The calibration in this run's folder is not used: "
                   f"{calibration.unlike(trace.run, trace.world_size)}.")
    fitted = cost.source.removeprefix("the run's own buckets, ")
    said = (f"No calibration of these ranks. The all-reduce cost is fitted to this run's buckets: {fitted}. "
            f"{UNFITTED_LATENCY[0].upper()}{UNFITTED_LATENCY[1:]}." if not cost.latency_fitted else
            "No calibration of these ranks: each all-reduce's cost is fitted to this run's buckets alone, and "
            "what it takes from backward's compute to what the trace shows.")
    (st.warning if not cost.latency_fitted else st.caption)(said)
    if path.parent in (uploads_dir(), SAMPLES):
        st.caption("Calibrating is off for this run: it ran on another machine (an upload or a sample), whose "
                   "links are not this one's.")
        return
    job_button("Calibrate these ranks", "predict_calibrate", jobs.start_calibrate, lambda: {"run": path},
               disabled=busy,
               help=f"`ddpscope calibrate` on {trace.world_size} ranks, as the run had: all-reduces of 4 KiB to "
                    "256 MiB alone and beside backward-like compute (under a minute on a small machine); the "
                    "predictions here then use it.")


def _measured_runs(trace, traces: dict[str, Path]) -> tuple[dict, dict]:
    """Runs of the same job (same world size, parameters, script or demo), loaded
    (``{label: trace}``): those that ran this run's settings but the cap (the curve's
    measured points), and those that did not (``settings_apart``: with
    ``find_unused_parameters`` off, a run at the same cap is another layout)."""
    out, apart = {}, {}
    for label, p in traces.items():
        try:
            t = load_trace(str(p), stamp_of(p))
            if same_job(trace, t) and t.run.get("bucket_cap_mb"):
                (apart if settings_apart(trace, t) else out)[label] = t
        except Exception:  # noqa: BLE001 - a run that cannot be read is left out here; opening it says why
            continue
    return out, apart


def _predicted_beside_measured(path: Path, stamp: float, trace, cap: float | str, measured: dict) -> None:
    default = at_ddps_default(trace, cap)
    text = (f"{cap} MiB (the traced list)" if isinstance(cap, str) else
            f"DDP's default ({cap:g} MiB, first bucket 1)" if default else f"{cap:g} MiB")
    pred = predicted_trace(str(path), stamp, cap if isinstance(cap, str) else float(cap))
    # a real run of the same layout: DDP's default is not an explicit 25 MiB (its first bucket is 1 MiB)
    real = {} if isinstance(cap, str) else \
        {k: t for k, t in measured.items()
         if abs(float(t.run["bucket_cap_mb"]) - cap) < 1e-9 and (traced_cap(t) is None) == default}
    label, real_t = next(iter(real.items()), (None, None))
    if real_t is None:
        label, real_t = label_of(path), trace
        if not isinstance(cap, str):
            st.caption(f"No real run at {text} yet: the predicted timeline is shown beside the traced run.")
    shown = {f"predicted at {text}": pred, f"{label} (measured)": real_t}
    show_table(compute_run_comparison(shown).round(2), key="predict_vs")
    width = max(timeline_extent_ms(t, [first_real_step(t)]) for t in shown.values())
    cols = st.columns(2)
    for n, (col, (name, t)) in enumerate(zip(cols, shown.items())):
        fig = make_timeline_figure(t, steps=[first_real_step(t)], title=name)
        fig.update_xaxes(range=[0, width * 1.02])
        col.plotly_chart(fig, key=f"predict_timeline_{n}")


def _run_at_cap(path: Path, trace, cap: float | str, jobs: JobManager, busy: bool, policy: CommandPolicy) -> None:
    settings, blocked = page_rerun(path, trace.run, policy)
    if settings is None:
        st.info(f"This trace cannot be rerun from here: {blocked}.")
        return
    if blocked:
        st.info(f"Run at this cap is off: {blocked}.")

    def chosen() -> dict:
        now = widget_now("predict_cap", cap)
        if isinstance(now, str):
            return {"bucket_cap_mb": None, "bucket_cap_mb_list": now}
        if at_ddps_default(trace, now):  # as predicted: no bucket_cap_mb passed, as the trace ran
            return {"bucket_cap_mb": None}
        return {"bucket_cap_mb": float(now)}

    label = (f"Run at bucket_cap_mb_list = {cap}" if isinstance(cap, str) else
             "Run with DDP's default buckets (25 MiB, first bucket 1)" if at_ddps_default(trace, cap) else
             f"Run at bucket_cap_mb = {cap:g}")
    job_button(label, "predict_run", jobs.start,
               lambda: dict(**settings, **chosen(), source=path),
               disabled=busy or bool(blocked), type="primary",
               help="Runs it for real (the live loop); when it ends it shows on the curve and beside the prediction.")


def _projection(path: Path, stamp: float, trace) -> None:
    st.caption("Projection, not prediction: this trace's compute with a ring all-reduce of another world size "
               "over another link, 2(N-1)/N x M / B + 2(N-1) x latency, one all-reduce at a time (NCCL), "
               "nothing taken from compute. Would this bucket size still be right there?")
    c = st.columns(4)
    preset = c[0].selectbox("link", list(LINK_PRESETS), index=1, key="predict_proj_link")
    start_from("predict_proj_preset", preset,  # a new preset: its numbers, still editable
               predict_proj_bw=LINK_PRESETS[preset].bandwidth_gbps, predict_proj_lat=LINK_PRESETS[preset].latency_us)
    n = c[1].number_input("world size N", min_value=2, max_value=100_000, value=64, step=1, key="predict_proj_n")
    bw = c[2].number_input("bandwidth B (GB/s)", min_value=0.001, max_value=10_000.0, key="predict_proj_bw")
    lat = c[3].number_input("latency per ring step (µs)", min_value=0.0, max_value=100_000.0, key="predict_proj_lat")
    try:
        sweep, best, _ = cap_sweep(str(path), stamp, tuple(DEFAULT_CAPS), int(n), float(bw), float(lat))
    except (TraceError, ValueError) as e:
        st.error(str(e))
        return
    fig = make_cap_sweep_figure(sweep, None, best["bucket_cap_mb"],
                                title=f"Projection: {int(n)} ranks over {preset} ({bw:g} GB/s, {lat:g} µs)")
    st.plotly_chart(fig, key="predict_proj_curve")
    here = sweep[sweep["traced"]]
    st.write(f"Projected best: **{best['bucket_cap_mb']:g} MiB** (step {best['step_ms']:.1f} ms"
             + (f"; the traced cap: {float(here['step_ms'].iloc[0]):.1f} ms" if len(here) else "") + ").")
    show_table(pd.DataFrame(sweep).round(2), key="predict_proj_table")
