"""The Timeline page (one run: Gantt of backward vs all-reduce, medians, buckets) and
the Compare page (several runs on one time scale)."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from ddpscope.dashboard.catalog import stamp_of
from ddpscope.dashboard.loaders import first_real_step, load_events, load_trace, merged_trace_bytes
from ddpscope.dashboard.rank_overview_view import default_ranks, render_rank_overview
from ddpscope.dashboard.run_header import show_run_header
from ddpscope.dashboard.run_profile import load_run_profile_or_say
from ddpscope.dashboard.sharded_view import render_sharded_timeline, show_sharded_comparison
from ddpscope.dashboard.tables import show_table
from ddpscope.tracer.options import GRAD_MARKS_FIRST_STEPS
from ddpscope.viz.ddp.buckets import compute_bucket_table
from ddpscope.viz.ddp.compare import compute_run_comparison, differences_text, median_step
from ddpscope.viz.ddp.gantt import make_timeline_figure
from ddpscope.viz.ddp.kernel_gantt import make_kernel_timeline_figure
from ddpscope.viz.ddp.kernel_overlap import compute_hta_breakdown
from ddpscope.viz.ddp.overlap import compute_rank_medians, compute_step_breakdown
from ddpscope.viz.ddp.own_collectives import compute_own_collectives, own_collectives_lines
from ddpscope.viz.ddp.profile_check import compute_profile_agreement
from ddpscope.viz.ddp.stages import compute_param_sync, param_sync_medians
from ddpscope.viz.ddp.stragglers import compute_straggler_summary, straggler_line
from ddpscope.viz.lanes import timeline_extent_ms
from ddpscope.viz.sources.run_profile import profile_folder
from ddpscope.viz.trace import TraceError


def render_timeline(path: Path, trace) -> None:
    if trace.source != "ddpscope":
        render_profile(path, trace)
        return
    if trace.shards is not None:
        render_sharded_timeline(trace)
        return
    run = trace.run
    show_run_header(run, [("ranks", run.get("world_size", "?"), None),
                          ("bucket_cap_mb (MiB)", f"{run.get('bucket_cap_mb', float('nan')):g}", None),
                          ("buckets", len(run.get("bucket_layout") or []), None), ("status", trace.status, None)])
    if trace.unfinished:
        st.warning(f"This run is {trace.status}: {trace.unfinished}. Finished steps are shown.")
    for note in run.get("notes") or []:
        st.info(f"ddpscope: {note}")
    render_rank_overview(trace)
    steps = sorted(int(s) for s in trace.steps["step"].unique())
    start = first_real_step(trace)
    lo, hi = st.select_slider("Steps", options=steps, value=(start, start), key="steps")
    ranks = st.multiselect("Ranks", sorted(trace.ranks), default=default_ranks(trace), key="ranks")
    shown = trace
    if not trace.all_events:  # opened from its summaries: the events of the ranks shown are read now
        wanted = sorted(ranks or default_ranks(trace))
        try:
            shown = load_events(str(path), stamp_of(path), tuple(wanted))
        except TraceError as e:
            st.error(str(e))
        if absent := [r for r in wanted if r not in (shown.event_ranks or ())]:
            st.info(f"Only the summary of rank {', '.join(map(str, absent))} is in this folder: its steps are drawn, "
                    f"not its buckets. Copy its rank-<r>.json beside the summaries to see them.")
    st.plotly_chart(make_timeline_figure(shown, steps=range(lo, hi + 1), ranks=ranks or default_ranks(trace)),
                    key="timeline")
    if (every := run.get("grad_marks_every")) and isinstance(every, int) and every > 1:
        st.caption(f"Traced with --grad-marks-every {every}: gradient-ready marks on steps 0-"
                   f"{GRAD_MARKS_FIRST_STEPS - 1}, then on 1 step in {every}; the other steps have every span but "
                   "no marks.")
    if profile_folder(trace) is not None:
        with st.expander("torch.profiler on the same run (ddpscope run --profile), side by side"):
            show_profile_beside(shown, range(lo, hi + 1), ranks)
    st.subheader("Per rank, medians over non-warm-up steps (ms)")
    show_table(compute_rank_medians(trace).round(2), key="medians")
    if trace.all_events:
        stragglers = compute_straggler_summary(trace)
        if (line := straggler_line(stragglers)) is not None:
            st.warning(line.capitalize() + ". The ▼ markers show who each bucket waited for.")
    else:
        stragglers = None
        st.caption(f"{trace.world_size} ranks, opened from their summaries: the steps of every rank above, the "
                   "buckets of the ranks shown. Who each bucket waited for needs every rank's events: "
                   "`ddpscope summary` and the overview name the ranks that arrive late.")
    with st.expander("Every step"):
        show_table(compute_step_breakdown(trace, include_warmup=True).round(2), key="per_step")
    sync = compute_param_sync(trace)
    med = param_sync_medians(trace, sync)  # non-warm-up steps, as `ddpscope summary` says them
    if med is not None:  # ZeRO-1: the optimizer's broadcasts, on each rank's communication lane
        st.info(f"ZeRO-1 (ZeroRedundancyOptimizer): after each update every rank broadcasts the parameters it "
                f"owns; the step waits for all of it: {med['sync_ms']:.2f} ms a step (median over non-warm-up "
                f"steps, {med['pct_of_step']:.1f} % of the step), {med['bytes'] / 2**20:.3f} MiB. "
                "The Memory page sets its model states beside ZeRO's stages.")
        with st.expander("Parameter broadcasts per step (ZeRO-1)"):
            show_table(sync.round(3), key="param_sync")
    if stragglers is not None:
        with st.expander("Stragglers: who the all-reduces waited for (ms)"):
            show_table(stragglers.round(2), key="stragglers")
    st.subheader("Buckets (medians over non-warm-up steps and ranks"
                 + ("" if trace.all_events else ", of the ranks shown") + ")")
    show_table(compute_bucket_table(shown).round(3), key="buckets")
    if len(own := compute_own_collectives(trace)):  # as `ddpscope summary` says them
        st.markdown("**Collectives outside the buckets** (their own lane above)\n"
                    + "\n".join(f"- {line}" for line in own_collectives_lines(own)))
    st.download_button("Download all ranks as one Perfetto trace (rank 0's clock)",
                       data=lambda p=str(path): merged_trace_bytes(p),  # built on click only
                       file_name=f"{path.name}-merged.json", mime="application/json", key="perfetto_download",
                       help="Open it at ui.perfetto.dev; the same as ddpscope perfetto.")


def render_profile(path: Path, trace) -> None:
    """A folder of profiler (Kineto) traces: kernels instead of DDP's phases."""
    run = trace.run
    present = run["ranks_present"]
    cols = st.columns(4)
    cols[0].metric("source", "torch.profiler")
    cols[1].metric("ranks", f"{len(present)} of {trace.world_size}")
    cols[2].metric("ProfilerSteps", trace.steps["step"].nunique())
    cols[3].metric("all-reduces per step", int(trace.buckets.groupby(["rank", "step"]).size().median())
                   if len(trace.buckets) else 0)
    for note in run["notes"]:
        st.info(note)
    steps = sorted(int(s) for s in trace.steps["step"].unique())
    if not steps:  # a profile taken without a schedule: nothing cut into steps to draw
        st.warning(f"{path.name} holds no ProfilerStep: profile with a schedule and call prof.step() each "
                   "training step (torch.profiler.schedule), then the steps can be drawn.")
        return
    render_rank_overview(trace)
    lo, hi = (st.select_slider("Steps", options=steps, value=(steps[0], steps[0]), key="steps")
              if len(steps) > 1 else (steps[0], steps[0]))
    ranks = st.multiselect("Ranks", present, default=[r for r in default_ranks(trace) if r in present] or present,
                           key="ranks")
    per_stream = st.toggle("One lane per GPU stream", value=False, key="per_stream")
    st.plotly_chart(make_kernel_timeline_figure(trace, steps=range(lo, hi + 1), ranks=ranks or None,
                                                per_stream=per_stream), key="timeline")
    st.subheader("Per rank, medians over ProfilerSteps (ms)")
    show_table(compute_rank_medians(trace).round(2), key="medians")
    st.subheader("As Holistic Trace Analysis computes them (its last ProfilerStep left out; %)")
    show_table(compute_hta_breakdown(trace).round(2), key="hta")
    with st.expander("Every step"):
        show_table(compute_step_breakdown(trace).round(2), key="per_step")
    if len(trace.buckets):
        st.subheader("All-reduces by order in the step (DDP's buckets), medians over steps and ranks")
        show_table(compute_bucket_table(trace).drop(columns=["num_params", "params"]).round(3), key="buckets")
    st.download_button("Download all ranks as one Perfetto trace (lowest rank's clock)",
                       data=lambda p=str(path): merged_trace_bytes(p), file_name=f"{path.name}-merged.json",
                       mime="application/json", key="perfetto_download")


def show_profile_beside(trace, steps, ranks) -> None:
    """The profiler's view of the shown steps (ProfilerStep#k is step k) and how its
    all-reduces agree with the tracer's buckets."""
    if (profile := load_run_profile_or_say(trace)) is None:
        return
    shown = [s for s in steps if s in set(profile.steps["step"])]
    if not shown:
        st.info(f"The profiler recorded steps {sorted(profile.steps['step'].unique())}; pick one of them above.")
        return
    st.plotly_chart(make_kernel_timeline_figure(profile, steps=shown, ranks=ranks or None,
                                                title="torch.profiler: ops and collectives"), key="profile_timeline")
    table = compute_profile_agreement(trace, profile)
    table = table[table["step"].isin(shown)]
    st.caption("Each bucket as the tracer and the profiler saw it (the profiler's times put on the tracer's clock "
               "with each rank's sampled offset): the profiler's span starts when the all-reduce ran (after it "
               "waited its turn) and ends about when the tracer saw it complete.")
    show_table(table.drop(columns=["launch_us", "done_us", "profile_start_us", "profile_end_us"]).round(3),
               key="profile_agreement")


def compare_defaults(traces: dict[str, Path], kinds: dict[str, str] | None = None) -> list[str]:
    """The two runs Compare opens on: the user's two newest of one kind (``kinds``: label ->
    "ddp", "sharded", ...; runs made here, then uploads), the newest kind first; else the
    newest beside a sample of its kind; else what there is, samples last."""
    kind = (kinds or {}).get
    own = [label for label in traces if not label.startswith("sample: ")]
    own.sort(key=lambda label: stamp_of(traces[label]), reverse=True)
    samples = [label for label in traces if label.startswith("sample: ")]
    for label in own:
        mine = [other for other in own if kind(other) == kind(label)]
        if len(mine) >= 2:
            return mine[:2][::-1]  # the older of the two first: the reference
    for label in own:
        like = [other for other in samples if kind(other) == kind(label)]
        if like:
            return [label, like[0]]
    return (own[:2][::-1] + samples)[:2]


def render_compare(traces: dict[str, Path], kinds: dict[str, str] | None = None) -> None:
    picked = st.multiselect("Runs to compare (the first is the reference)", list(traces),
                            default=compare_defaults(traces, kinds), key="compare_runs")
    loaded = {}
    for label in picked:
        try:
            loaded[label] = load_trace(str(traces[label]), stamp_of(traces[label]))
        except TraceError as e:
            st.error(f"{label}: {e}")
    # like with like: a sharded run (FSDP2, DeepSpeed) has no DDP buckets to set beside a DDP run's
    sharded = {label: getattr(t, "shards", None) is not None for label, t in loaded.items()}
    kind = next(iter(sharded.values()), False)
    left = [label for label, s in sharded.items() if s != kind]
    if left:
        st.warning(f"{', '.join(left)} not compared with {next(iter(loaded))}: Compare sets DDP runs beside DDP runs "
                   "and sharded runs (FSDP2, DeepSpeed) beside sharded runs")
    loaded = {label: t for label, t in loaded.items() if label not in left}
    if len(loaded) >= 2 and kind:
        show_sharded_comparison(loaded)
    elif len(loaded) >= 2:
        show_comparison(loaded, key="compare")
    else:
        st.info("Pick at least two runs of one kind.")


def show_comparison(loaded: dict, key: str, layouts: bool = False) -> None:
    """Runs side by side: the differences table over all their steps (with intervals, and
    what differs besides the setting said first), one timeline each of its median step on
    one time scale and, with ``layouts``, their bucket tables."""
    table = compute_run_comparison(loaded)
    for line in differences_text(table):
        (st.warning if "not the same job" in line else st.info)(line)
    show_table(table.round(2), key=f"{key}_table")
    st.caption("Medians over every non-warm-up step, each step the numbers of the rank it waited for (the least "
               "exposed communication: the others' holds their wait for it; the step its ranks' mean). "
               "step low..high: the median's 95 % interval; step vs first low..high: the interval of the "
               "difference to the first run (each run's steps resampled, 2,000 times); within noise: that "
               "interval holds 0.")
    shown = {label: median_step(t) for label, t in loaded.items()}
    shown = {label: first_real_step(loaded[label]) if s is None else s for label, s in shown.items()}
    width = max(timeline_extent_ms(t, [shown[label]]) for label, t in loaded.items())
    for n, (label, t) in enumerate(loaded.items()):
        fig = make_timeline_figure(t, steps=[shown[label]], title=f"{label}: step {shown[label]}, its median step",
                                   ranks=None if t.all_events else list(t.event_ranks))
        fig.update_xaxes(range=[0, width * 1.02])  # one time scale for all runs
        st.plotly_chart(fig, key=f"{key}_{n}")
    if layouts:
        st.subheader("Bucket layouts")
        cols = st.columns(len(loaded))
        for n, (col, (label, t)) in enumerate(zip(cols, loaded.items())):
            col.caption(f"{label}: {len(t.run.get('bucket_layout') or [])} buckets, "
                        f"bucket_cap_mb {t.run.get('bucket_cap_mb', float('nan')):g}")
            show_table(compute_bucket_table(t)[["bucket", "mib", "num_params", "duration_ms", "params"]].round(3),
                       key=f"{key}_layout_{n}", where=col)
