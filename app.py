"""ddpscope dashboard: trace a DDP run, look at it, change bucket_cap_mb, rerun, compare;
watch a traced ring all-reduce step by step and project it to N ranks.

Run: ``streamlit run app.py``. Numbers and figures come from ``viz``; runs are started
through ``tracer.jobs``; this file lays out the page, caches loads and keeps widget state.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import streamlit as st

from tracer.launch.jobs import JobManager
from viz.archive import extract_run_archive, safe_name
from viz.buckets import compute_bucket_table
from viz.gantt import make_timeline_figure, timeline_extent_ms
from viz.overlap import compute_rank_medians, compute_run_comparison, compute_step_breakdown
from viz.perfetto import merge_run
from viz.ring import compute_ring_step_times, compute_ring_summary, default_round
from viz.ring_anim import make_ring_animation_figure, make_ring_step_figure
from viz.ring_cost import MAX_WHATIF_N, RingCostModel, compute_ring_whatif, fit_ring_cost, make_ring_whatif_figure
from viz.ring_trace import load_ring
from viz.trace import TraceError, load_run, run_kind
from viz.zero_figures import UNITS, make_zero_projection_figure, make_zero_run_figure
from viz.zero_model import (PRECISIONS, PRESETS, Precision, compute_zero_memory, largest_model,
                            transformer_activation_bytes)
from viz.zero_trace import compute_zero_comparison, load_zero

ROOT = Path(__file__).resolve().parent
SAMPLES = ROOT / "samples"
RUNS = Path(os.environ.get("DDPSCOPE_RUNS_DIR", ROOT / "runs"))
UPLOADS = RUNS / "uploads"
# 0.1 to 1000 billion parameters, 8 steps a decade, and every preset's own size
PARAM_OPTIONS_B = sorted({float(f"{10 ** (i / 8):.3g}") for i in range(-8, 25)} | {v / 1e9 for v in PRESETS.values()})
CAP_OPTIONS = [0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0]  # MiB, log-spaced


def list_runs() -> dict[str, tuple[Path, str]]:
    """Every run folder the page can show, by label, with its kind ("ddp", "ring" or
    "zero"): samples, runs made here, uploads. Read once per page run."""
    found = {}
    for prefix, folder in (("sample", SAMPLES), ("run", RUNS), ("upload", UPLOADS)):
        if folder.is_dir():
            for p in sorted(folder.iterdir(), reverse=prefix != "sample"):
                kind = run_kind(p)
                if kind is not None:
                    found[f"{prefix}: {p.name}"] = (p, kind)
    return found


def of_kind(runs: dict[str, tuple[Path, str]], kind: str) -> dict[str, Path]:
    return {label: path for label, (path, k) in runs.items() if k == kind}


def pick_run(runs: dict[str, Path], label: str, key: str, loader, hint: str):
    """A picker over ``runs`` that keeps a valid selection; ``(path, loaded run)``, the
    run None (with the message on the page) if there is none or it cannot be read."""
    if not runs:
        st.info(hint)
        return None, None
    if st.session_state.get(key) not in runs:
        st.session_state[key] = next(iter(runs))
    path = runs[st.selectbox(label, list(runs), key=key)]
    try:
        return path, loader(str(path), stamp_of(path))
    except TraceError as e:
        st.error(str(e))
        return path, None


@st.cache_data(show_spinner=False, max_entries=16)
def load_trace(path: str, stamp: float):
    """The trace in a run folder (``stamp``, the newest file time there, renews the cache)."""
    return load_run(path)


@st.cache_data(show_spinner=False, max_entries=8)
def load_ring_trace(path: str, stamp: float):
    """The ring trace in a folder made by ``python -m tracer ring`` (cached as ``load_trace``)."""
    return load_ring(path)


@st.cache_data(show_spinner=False, max_entries=8)
def load_zero_trace(path: str, stamp: float):
    """The ZeRO run in a folder made by ``python -m tracer zero`` (cached as ``load_trace``)."""
    return load_zero(path)


def merged_trace_bytes(path: str) -> bytes:
    """Every rank of the run in one Chrome trace on rank 0's clock, for Perfetto."""
    return json.dumps(merge_run(path), separators=(",", ":")).encode()


def stamp_of(path: Path) -> float:
    return max((p.stat().st_mtime for p in path.iterdir()), default=0.0)


@st.cache_resource
def job_manager(runs_dir: str) -> JobManager:
    return JobManager(Path(runs_dir))


def first_real_step(trace) -> int:
    s = trace.steps
    ok = s[~s["warmup"] & ~s["incomplete"]]
    return int(ok["step"].min()) if len(ok) else int(s["step"].min())


def handle_upload(upload) -> None:
    """Unpack an uploaded archive into its own folder; one-line error, nothing kept, if bad."""
    if upload is None or st.session_state.get("upload_done") == upload.file_id:
        return
    st.session_state["upload_done"] = upload.file_id
    dest = UPLOADS / f"{safe_name(Path(upload.name).stem)}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        extract_run_archive(upload.getvalue(), upload.name, dest)
        kind = run_kind(dest) or "ddp"
        {"ring": load_ring, "zero": load_zero}.get(kind, load_run)(dest)
    except TraceError as e:
        shutil.rmtree(dest, ignore_errors=True)
        st.session_state["upload_error"] = f"{upload.name}: {e}"
        return
    st.session_state.pop("upload_error", None)
    st.session_state[{"ring": "ring_trace", "zero": "zero_trace"}.get(kind, "trace")] = f"upload: {dest.name}"


def set_preset() -> None:
    """A preset fills in the parameter count (billions)."""
    st.session_state["proj_params_b"] = PRESETS[st.session_state["proj_preset"]] / 1e9


def set_precision_k() -> None:
    """A precision brings its usual K (12 for mixed-precision Adam, 8 for fp32 Adam)."""
    st.session_state["proj_k"] = int(PRECISIONS[st.session_state["proj_precision"]].k)


@st.fragment(run_every=1.0)
def job_status(jobs: JobManager) -> None:
    """The current job's progress, then its outcome (refreshes itself every second)."""
    job = jobs.current
    if job is None:
        st.caption(f"Runs started here are kept in {RUNS}.")
        return
    if job.running:
        st.progress(min(job.done / max(job.total, 1), 1.0),
                    text=f"{job.out.name}: {job.unit} {job.done}/{job.total}"
                         + (f" · {job.last_ms:.0f} ms" if job.last_ms and job.kind == "ddp" else ""))
        st.session_state["job_was_running"] = True
        return
    if st.session_state.pop("job_was_running", False):
        st.rerun(scope="app")  # list the new run everywhere
    if job.ok:
        where = {"ddp": "in the sidebar's Trace list", "ring": "on the Ring all-reduce tab",
                 "zero": "on the Memory (ZeRO) tab"}[job.kind]
        st.success(f"{job.out.name} finished: pick 'run: {job.out.name}' {where}.")
    else:
        reason = job.error or (job.result.reason if job.result else "unknown")
        st.error(f"{job.out.name} failed: {reason}")
        if job.result is not None and job.result.stderr_tail:
            st.code(job.result.stderr_tail, language=None)


def start_job(start, **settings) -> None:
    """Start a run from a button (``start``: a ``JobManager`` method); messages on the page."""
    try:
        started = start(**settings)
    except ValueError as e:
        st.error(str(e))
        return
    if started is None:
        st.info("A run is already going; it continues.")
    else:
        st.rerun()  # show the buttons disabled and the progress at once


# ---------------------------------------------------------------------------------------
st.set_page_config(page_title="ddpscope", layout="wide")
st.title("ddpscope")
st.caption("What each DDP gradient bucket's all-reduce does against the backward pass, how a ring "
           "all-reduce moves data, and what each ZeRO stage does to memory.")

handle_upload(st.sidebar.file_uploader("Upload a run (.zip / .tar.gz of a run folder)",
                                       type=["zip", "tar", "gz", "tgz"], key="upload"))
if "upload_error" in st.session_state:
    st.sidebar.error(st.session_state["upload_error"])
all_runs = list_runs()
traces = of_kind(all_runs, "ddp")
if not traces:
    st.error(f"No traces found. Make one with: python -m tracer run --out {RUNS / 'first'}")
    st.stop()
if st.session_state.get("trace") not in traces:
    st.session_state["trace"] = next(iter(traces))
choice = st.sidebar.selectbox("Trace", list(traces), key="trace")

jobs = job_manager(str(RUNS))
busy = jobs.current is not None and jobs.current.running
with st.sidebar:
    st.subheader("Runs")
    job_status(jobs)
view, compare, run_tab, ring_tab, memory_tab = st.tabs(
    ["Timeline", "Compare runs", "Run", "Ring all-reduce", "Memory (ZeRO)"])

with view:
    path = traces[choice]
    try:
        trace = load_trace(str(path), stamp_of(path))
    except TraceError as e:
        st.error(str(e))
        trace = None
    if trace is not None:
        run = trace.run
        cols = st.columns(5)
        cols[0].metric("model", str(run.get("model", "?")))
        cols[1].metric("ranks", run.get("world_size", "?"))
        cols[2].metric("bucket_cap_mb (MiB)", f"{run.get('bucket_cap_mb', float('nan')):g}")
        cols[3].metric("buckets", len(run.get("bucket_layout") or []))
        cols[4].metric("status", str(run.get("status", "?")))
        if run.get("status") == "failed":
            st.warning(f"This run failed: {run.get('error')}. Finished steps are shown.")
        steps = sorted(int(s) for s in trace.steps["step"].unique())
        start = first_real_step(trace)
        lo, hi = st.select_slider("Steps", options=steps, value=(start, start), key="steps")
        ranks = st.multiselect("Ranks", sorted(trace.ranks), default=sorted(trace.ranks), key="ranks")
        fig = make_timeline_figure(trace, steps=range(lo, hi + 1), ranks=ranks or None)
        st.plotly_chart(fig, key="timeline")
        st.subheader("Per rank, medians over non-warm-up steps (ms)")
        st.dataframe(compute_rank_medians(trace).round(2), hide_index=True, key="medians")
        with st.expander("Every step"):
            st.dataframe(compute_step_breakdown(trace, include_warmup=True).round(2), hide_index=True, key="per_step")
        st.subheader("Buckets (medians over non-warm-up steps and ranks)")
        st.dataframe(compute_bucket_table(trace).round(3), hide_index=True, key="buckets")
        st.download_button("Download all ranks as one Perfetto trace (rank 0's clock)",
                           data=lambda p=str(path): merged_trace_bytes(p),  # built on click only
                           file_name=f"{path.name}-merged.json",
                           mime="application/json", key="perfetto_download",
                           help="Open it at ui.perfetto.dev; the same as python -m viz perfetto.")

with compare:
    picked = st.multiselect("Runs to compare (the first is the reference)", list(traces),
                            default=list(traces)[:2], key="compare_runs")
    loaded = {}
    for label in picked:
        try:
            loaded[label] = load_trace(str(traces[label]), stamp_of(traces[label]))
        except TraceError as e:
            st.error(f"{label}: {e}")
    if len(loaded) >= 2:
        st.dataframe(compute_run_comparison(loaded).round(2), hide_index=True, key="comparison")
        width = max(timeline_extent_ms(t, [first_real_step(t)]) for t in loaded.values())
        for n, (label, t) in enumerate(loaded.items()):
            fig = make_timeline_figure(t, steps=[first_real_step(t)], title=f"{label} (step {first_real_step(t)})")
            fig.update_xaxes(range=[0, width * 1.02])  # one time scale for all runs
            st.plotly_chart(fig, key=f"compare_{n}")
    else:
        st.info("Pick at least two runs.")

with run_tab:
    c = st.columns(4)
    cap = c[0].select_slider("bucket_cap_mb (MiB, log scale)", options=CAP_OPTIONS, value=25.0, key="run_cap")
    nproc = c[1].slider("world size", 1, 4, 2, key="run_nproc")
    model = c[2].selectbox("model", ["gpt", "mlp"], key="run_model")
    n_steps = c[3].slider("steps", 3, 50, 10, key="run_steps")
    if st.button("Run", key="run_button", disabled=busy, type="primary"):
        start_job(jobs.start, model=model, nproc=nproc, bucket_cap_mb=cap, steps=n_steps)
    st.caption("Progress and the outcome show in the sidebar.")



with ring_tab:
    with st.expander("Run a ring all-reduce here", expanded=False):
        c = st.columns(4)
        r_nproc = c[0].slider("ranks", 2, 4, 4, key="ring_run_nproc")
        r_mb = c[1].select_slider("tensor (MiB)", options=[0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0],
                                  value=4.0, key="ring_run_mb")
        r_repeat = c[2].slider("rounds", 1, 20, 5, key="ring_run_repeat")
        if c[3].button("Run ring", key="ring_run_button", disabled=busy):
            start_job(jobs.start_ring, nproc=r_nproc, mb=r_mb, repeat=r_repeat)
    ring_path, ring = pick_run(of_kind(all_runs, "ring"), "Ring trace", "ring_trace", load_ring_trace,
                               f"No ring traces yet. Make one with: python -m tracer ring --nproc 4 --mb 4 "
                               f"--out {RUNS / 'ring'}")
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
        st.plotly_chart(make_ring_animation_figure(ring, rnd), key="ring_animation")
        st.caption("Play steps through the ring: each frame lasts in proportion to the step's measured time "
                   "(median over ranks). Slots: a rank's N chunks, with how many ranks' data each holds.")
        st.plotly_chart(make_ring_step_figure(compute_ring_step_times(ring, rnd)), key="ring_steps")
        st.subheader("Ring vs dist.all_reduce (medians over timed rounds; GB/s = 10^9 bytes/s)")
        st.dataframe(summary.reset_index().round(4), hide_index=True, key="ring_summary")

        st.subheader(f"What if: N = 2 .. {MAX_WHATIF_N} ranks")
        try:
            fitted = fit_ring_cost(ring)
        except ValueError as e:
            st.warning(f"Cannot fit the cost model: {e}; enter latency and bandwidth by hand.")
            fitted = RingCostModel(alpha_us=10.0, bandwidth_GBps=1.0, latency_fitted=False)
        if st.session_state.get("whatif_for") != str(ring_path):  # new trace: start from its fit
            st.session_state.update(whatif_for=str(ring_path), whatif_mb=ring.size_bytes / 2**20,
                                    whatif_alpha=round(fitted.alpha_us, 2),
                                    whatif_bw=float(f"{fitted.bandwidth_GBps:.4g}"))
        c = st.columns(3)
        mb = c[0].number_input("tensor M (MiB)", min_value=0.001, max_value=1e6, key="whatif_mb", format="%.3f")
        alpha = c[1].number_input("latency a per step (µs)", min_value=0.0, max_value=1e7, key="whatif_alpha")
        bw = c[2].number_input("bandwidth B (GB/s)", min_value=1e-4, max_value=1e5, key="whatif_bw", format="%.4f")
        model = RingCostModel(alpha_us=alpha, bandwidth_GBps=bw)
        size = mb * 2**20
        measured = ([(n, float(main["ring_ms"]))] if main is not None and abs(size - ring.size_bytes) < 1 else None)
        st.plotly_chart(make_ring_whatif_figure(compute_ring_whatif(model, size), size, measured), key="ring_whatif")
        st.caption(f"T(N) = 2(N-1)·a + 2(N-1)/N·M/B. Fitted to this trace's {fitted.sizes} tensor sizes: "
                   f"a = {fitted.alpha_us:.1f} µs, B = {fitted.bandwidth_GBps:.3g} GB/s"
                   + ("" if fitted.latency_fitted else " (latency not separable from this trace; set to 0)")
                   + ". The model leaves out the time to add chunks; on CPU that is folded into the fit.")


with memory_tab:
    unit = st.radio("Units", list(UNITS), horizontal=True, key="zero_unit",
                    help="GB and MB are 10^9 and 10^6 bytes (the ZeRO paper's unit); GiB and MiB 2^30 and 2^20.")
    scale = UNITS[unit]
    st.subheader("Measured: one model trained under each ZeRO stage")
    with st.expander("Run the ZeRO stages here", expanded=False):
        c = st.columns(3)
        z_model = c[0].selectbox("model", ["gpt", "mlp"], key="zero_run_model")
        z_nproc = c[1].slider("ranks", 2, 4, 2, key="zero_run_nproc")
        if c[2].button("Run ZeRO stages 0-3", key="zero_run_button", disabled=busy):
            start_job(jobs.start_zero, model=z_model, nproc=z_nproc)
    _, zt = pick_run(of_kind(all_runs, "zero"), "ZeRO run", "zero_trace", load_zero_trace,
                     f"No ZeRO runs yet. Make one with: python -m tracer zero --nproc 2 --model gpt "
                     f"--out {RUNS / 'zero'}")
    if zt is not None:
        if zt.run.get("status") != "complete":
            st.warning(f"This run did not complete ({zt.run.get('error') or zt.run.get('status')}); "
                       "finished stages are shown.")
        cmp = compute_zero_comparison(zt)
        c = st.columns(3)
        c[0].metric("model", str(zt.run.get("model", "?")))
        c[1].metric("parameters", f"{zt.params / 1e6:.2f} M")
        c[2].metric("ranks", zt.world_size)
        zrank = st.selectbox("Rank", sorted(int(r) for r in cmp["rank"].unique()), key="zero_rank")
        st.plotly_chart(make_zero_run_figure(cmp, unit, zrank), key="zero_run")
        st.caption("Measured: tensor accounting of what the rank holds (parameters after forward: FSDP's "
                   "unsharded copy in stage 2), and the step's peak from torch.profiler's memory events. "
                   "Predicted: the ZeRO model with the run's fp32 Adam (K = 8; 12 in stage 2, where the fp32 "
                   "shard is a master copy beside the unsharded one).")
        table = cmp[cmp["rank"] == zrank].copy()
        for col in ("model_state_bytes", "predicted_model_state_bytes", "peak_bytes", "comm_volume_bytes"):
            table[col.replace("bytes", unit)] = table.pop(col) / scale
        st.dataframe(table[["stage", "name"] + [c for c in table.columns if c.endswith(unit)]
                           + ["measured/predicted"]].round(4), hide_index=True, key="zero_table")
        comm = zt.comm[zt.comm["rank"] == zrank].copy()
        comm[f"message ({unit})"] = comm.pop("message_bytes") / scale
        comm[f"sent per rank, ring ({unit})"] = comm.pop("volume_bytes") / scale
        st.dataframe(comm.drop(columns="rank").round(4), hide_index=True, key="zero_comm")
        st.caption(f"Collectives of the measured step as the backend ran them. The model: 2P for stages 0-2, "
                   f"3P for stage 3 (x (N-1)/N with rings; P = {zt.params * 4 / scale:.4g} {unit} of fp32 "
                   "gradients). PyTorch's ZeRO-1 all-reduces gradients and then broadcasts parameters (3P, not "
                   "2P), and gloo runs a reduce-scatter as an all-reduce.")

    st.subheader("Projected: any model size, N and precision")
    c = st.columns(4)
    c[0].selectbox("Preset", list(PRESETS), index=1, key="proj_preset", on_change=set_preset)
    if "proj_params_b" not in st.session_state:
        set_preset()
    params_b = c[1].select_slider("parameters (billions, log scale)", options=PARAM_OPTIONS_B, key="proj_params_b",
                                  format_func=lambda b: f"{b:g}")
    n_dev = c[2].select_slider("N (data-parallel ranks)", options=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                               value=64, key="proj_n")
    prec_name = c[3].radio("Precision", list(PRECISIONS), key="proj_precision",
                           format_func=lambda k: PRECISIONS[k].name, on_change=set_precision_k)
    if "proj_k" not in st.session_state:
        set_precision_k()
    c = st.columns(4)
    k_bytes = c[0].slider("K (optimizer bytes / parameter)", 0, 32, key="proj_k")
    device_gib = c[1].number_input("device memory (GiB)", min_value=1.0, max_value=4096.0, value=80.0, key="proj_device")
    with_act = c[2].checkbox("add transformer activations", key="proj_act")
    act = 0.0
    if with_act:
        a = st.columns(4)
        act = transformer_activation_bytes(
            layers=a[0].number_input("layers", 1, 1000, 32, key="act_layers"),
            hidden=a[1].number_input("hidden", 64, 65536, 4096, key="act_hidden"),
            seq=a[2].number_input("sequence", 1, 1_000_000, 2048, key="act_seq"),
            micro_batch=a[3].number_input("micro-batch", 1, 1024, 1, key="act_mb"),
            bytes_per_value=PRECISIONS[prec_name].param)
        st.caption("Activations: s·b·h·(34 + 5·a·s/h) bytes per layer with 16-bit values (Korthikanti et al. 2022), "
                   "no recomputation, a = hidden/64 heads; doubled for fp32.")
    base = PRECISIONS[prec_name]
    prec = Precision(name=base.name, param=base.param, grad=base.grad, k=k_bytes)
    mem = compute_zero_memory(params_b * 1e9, n_dev, prec, act)
    st.plotly_chart(make_zero_projection_figure(mem, unit, device_gib * 2**30), key="zero_projection")
    fits = largest_model(device_gib * 2**30, n_dev, prec, act)
    view_mem = mem[["stage", "name"]].copy()
    view_mem[f"per device ({unit})"] = mem["total_bytes"] / scale
    view_mem[f"comm per rank and step ({unit})"] = mem["comm_bytes"] / scale
    view_mem["largest model that fits (B params)"] = fits["max_params"] / 1e9
    st.dataframe(view_mem.round(3), hide_index=True, key="zero_projection_table")
