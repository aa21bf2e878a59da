"""What the pages show of a sharded run (FSDP2, DeepSpeed ZeRO): its timeline and unit table (the
Timeline page), its memory over a step beside ZeRO's stages (the Memory page), the
sharding settings and predictions of a rerun (the Run page), and a rerun beside it."""

from __future__ import annotations

import inspect

import numpy as np
import pandas as pd
import streamlit as st

from ddpscope.dashboard.loaders import first_real_step
from ddpscope.dashboard.run_header import show_run_header
from ddpscope.dashboard.run_profile import load_run_profile_or_say
from ddpscope.dashboard.tables import show_table
from ddpscope.dashboard.widget_defaults import start_from
from ddpscope.tracer.capture.sharded.settings import parse_reshard
from ddpscope.viz.sharded.buckets import compute_bucket_table
from ddpscope.viz.sharded.comm_volume import comm_honesty_lines, compute_comm_volume
from ddpscope.viz.sharded.deepspeed_buckets import bucket_cost, cost_in_words, predict_deepspeed_step_ms
from ddpscope.viz.sharded.deepspeed_states import precision
from ddpscope.viz.sharded.figures import (
    make_memory_over_step_figure,
    make_sharded_timeline_figure,
    make_stage_comparison_figure,
)
from ddpscope.viz.sharded.metrics import (
    NO_UNIT,
    STEP_NOISE_MEANING,
    UNTIMED_UNITS,
    active_units,
    compute_memory_over_step,
    compute_no_unit_table,
    compute_sharded_run_comparison,
    compute_sharded_steps,
    compute_stage_comparison,
    compute_unit_table,
    idle_units_line,
    reshard_setting,
    sharded_step_noise_ms,
    stage_differences,
)
from ddpscope.viz.sharded.predict import (
    DEEPSPEED_BUCKET_MIB,
    STATE_COLUMNS,
    compute_deepspeed_stage_whatif,
    own_prefetch,
    predict_deepspeed_peak,
    predict_memory,
    predict_peak,
    predict_step_ms,
    reshard_choices,
)
from ddpscope.viz.sharded.profile_check import compute_sharded_profile_agreement
from ddpscope.viz.sharded.rerun_check import compute_rerun_check, rerun_setting
from ddpscope.viz.sharded.trace import params_and_trainable, shard_group_size
from ddpscope.viz.sources.run_profile import profile_folder
from ddpscope.viz.units import UNITS
from ddpscope.viz.whatif.where_to_set import bucket_elements_in_code, reshard_in_code

MIB = 2**20
#: st.metric without its delta arrow (a newer Streamlit's delta_arrow; an older one draws it)
_NO_ARROW = {"delta_arrow": "off"} if "delta_arrow" in inspect.signature(st.metric).parameters else {}
RESHARD_CHOICES = {"true (ZeRO-3)": "true", "false (ZeRO-2)": "false"}
AS_THE_SCRIPT = "as the script sets it (its units differ)"  # no override: a rerun as the run


def size_unit(sizes: pd.DataFrame) -> tuple[str, int]:
    """KiB where every size in ``sizes`` (bytes) is under 1 MiB, else MiB: a small bucket
    or unit (a norm's parameters, Hugging Face's "auto" buckets) reads in KiB, not 0.0 MiB."""
    largest = sizes.max(numeric_only=True).max() if len(sizes) else 0
    return ("MiB", MIB) if largest >= MIB else ("KiB", 1024)


def render_sharded_timeline(trace) -> None:
    sh = trace.shards
    run = trace.run
    deepspeed = sh.framework == "deepspeed"
    show_run_header(run, [("ranks", trace.world_size, None), ("ZeRO stage", sh.stage, sh.stage_reason),
                          ("DeepSpeed units" if deepspeed else "FSDP units", len(sh.units),
                           "modules holding parameters of their own" if deepspeed else None),
                          ("status", trace.status, None)])
    if trace.unfinished:
        st.warning(f"This run is {trace.status}: {trace.unfinished}. Finished steps are shown.")
    for note in run.get("notes") or []:
        st.info(f"ddpscope: {note}")
    steps = sorted(int(s) for s in trace.steps["step"].unique())
    start = first_real_step(trace)
    lo, hi = st.select_slider("Steps", options=steps, value=(start, start), key="sharded_steps")
    ranks = st.multiselect("Ranks", sorted(trace.ranks), default=sorted(trace.ranks), key="sharded_ranks")
    st.plotly_chart(make_sharded_timeline_figure(trace, steps=range(lo, hi + 1), ranks=ranks or None),
                    key="sharded_timeline")
    st.caption("Red in the compute lane: compute waiting for an all-gather; orange: the optimizer's step (what "
               "it issued on the collective lanes). Outlined in red: communication with no "
               "compute beside it (exposed). Hatched: prefetched all-gathers. On gloo every collective runs on the "
               "training thread, so all of it is exposed; on NCCL they run on their own streams.")
    if (trace.shards.colls["unit"] == -1).any():
        st.caption("Grey: collectives no unit issued (" + ("DeepSpeed's gathers after the step, its gradient norm's "
                   "all-reduce" if deepspeed else "clip_grad_norm_'s all-reduce of the gradient norm") + ", the "
                   "script's own), each named in its hover for who issued it; the table's \"(no unit)\" row, "
                   "broken down below it.")
    st.subheader("Per unit, per step (medians over ranks and non-warm-up steps)")
    table = compute_unit_table(trace)
    active = active_units(table)
    if len(active) < len(table) and not st.toggle(f"Every unit ({len(table)})", key="sharded_every_unit"):
        st.caption(f"{idle_units_line(len(table) - len(active))}: the switch shows them.")
        table = active.copy()
    cols = ["sharded_bytes", "unsharded_bytes", "all_gather_bytes", "reduce_scatter_bytes"]
    unit, scale = size_unit(table[cols])
    for col in cols:
        table[col.replace("bytes", unit)] = table.pop(col) / scale
    show_table(table.round(3), key="sharded_units")
    st.caption("Each cell is its own median: within a step the units' exposed times add up to the step's (Every "
               "step, below); their medians need not add up to the step's median.")
    if deepspeed:
        st.caption(UNTIMED_UNITS)
    no_unit = compute_no_unit_table(trace)
    if len(no_unit):
        st.caption(f"The {NO_UNIT} row by who issued it (per step, medians over ranks and non-warm-up steps; "
                   "ms in flight and exposed):")
        show_table(no_unit.round(3), key="sharded_no_unit")
    buckets = compute_bucket_table(trace)
    if len(buckets):
        st.subheader("Gradient buckets (DeepSpeed; per step, medians over ranks and non-warm-up steps)")
        unit, scale = size_unit(buckets[["bytes"]])
        show_table(buckets.assign(**{unit: buckets.pop("bytes") / scale}).round(3), key="sharded_buckets")
    with st.expander("Every step"):
        show_table(compute_sharded_steps(trace).round(2), key="sharded_per_step")
    if profile_folder(trace) is not None:
        with st.expander("torch.profiler on the same run (ddpscope run --profile): each collective as both saw it"):
            show_sharded_profile(trace)
    st.subheader("What was sent")
    for line in comm_honesty_lines(trace):
        st.write(line)
    vol = compute_comm_volume(trace)
    show_table(vol.round(3), key="sharded_volume")


def show_sharded_profile(trace) -> None:
    """Each collective of the profiled steps as the tracer and the profiler saw it."""
    if (profile := load_run_profile_or_say(trace)) is None:
        return
    table = compute_sharded_profile_agreement(trace, profile)
    if table.empty:
        st.info("The profile holds none of the steps this trace has.")
        return
    st.caption("Each unit's all-gather and reduce-scatter (and each collective of no unit) as the tracer timed it and as the profiler saw it run (its "
               "times put on the tracer's clock with each rank's sampled offset; matched in order within a step). "
               "The profiler's bytes are the collective's input: an all-gather's is this rank's shard. "
               "start_after_ms: how long after the tracer's start it ran; end_before_ms: how long before the "
               "tracer's end it ended. An empty side: the other did not see it.")
    show_table(table.drop(columns=["start_us", "end_us", "profile_start_us", "profile_end_us"]).round(3),
               key="sharded_profile_agreement")


def render_sharded_memory(trace, unit: str = "MiB") -> None:
    """The open sharded run's memory: over a step by category, and beside ZeRO's stages
    (in ``unit``, the Memory page's)."""
    sh = trace.shards
    ranks = sorted(int(r) for r in sh.memory["rank"].unique())
    if not ranks:
        st.info("This run measured no step's memory.")
        return
    rank = st.selectbox("Rank", ranks, key="sharded_mem_rank")
    c = st.columns(2)
    with c[0]:
        st.plotly_chart(make_memory_over_step_figure(compute_memory_over_step(trace, rank),
                                                     f"Rank {rank}: memory over one step (measured)", unit),
                        key="sharded_memory")
    comparison = compute_stage_comparison(trace)
    with c[1]:
        st.plotly_chart(make_stage_comparison_figure(comparison, unit), key="sharded_stages")
    how = precision(trace).name if sh.framework == "deepspeed" else "fp32 AdamW"
    n = shard_group_size(trace)  # HSDP: the model within one shard group
    ranks = f"{trace.world_size} ranks" if n == trace.world_size else f"N = {n} (the shard group of each replica)"
    params, trained = params_and_trainable(trace)
    held = f"{params:,.0f} parameters" + (f" ({trained:,.0f} of them trained)" if trained < params else "")
    st.caption(f"Measured: ZeRO stage {sh.stage} ({sh.stage_reason}). The stages: the ZeRO model for this model's "
               f"{held} on {ranks}, {how}.")
    view = comparison.drop(columns=["rank"]).copy()
    for col in [c for c in view.columns if c.endswith("_bytes")]:
        view[col.replace("bytes", unit)] = view.pop(col) / UNITS[unit]
    show_table(view.round(4), key="sharded_stage_table")
    for line in stage_differences(trace):
        st.write("• " + line)


def sharded_rerun_settings(trace) -> dict:
    """The sharding controls of the Run page, with the predictions for the chosen
    settings; returns the settings to rerun with (the ``JobManager.start`` keywords)."""
    own = reshard_setting(trace)  # what this run's units ran with: the choice it opens on
    choices = {AS_THE_SCRIPT: None} if own == "mixed" else {}
    choices.update(RESHARD_CHOICES)
    for n in reshard_choices(trace):  # `ddpscope whatif` predicts the same ones
        if not isinstance(n, bool):
            choices[f"{n} (resharded to {n} ranks)"] = str(n)
    opens_on = AS_THE_SCRIPT if own == "mixed" else next((k for k, v in choices.items() if v == own), None)
    own_fwd, own_bwd = own_prefetch(trace)  # what the run's units ran with: a rerun keeps them unless changed
    start_from("run_reshard", trace.path, run_reshard=opens_on or next(iter(choices)), run_fwd_prefetch=own_fwd,
               run_bwd_prefetch=own_bwd)
    c = st.columns(3)
    label = c[0].selectbox("reshard_after_forward", list(choices), key="run_reshard")
    fwd = c[1].slider("forward prefetch (units ahead)", 0, max(3, own_fwd), key="run_fwd_prefetch")
    bwd = c[2].slider("backward prefetch (units ahead)", 1, max(3, own_bwd), key="run_bwd_prefetch")
    value = choices[label]
    setting = parse_reshard(value)
    m = st.columns(2)
    measured = len(trace.shards.memory) > 0
    settings = {"reshard_after_forward": value, "forward_prefetch": fwd if fwd != own_fwd else None,
                "backward_prefetch": bwd if bwd != own_bwd else None}
    _prediction_metric(m[0], "predicted peak (rank 0)", "peak_bytes", 1 / MIB, "MiB",
                       predict_peak(trace, reshard_after_forward=setting, forward_prefetch=fwd,
                                    backward_prefetch=bwd) if measured else None,
                       "This run measured no step's memory: no peak is predicted.")
    _prediction_metric(m[1], "predicted step (rank 0)", "step_ms", 1.0, "ms",
                       predict_step_ms(trace, setting) if len(trace.steps) else None,
                       "This run finished no step: no step time is predicted.", sharded_step_noise_ms(trace))
    if shard_group_size(trace) > 1 and (said := reshard_in_code(trace.run)) is not None:  # 1: nothing to reshard
        st.caption(said[0].upper() + said[1:] + ".")
    if not measured:
        return settings
    with st.expander("Predicted memory over a step"):
        st.plotly_chart(make_memory_over_step_figure(
            predict_memory(trace, 0, reshard_after_forward=setting, forward_prefetch=fwd, backward_prefetch=bwd),
            "Rank 0: predicted memory over one step"), key="sharded_predicted_memory")
    return settings


def _prediction_metric(where, label: str, what: str, scale: float, unit: str, table, missing: str,
                       noise: float | None = None) -> None:
    """``predicted_<what>`` beside ``measured_<what>`` (rank 0's row of ``table``), or what
    is missing, said, when the run cannot give it (no table, or an empty one). ``noise``
    (in the shown unit; ``sharded_step_noise_ms``): a change within it is drawn gray, and
    the metric's help says so."""
    if table is None or not len(table) or f"predicted_{what}" not in table:
        where.info(missing)
        return
    predicted, measured = table[f"predicted_{what}"].iloc[0], table[f"measured_{what}"].iloc[0]
    digits = 2 if unit == "MiB" else 1
    change = round((predicted - measured) * scale, digits)
    known = noise is not None and np.isfinite(noise)
    inside = known and abs(change) <= noise
    said = {"help": (f"Inside this run's noise (±{noise:.{digits}f} {unit}): a rerun cannot be told from this run"
                     if inside else f"Beyond this run's noise (±{noise:.{digits}f} {unit})")
            + f": {STEP_NOISE_MEANING}."} if known else {}
    if change:
        where.metric(label, f"{predicted * scale:.{digits}f} {unit}", f"{change:+.{digits}f} {unit}",
                     delta_color="off" if inside else "inverse", **said)
    else:  # gray and with no arrow (Streamlit draws one for any text), not a red "+0.00"
        where.metric(label, f"{predicted * scale:.{digits}f} {unit}", "as this run", delta_color="off", **_NO_ARROW,
                     **said)


def deepspeed_rerun_settings(trace) -> dict:
    """A DeepSpeed run's controls on the Run page: the ZeRO stage and the bucket size,
    with the chosen stage's model states predicted from this trace beside this run's
    (checked when the rerun comes back: Compare); returns the settings to rerun with."""
    ds = trace.run.get("deepspeed") or {}
    c = st.columns(2)
    now = (ds.get("reduce_bucket_bytes") or 0) / MIB
    own = round(now, 3)  # the slider's stop for this run's own size
    caps = sorted({*DEEPSPEED_BUCKET_MIB, own} - {0.0})
    start_from("run_ds", trace.path, run_zero_stage=trace.shards.stage, run_ds_cap=own if now else 4.0)
    stage = c[0].selectbox("ZeRO stage", [1, 2, 3], key="run_zero_stage")
    cap = c[1].select_slider("reduce_bucket_size (MiB of the communication dtype)", options=caps, key="run_ds_cap")
    same = bool(now) and abs(cap - own) < 1e-9  # this run's size, not its value rounded to the slider's
    states = compute_deepspeed_stage_whatif(trace, [stage])  # `ddpscope whatif`'s table, every stage
    states = pd.concat([states[~states["predicted"]].head(1), states[states["predicted"]]])  # the first rank's
    view = states[["row", *STATE_COLUMNS]].rename(columns={"row": "", **{k: _mib(k) for k in STATE_COLUMNS}})
    view[[_mib(k) for k in STATE_COLUMNS]] /= MIB
    show_table(view.round(3), key="run_ds_states")
    st.caption("MiB per rank. Persistent: parameters, the fp32 master and Adam's moments (what the rerun is checked "
               "on); gradients live in buffers sized by the bucket layout."
               + (" Host persistent: what of them ZeRO-Offload keeps in host memory (this run's offload, which a "
                  "rerun keeps); the peaks are the device's." if states["host_persistent_bytes"].any() else ""))
    mem = trace.shards.memory
    peak = None
    if len(mem) and now:  # the buckets are allocated whole: the peak moves with their size
        peak = predict_deepspeed_peak(trace, ds["reduce_bucket_bytes"] if same else cap * MIB)
    m = st.columns(2)
    _prediction_metric(m[0], f"predicted peak at stage {trace.shards.stage} (rank 0)", "peak_bytes",
                       1 / MIB, "MiB", peak, "This run recorded no memory or no reduce_bucket_size: no peak is predicted.")
    cost = bucket_cost(trace) if now else None
    step = predict_deepspeed_step_ms(trace, now if same else cap, cost) if now else None
    if step is not None and step["predicted_step_ms"].isna().all():
        step = None
    _prediction_metric(m[1], f"predicted step at stage {trace.shards.stage} (rank 0)", "step_ms", 1.0, "ms", step,
                       "This trace lists no bucket's parameter sizes (traced before ddpscope recorded them) or no "
                       "reduce_bucket_size: no step is predicted.", sharded_step_noise_ms(trace))
    held = len(mem) and mem["comm_buffers_bytes"].fillna(0).max() > 0
    st.caption("At another reduce_bucket_size, at this run's stage: DeepSpeed allocates its gradient buckets "
               "whole (reduce_bucket_size elements), so they scale and nothing else moves"
               + ("" if held else "; this run's memory samples (taken between the model's forward and backward, "
                  "where DeepSpeed's compute is timed) hold no bucket, so the peak they read stays at any size")
               + ". The step: the buckets cut again from the order ZeRO took the gradients in (exact), each reduction costed "
                 "as this run's were for their size" + (f", {cost_in_words(cost, trace.path)}" if cost is not None else "")
               + ": a model, which the rerun checks. A rerun at another stage is predicted in memory only.")
    if (said := bucket_elements_in_code(trace.run, now if same else cap)) is not None:
        st.caption(said[0].upper() + said[1:] + ".")
    return {"zero_stage": stage if stage != trace.shards.stage else None, "bucket_cap_mb": None if same else cap}


def _mib(column: str) -> str:
    """A byte count's column once its values are MiB: its header reads "(MiB)", not "(bytes)"."""
    return column.removesuffix("_bytes") + "_mib"


def show_rerun_check(source, rerun) -> None:
    """What the Run page predicted for the rerun's setting from the run it came from,
    beside what the rerun measured (``viz.sharded.rerun_check``): the loop's last step."""
    try:
        table = compute_rerun_check(source, rerun)
    except ValueError as e:
        st.info(f"No prediction to check: {e}.")
        return
    setting = rerun_setting(rerun)["words"]
    if not len(table):
        st.info(f"No prediction to check: nothing the Run page predicts was measured by both runs at {setting}.")
        return
    st.markdown(f"**Predicted for this rerun, beside what it measured** ({setting}; rank 0):")
    show_table(table.round({"predicted": 2, "measured": 2, "error_pct": 1}), key="sharded_rerun_check")
    st.caption("Predicted: what the Run page showed for this setting, from the run it came from; measured: the "
               "rerun's own, read alike (medians over non-warm-up steps; the largest memory sample of those steps). "
               "DeepSpeed's buckets and peak are replayed exactly, the step is a model "
               "(docs/sharded.md#predictions); a rerun at another stage is checked on the model states it kept.")


def show_sharded_comparison(loaded: dict) -> None:
    """Runs side by side: step time and exposed communication (medians over non-warm-up
    steps, each step the rank it waited for: ``viz.ddp.compare.waited_rows``), peak memory (the
    largest over them), then every run's timeline on one time scale."""
    table = compute_sharded_run_comparison(loaded)
    if not len(table):
        return
    show_table(table.round(3), key="sharded_compare")
    st.caption("step_ms, exposed_ms: medians over non-warm-up steps, each step the numbers of the rank it waited "
               "for (the least exposed communication: the others' holds their wait for it), the step its ranks' "
               "mean; peak_MiB: the largest over every rank and step.")
    extent = 0.0
    figs = []
    for label, t in loaded.items():
        if t.shards is not None:
            fig = make_sharded_timeline_figure(t, steps=[first_real_step(t)], ranks=[0])
            extent = max(extent, max((float(b.base.max() + b.x.max()) for b in fig.data if len(b.x)), default=0.0))
            figs.append((label, fig))
    for label, fig in figs:
        fig.update_layout(title=label, xaxis_range=[0, extent * 1.02])
        st.plotly_chart(fig, key=f"sharded_compare_{label}")
