"""The Ring all-reduce page: one traced round animated, step times, the ring beside
``dist.all_reduce``, and a what-if to N = 64 ranks."""

from __future__ import annotations

import streamlit as st

from ddpscope.dashboard.catalog import of_kind, pick_run, runs_dir
from ddpscope.dashboard.job_controls import job_button, lab_controls, widget_now
from ddpscope.dashboard.loaders import load_ring_trace
from ddpscope.dashboard.tables import show_table
from ddpscope.dashboard.widget_defaults import start_from
from ddpscope.tracer.launch.jobs import JobManager
from ddpscope.viz.ring.animation import make_ring_animation_figure, make_ring_step_figure
from ddpscope.viz.ring.cost import (
    MAX_WHATIF_N,
    RingCostModel,
    compute_ring_fit,
    compute_ring_whatif,
    describe_fit,
    fit_ring_cost,
    make_ring_whatif_figure,
)
from ddpscope.viz.ring.metrics import compute_ring_step_times, compute_ring_summary, default_round


def render_ring(all_runs: dict, jobs: JobManager, busy: bool) -> None:
    with st.expander("Run a ring all-reduce here", expanded=False):
        c = st.columns(4)
        r_nproc = c[0].slider("ranks (per node)", 1, 4, 4, key="ring_run_nproc")
        r_mb = c[1].select_slider("tensor (MiB)", options=[0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0],
                                  value=4.0, key="ring_run_mb")
        r_repeat = c[2].slider("rounds", 1, 20, 5, key="ring_run_repeat")
        emulation = lab_controls("ring", disabled=busy)
        with c[3]:
            job_button("Run ring", "ring_run_button", jobs.start_ring,
                       lambda: dict(nproc=widget_now("ring_run_nproc", r_nproc), mb=widget_now("ring_run_mb", r_mb),
                                    repeat=widget_now("ring_run_repeat", r_repeat), **emulation()), disabled=busy)
    ring_path, ring = pick_run(of_kind(all_runs, "ring"), "Ring trace", "ring_trace", load_ring_trace,
                               f"No ring traces yet. Make one with: ddpscope ring --nproc 4 --mb 4 "
                               f"--out {runs_dir() / 'ring'}")
    if ring is not None:
        n = ring.world_size
        summary = compute_ring_summary(ring).set_index("bytes")
        main = summary.loc[ring.size_bytes] if ring.size_bytes in summary.index else None
        cols = st.columns(5)
        cols[0].metric("ranks", n)
        cols[1].metric("tensor (MiB)", f"{ring.size_bytes / 2**20:.4g}")
        cols[2].metric("ring, median (ms)", "-" if main is None else f"{main['ring_ms']:.2f}")
        cols[3].metric("dist.all_reduce, median (ms)", "-" if main is None else f"{main['ref_ms']:.2f}")
        cols[4].metric("ring busbw (GB/s)", "-" if main is None else f"{main['ring_busbw_GBps']:.3f}")
        if ring.run.get("status") != "complete":
            st.warning(f"This ring run did not complete ({ring.run.get('error') or ring.run.get('status')}); "
                       "finished rounds are shown.")
        rounds = ring.main_rounds() or ring.complete_rounds()
    if ring is not None and not rounds:
        st.error(f"{ring_path.name}: no ring round finished on every rank; nothing to animate.")
        ring = None
    if ring is not None:
        if st.session_state.get("ring_round") not in rounds:
            st.session_state["ring_round"] = default_round(ring)
        rnd = st.select_slider("Round (the median one first)", options=rounds, key="ring_round")
        try:
            animation = make_ring_animation_figure(ring, rnd)
        except ValueError as e:  # the recorded sends and receives do not add up (an edited trace)
            st.error(f"{ring_path.name}: round {rnd} cannot be replayed: {e}")
        else:
            st.plotly_chart(animation, key="ring_animation")
            st.caption("Play steps through the ring: each frame lasts in proportion to the step's measured time "
                       "(median over ranks). Slots: a rank's N chunks, with how many ranks' data each holds.")
        st.plotly_chart(make_ring_step_figure(compute_ring_step_times(ring, rnd)), key="ring_steps")
        st.subheader("Ring vs dist.all_reduce (medians over timed rounds; GB/s = 10^9 bytes/s)")
        show_table(summary.reset_index().round(4), key="ring_summary")

        st.subheader(f"What if: N = 2 .. {MAX_WHATIF_N} ranks")
        try:
            fitted = fit_ring_cost(ring)
        except ValueError as e:
            st.warning(f"Cannot fit the cost model: {e}; enter latency and bandwidth by hand.")
            fitted = RingCostModel(alpha_us=10.0, bandwidth_GBps=1.0, latency_fitted=False)
        start_from("whatif", ring_path, whatif_mb=ring.size_bytes / 2**20,  # a new trace: from its fit
                   whatif_alpha=round(fitted.alpha_us, 2), whatif_bw=float(f"{fitted.bandwidth_GBps:.4g}"))
        c = st.columns(3)
        mb = c[0].number_input("tensor M (MiB)", min_value=0.001, max_value=1e6, key="whatif_mb", format="%.3f")
        alpha = c[1].number_input("latency a per step (µs)", min_value=0.0, max_value=1e7, key="whatif_alpha")
        bw = c[2].number_input("bandwidth B (GB/s)", min_value=1e-4, max_value=1e5, key="whatif_bw", format="%.4f")
        model = RingCostModel(alpha_us=alpha, bandwidth_GBps=bw)
        size = mb * 2**20
        measured = ([(n, float(main["ring_ms"]))] if main is not None and abs(size - ring.size_bytes) < 1 else None)
        st.plotly_chart(make_ring_whatif_figure(compute_ring_whatif(model, size), size, measured), key="ring_whatif")
        st.caption(f"T(N) = 2(N-1)·a + 2(N-1)/N·M/B. The {describe_fit(ring, fitted)}. The model leaves out the "
                   "time to add chunks; on CPU that is folded into the fit.")
        if fitted.sizes:
            show_table(compute_ring_fit(ring, fitted).round(3), key="ring_fit")
