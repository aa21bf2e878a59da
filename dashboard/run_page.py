"""The Run page: the live loop. Rerun what the open trace came from (the same script
command, or the demo) with another ``bucket_cap_mb``, watch it, and see it beside the
run it came from; or enter a new command (validated before anything starts)."""

from __future__ import annotations

import shlex
from pathlib import Path

import streamlit as st

from ddpscope.dashboard.catalog import label_of, stamp_of, uploads_dir
from ddpscope.dashboard.job_controls import (
    LIVE_REFRESH_S,
    CommandPolicy,
    job_button,
    lab_controls,
    show_outcome,
    show_progress,
    widget_now,
)
from ddpscope.dashboard.loaders import load_trace
from ddpscope.dashboard.sharded_view import (
    deepspeed_rerun_settings,
    sharded_rerun_settings,
    show_rerun_check,
    show_sharded_comparison,
)
from ddpscope.dashboard.timeline_page import show_comparison
from ddpscope.dashboard.widget_defaults import start_from
from ddpscope.tracer.launch.jobs import JobManager
from ddpscope.tracer.launch.rerun import rerun_settings
from ddpscope.tracer.launch.runner import file_sha256
from ddpscope.tracer.options import DEMO_MODELS, mib_list
from ddpscope.viz.trace import TraceError
from ddpscope.viz.whatif.layout import runnable
from ddpscope.viz.whatif.where_to_set import where_to_set

CAP_OPTIONS = [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 8.0, 10.0, 16.0, 25.0, 32.0, 50.0, 64.0, 100.0, 250.0, 500.0]  # MiB


def rerun_source(path: Path, run: dict) -> dict | None:
    """What a run came from, for a rerun: ``{"demo": model}`` or ``{"script": argv,
    "cwd": folder, "path": file, "sha256": ...}`` with its world size; None if unknown."""
    nproc = int(run.get("nproc_per_node") or run.get("world_size") or 2)
    script = run.get("script")
    if run.get("demo") in DEMO_MODELS or (script is None and run.get("model") in DEMO_MODELS):
        return {"demo": run.get("demo") or run["model"], "nproc": nproc}
    if isinstance(script, dict) and isinstance(script.get("argv"), list) and script.get("cwd"):
        return {"script": [str(a) for a in script["argv"]], "cwd": str(script["cwd"]), "path": script.get("path"),
                "sha256": script.get("sha256"), "nproc": nproc, "upload": path.parent == uploads_dir()}
    return None


def page_rerun(path: Path, run: dict, policy: CommandPolicy) -> tuple[dict | None, str | None]:
    """What a button on the What-if page reruns ``run`` with: ``JobManager.start``
    settings (the same ranks, steps and emulated nodes, the default capture path; the
    bucket setting left to the button) and why starting it is off (None: on).
    ``(None, why)`` when the run cannot be rerun from here."""
    try:
        settings = rerun_settings(run)
    except ValueError as e:
        return None, str(e)
    settings.pop("capture", None)
    settings["steps"] = int(settings.get("steps") or min(max(run.get("steps") or 10, 3), 50))
    source = rerun_source(path, run)
    blocked = None
    if source is not None and "script" in source:
        blocked = ("this trace was uploaded: its command is not run here" if source["upload"] else
                   None if policy.allowed else "starting commands is off (see the Run tab)")
    return settings, blocked


def render_run(path: Path | None, trace, jobs: JobManager, busy: bool, policy: CommandPolicy) -> None:
    if policy.note:
        (st.info if not policy.allowed else st.warning)(policy.note)
    source = rerun_source(path, trace.run) if trace is not None else None
    st.subheader("Rerun the open trace with other sharding settings" if trace is not None and trace.shards is not None
                 else "Rerun the open trace with another bucket_cap_mb")
    if source is None and trace is not None and trace.source != "ddpscope":
        st.info("The open trace is a profiler trace: it does not say how to rerun it. Trace the same script with "
                "`ddpscope run --profile --out RUN -- train.py` (or enter the command below) to rerun it live.")
    elif source is None:
        st.info("The open trace does not say how it was made (no script or demo in its run.json); "
                "enter a command below.")
    else:
        _rerun_controls(path, trace, source, jobs, busy, policy)
    with st.expander("Run a new command", expanded=source is None):
        _new_command(jobs, busy, policy)
    _live(jobs)


def _rerun_controls(path: Path, trace, source: dict, jobs: JobManager, busy: bool, policy: CommandPolicy) -> None:
    if "demo" in source:
        st.caption(f"The demo model `{source['demo']}` on {source['nproc']} ranks.")
        blocked = None
    else:
        st.code(shlex.join(source["script"]), language="bash")
        st.caption(f"in {source['cwd']} on {source['nproc']} ranks")
        blocked = ("this trace was uploaded: its command came from another machine and is not run here"
                   if source["upload"] else None if policy.allowed else "starting commands is off (see above)")
        if source.get("path") and source.get("sha256") and file_sha256(Path(source["path"])) != source["sha256"]:
            st.warning(f"{source['path']} changed since this trace was taken: the rerun runs the file as it is now.")
    run = trace.run
    cap_now = float(run.get("bucket_cap_mb") or 25.0)
    options = [c for c in CAP_OPTIONS if runnable(run, c)]  # a torch.compile'd model takes none under 1 MiB
    start_from("rerun", path, run_cap=min(options, key=lambda c: abs(c - cap_now)),  # from its own settings
               run_steps=int(min(max(run.get("steps") or 10, 3), 50)), run_nproc=int(min(max(source["nproc"], 1), 4)))
    what = {"demo": source["demo"]} if "demo" in source else {"script": source["script"], "cwd": source["cwd"]}
    if trace.shards is not None and trace.shards.framework == "deepspeed":  # the stage and the bucket size
        ds = deepspeed_rerun_settings(trace)
        steps = st.columns(2)[0].slider("steps", 3, 50, key="run_steps")
        if blocked:
            st.info(f"Rerun is off: {blocked}.")
        stage = ds["zero_stage"] or trace.shards.stage
        size = "" if ds["bucket_cap_mb"] is None else f", reduce_bucket_size {ds['bucket_cap_mb']:g} MiB"
        job_button(f"Rerun at ZeRO stage {stage}{size}", "run_button", jobs.start,
                   lambda: dict(nproc=source["nproc"], source=path, steps=widget_now("run_steps", steps), **ds, **what),
                   disabled=busy or bool(blocked), type="primary")
        return
    if trace.shards is not None:  # FSDP2: sharding settings, with their predictions
        sharding = sharded_rerun_settings(trace)
        c = st.columns(2)
        steps = c[0].slider("steps", 3, 50, key="run_steps")
        if blocked:
            st.info(f"Rerun is off: {blocked}.")
        shard = sharding["reshard_after_forward"]
        job_button("Rerun as the script sets it" if shard is None else f"Rerun with reshard_after_forward = {shard}",
                   "run_button",
                   jobs.start, lambda: dict(nproc=source["nproc"], bucket_cap_mb=None, source=path,
                                            steps=widget_now("run_steps", steps), **sharding, **what),
                   disabled=busy or bool(blocked), type="primary")
        return
    # as traced: DDP's default stays the default
    start_from("run_cap_default", path,
               run_cap_default=bool(run.get("bucket_cap_default")) and not run.get("bucket_cap_bytes_list"))
    # DDP's default is not "25 MiB": its first bucket is capped at 1 MiB; an explicit 25 caps every bucket at 25
    default = st.toggle("DDP's default buckets (25 MiB, the first bucket 1 MiB): no bucket_cap_mb passed",
                        key="run_cap_default")
    c = st.columns(3)
    cap = c[0].select_slider("bucket_cap_mb (MiB, log scale; every bucket, the first too)", options=options,
                             key="run_cap", disabled=default)
    steps = c[1].slider("steps", 3, 50, key="run_steps")
    nproc = c[2].slider("world size", 1, 4, key="run_nproc")
    caps = st.text_input("or a size per bucket: bucket_cap_mb_list (MiB, in bucket order, the last repeats)",
                         key="run_cap_list", placeholder="e.g. 1,8,25 (empty: the cap above)",
                         disabled=default).strip()
    if options != CAP_OPTIONS:
        st.caption("The model is torch.compile'd: its DDPOptimizer refuses a bucket cap under 1 MiB (of a "
                   "bucket_cap_mb_list, its largest entry), so the caps start at 1 MiB.")
    emulation = lab_controls("run")
    if blocked:
        st.info(f"Rerun is off: {blocked}.")

    def settings() -> dict:
        as_default = widget_now("run_cap_default", default)
        chosen = "" if as_default else widget_now("run_cap_list", caps).strip()
        if chosen and not _runnable_list(run, chosen):  # what DDPOptimizer would fail on
            raise ValueError(f"bucket_cap_mb_list {chosen}: the model is torch.compile'd, and its DDPOptimizer "
                             "refuses a list whose largest entry is under 1 MiB")
        return dict(nproc=widget_now("run_nproc", nproc), steps=widget_now("run_steps", steps), source=path,
                    bucket_cap_mb=None if chosen or as_default else widget_now("run_cap", cap),
                    bucket_cap_mb_list=chosen or None, **emulation(), **what)

    label = ("Rerun with DDP's default buckets" if default else
             f"Rerun with bucket_cap_mb_list = {caps}" if caps else f"Rerun with bucket_cap_mb = {cap:g}")
    job_button(label, "run_button", jobs.start, settings, disabled=busy or bool(blocked), type="primary")
    if (said := where_to_set(run, None if default else _typed_list(caps) or float(cap))) is not None:
        st.caption(said[0].upper() + said[1:] + ": to keep it once the rerun says it is worth it.")


def _typed_list(caps: str) -> tuple[float, ...] | None:
    """The typed bucket_cap_mb_list as numbers; None where it is empty or not numbers
    (the rerun says what is wrong with it)."""
    try:
        return mib_list(caps) or None
    except ValueError:
        return None


def _runnable_list(run: dict, caps: str) -> bool:
    """The run's model can be given the typed bucket_cap_mb_list (``layout.runnable``); True
    when it does not parse: the run's own check says what is wrong with it."""
    try:
        return runnable(run, mib_list(caps))
    except ValueError:
        return True


def _new_command(jobs: JobManager, busy: bool, policy: CommandPolicy) -> None:
    st.caption("The script and its arguments, as after `ddpscope run --` (e.g. `train.py --lr 3e-4` or "
               "`-m mypkg.train`), run through torchrun on this machine and traced; checked before it starts.")
    command = st.text_input("command", key="new_cmd", placeholder="train.py --epochs 1", disabled=not policy.allowed)
    c = st.columns(4)
    cwd = c[0].text_input("working folder", value=str(Path.cwd()), key="new_cwd", disabled=not policy.allowed)
    nproc = c[1].slider("world size", 1, 4, 2, key="new_nproc", disabled=not policy.allowed)
    cap = c[2].select_slider("bucket_cap_mb (MiB)", options=["script's own", *CAP_OPTIONS], key="new_cap",
                             disabled=not policy.allowed)
    steps = c[3].slider("steps", 3, 50, 10, key="new_steps", disabled=not policy.allowed)
    emulation = lab_controls("new", disabled=not policy.allowed)

    def settings() -> dict:
        try:
            argv = shlex.split(widget_now("new_cmd", command))
        except ValueError as e:
            raise ValueError(f"cannot read the command: {e}") from None
        chosen = widget_now("new_cap", cap)
        return dict(script=argv, cwd=widget_now("new_cwd", cwd), nproc=widget_now("new_nproc", nproc),
                    steps=widget_now("new_steps", steps),
                    bucket_cap_mb=None if chosen == "script's own" else float(chosen), **emulation())

    job_button("Start", "new_button", jobs.start, settings, disabled=busy or not policy.allowed)


def _live(jobs: JobManager) -> None:
    """Where the user clicked: the job's progress (refreshing only while it runs), then
    the rerun beside its source."""
    if jobs.current is not None and jobs.current.running:
        _live_refreshing(jobs)
    else:
        _live_body(jobs)


@st.fragment(run_every=LIVE_REFRESH_S)
def _live_refreshing(jobs: JobManager) -> None:
    _live_body(jobs)


def _live_body(jobs: JobManager) -> None:
    job = jobs.current
    if job is None or job.kind != "ddp":
        return
    job.settle(LIVE_REFRESH_S)  # ending before the next refresh: shown ended now (running: a refresher's run)
    st.subheader(f"{'Running' if job.running else 'Last run'}: {job.out.name}")
    for note in job.notes:
        st.info(f"ddpscope: {note}")
    if job.running:
        show_progress(job)
        st.session_state["run_was_running"] = True
        return
    if st.session_state.pop("run_was_running", False):
        st.rerun(scope="app")  # everything else learns of the new run
    show_outcome(job, where="below")
    if not job.ok or (job.result is not None and job.result.untraced):
        return
    loaded = {}
    for p in ([job.source] if job.source is not None else []) + [job.out]:
        try:
            loaded[label_of(p)] = load_trace(str(p), stamp_of(p))
        except TraceError as e:
            st.error(f"{p.name}: {e}")
    if len(loaded) == 2 and all(t.shards is not None for t in loaded.values()):
        st.subheader("The rerun beside the run it came from (one time scale)")
        show_sharded_comparison(loaded)
        show_rerun_check(*loaded.values())
    elif len(loaded) == 2:
        st.subheader("The rerun beside the run it came from (one time scale; deltas against the first)")
        show_comparison(loaded, key="rerun", layouts=True)
