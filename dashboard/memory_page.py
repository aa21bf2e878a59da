"""The Memory (ZeRO) page: measured memory per ZeRO stage beside the ZeRO model, and a
projection to any model size, N and precision."""

from __future__ import annotations

import streamlit as st

from ddpscope.dashboard.catalog import of_kind, pick_run, runs_dir
from ddpscope.dashboard.job_controls import job_button, widget_now
from ddpscope.dashboard.loaders import load_zero_trace
from ddpscope.dashboard.sharded_view import render_sharded_memory
from ddpscope.dashboard.tables import show_table
from ddpscope.tracer.launch.jobs import JobManager
from ddpscope.viz.ddp.stages import (
    compute_ddp_stage_comparison,
    ddp_comm_lines,
    ddp_stage,
    ddp_stage_differences,
    frozen_params,
)
from ddpscope.viz.sharded.figures import make_stage_comparison_figure
from ddpscope.viz.units import FAMILIES, FAMILY_LABELS, UNITS
from ddpscope.viz.zero.figures import make_zero_projection_figure, make_zero_run_figure
from ddpscope.viz.zero.model import (
    PRECISIONS,
    PRESETS,
    Precision,
    compute_zero_memory,
    largest_model,
    transformer_activation_bytes,
)
from ddpscope.viz.zero.trace import compute_zero_comparison

# 0.1 to 1000 billion parameters, 8 steps a decade, and every preset's own size
PARAM_OPTIONS_B = sorted({float(f"{10 ** (i / 8):.3g}") for i in range(-8, 25)} | {v / 1e9 for v in PRESETS.values()})


def set_preset() -> None:
    """A preset fills in the parameter count (billions)."""
    st.session_state["proj_params_b"] = PRESETS[st.session_state["proj_preset"]] / 1e9


def set_precision_k() -> None:
    """A precision brings its usual K (12 for mixed-precision Adam, 8 for fp32 Adam)."""
    st.session_state["proj_k"] = int(PRECISIONS[st.session_state["proj_precision"]].k)


def render_ddp_memory(trace, unit: str = "MiB") -> None:
    """A DDP run (ZeRO stage 0) or DDP with ZeroRedundancyOptimizer (stage 1), measured
    beside the ZeRO model (in ``unit``); ZeRO-1's parameter broadcasts and volume in words."""
    comparison = compute_ddp_stage_comparison(trace)
    facts = ddp_stage(trace)
    c = st.columns(2)
    with c[0]:
        st.plotly_chart(make_stage_comparison_figure(comparison, unit), key="ddp_stages")
    with c[1]:
        view = comparison.drop(columns=["rank"]).copy()
        for col in [c for c in view.columns if c.endswith("_bytes")]:
            view[col.replace("bytes", unit)] = view.pop(col) / UNITS[unit]
        show_table(view.round(4), key="ddp_stage_table")
    trained, frozen = int(trace.run["model_params"]), frozen_params(trace)
    params = f"{trained + frozen:,} parameters ({trained:,} of them trained)" if frozen else f"{trained:,} parameters"
    st.caption(f"Measured: ZeRO stage {facts.get('stage', 0)} ({facts.get('stage_reason', 'DDP')}), at the end of "
               f"each measured step. The stages: the ZeRO model for this model's {params} on {trace.world_size} ranks.")
    for line in ddp_stage_differences(trace) + ddp_comm_lines(trace):
        st.write("• " + line)


def render_memory(all_runs: dict, jobs: JobManager, busy: bool, trace=None) -> None:
    """``trace``: the open training run; a sharded one is shown first, measured. One unit
    family for the whole page: a run's amounts in its small unit, projections in its large."""
    family = st.radio("Units", list(FAMILIES), horizontal=True, key="zero_unit", format_func=FAMILY_LABELS.get,
                      help="DDP's bucket_cap_mb and torch's memory statistics count in MiB; the ZeRO paper in GB.")
    unit, large = FAMILIES[family]
    scale = UNITS[unit]
    if trace is not None and getattr(trace, "shards", None) is not None:
        st.subheader("The open run: memory by category, and where it stands among ZeRO's stages")
        render_sharded_memory(trace, unit)
        st.divider()
    elif trace is not None and trace.source == "ddpscope" and len(trace.memory) and trace.run.get("model_params"):
        st.subheader("The open run: its model states, and where they stand among ZeRO's stages")
        render_ddp_memory(trace, unit)
        st.divider()
    st.subheader("Teaching sample: one demo model trained under each ZeRO stage")
    with st.expander("Run the ZeRO stages here", expanded=False):
        c = st.columns(3)
        z_model = c[0].selectbox("model", ["gpt", "mlp"], key="zero_run_model")
        z_nproc = c[1].slider("ranks", 2, 4, 2, key="zero_run_nproc")
        with c[2]:
            job_button("Run ZeRO stages 0-3", "zero_run_button", jobs.start_zero,
                       lambda: dict(model=widget_now("zero_run_model", z_model),
                                    nproc=widget_now("zero_run_nproc", z_nproc)), disabled=busy)
    _, zt = pick_run(of_kind(all_runs, "zero"), "ZeRO run", "zero_trace", load_zero_trace,
                     f"No ZeRO runs yet. Make one with: ddpscope zero --nproc 2 --model gpt "
                     f"--out {runs_dir() / 'zero'}")
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
        show_table(table[["stage", "name"] + [c for c in table.columns if c.endswith(unit)]
                           + ["measured/predicted"]].round(4), key="zero_table")
        comm = zt.comm[zt.comm["rank"] == zrank].copy()
        comm[f"message ({unit})"] = comm.pop("message_bytes") / scale
        comm[f"sent per rank, ring ({unit})"] = comm.pop("volume_bytes") / scale
        show_table(comm.drop(columns="rank").round(4), key="zero_comm")
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
    device = c[1].number_input(f"device memory ({large})", min_value=1.0, max_value=4096.0, value=80.0,
                               key="proj_device")
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
    st.plotly_chart(make_zero_projection_figure(mem, large, device * UNITS[large]), key="zero_projection")
    fits = largest_model(device * UNITS[large], n_dev, prec, act)
    view_mem = mem[["stage", "name"]].copy()
    view_mem[f"per device ({large})"] = mem["total_bytes"] / UNITS[large]
    view_mem[f"comm per rank and step ({large})"] = mem["comm_bytes"] / UNITS[large]
    view_mem["largest model that fits (B params)"] = fits["max_params"] / 1e9
    show_table(view_mem.round(3), key="zero_projection_table")
