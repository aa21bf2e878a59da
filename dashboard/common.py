"""What every page of the dashboard shares: where runs are, cached loaders (which take
everything they depend on as arguments), run pickers, the job manager, uploads, and
whether this page may start commands."""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import json
import math
import os
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import streamlit as st

from ddpscope.tracer.format import LIVE_DIR, LOGS_DIR, MODELS_DIR, NODES_DIR, RUN_FILE
from ddpscope.tracer.launch import lab
from ddpscope.tracer.launch.jobs import JobManager
from ddpscope.viz.ddp.rank_overview import ranks_to_show
from ddpscope.viz.perfetto import merge_run
from ddpscope.viz.ring.trace import load_ring
from ddpscope.viz.sources import KINETO, MIXED, folder_kind, load_training_trace
from ddpscope.viz.sources.archive import extract_run_archive, safe_name
from ddpscope.viz.sources.rank_events import select_ranks, with_events
from ddpscope.viz.trace import TraceError
from ddpscope.viz.zero.trace import load_zero

#: folder kinds the training pages (Timeline, Compare, What-if, Run) list
TRAINING_KINDS = ("ddp", "sharded", KINETO, MIXED)

ROOT = Path(__file__).resolve().parents[1]
# a checkout (or pip install -e): beside the packages; pip install .: <prefix>/share/ddpscope
SAMPLES = next((p for p in (ROOT / "samples", Path(sys.prefix) / "share" / "ddpscope" / "samples") if p.is_dir()),
               ROOT / "samples")
ALLOW_COMMANDS_ENV = "DDPSCOPE_ALLOW_COMMANDS"
#: the Gantt draws every rank of a run up to this many; beyond it, rank 0 and the slowest
GANTT_RANKS = 8
#: the link rates the pages offer for emulated nodes (tc's units)
LINKS = ["100mbit", "200mbit", "1gbit", "10gbit"]


def runs_dir() -> Path:
    """Where runs started here go (``$DDPSCOPE_RUNS_DIR``, set by ``ddpscope dashboard``)."""
    return Path(os.environ.get("DDPSCOPE_RUNS_DIR", ROOT / "runs"))


def uploads_dir() -> Path:
    return runs_dir() / "uploads"


def list_runs() -> dict[str, tuple[Path, str]]:
    """Every run folder the page can show, by label, with its kind ("ddp", "ring",
    "zero", "kineto" for profiler traces, "mixed"): samples, runs made here, uploads.
    Read once per page run."""
    found = {}
    for prefix, folder in (("sample", SAMPLES), ("run", runs_dir()), ("upload", uploads_dir())):
        if folder.is_dir():
            for p in sorted(folder.iterdir(), reverse=prefix != "sample"):
                if p.name.startswith(".") or p.name in INTERNAL:  # an upload being unpacked; a run's own parts
                    continue
                kind = folder_kind(p)
                if kind is not None:
                    found[f"{prefix}: {p.name}"] = (p, kind)
                    for sub in _models(p):  # a job's further DDP models, each a run of its own
                        found[f"{prefix}: {p.name} · {sub.name}"] = (sub, kind)
    return found


#: folders inside a run folder (its live files, logs, nodes, further models) and the
#: uploads folder (listed on its own): never runs of their own in a listing
INTERNAL = frozenset({LIVE_DIR, LOGS_DIR, NODES_DIR, MODELS_DIR, "uploads"})


def runs_note() -> str | None:
    """One line when the runs folder holds no run of the user's: it is missing or empty
    (the page then shows the samples, and says so)."""
    folder = runs_dir()
    if not folder.is_dir():
        return f"{folder} does not exist: showing ddpscope's samples. Runs started from the Run page go there."
    if not any(label.startswith("run: ") for label in list_runs()):
        return f"{folder} holds no run yet: showing ddpscope's samples. Runs started from the Run page go there."
    return None


def _models(run: Path) -> list[Path]:
    """The run folders of a job's further DDP models (``models/<k>-<class>``), in order."""
    folder = run / MODELS_DIR
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and (p / RUN_FILE).is_file()]
    return sorted(found, key=lambda p: (int(p.name.split("-", 1)[0]) if p.name.split("-", 1)[0].isdigit() else 0,
                                        p.name))


def newest_run(runs: dict[str, Path]) -> str | None:
    """The label of the most recently written run of the user's (runs folder), if any."""
    mine = []
    for label, p in runs.items():
        if label.startswith("run: "):
            try:
                mine.append((stamp_of(p), label))
            except OSError:  # gone since it was listed
                continue
    return max(mine)[1] if mine else None


def of_kind(runs: dict[str, tuple[Path, str]], *kinds: str) -> dict[str, Path]:
    return {label: path for label, (path, k) in runs.items() if k in kinds}


def label_of(path: Path) -> str:
    """The picker label of a run folder."""
    for prefix, folder in (("upload", uploads_dir()), ("run", runs_dir()), ("sample", SAMPLES)):
        if path.parent == folder:
            return f"{prefix}: {path.name}"
        if path.parent.name == MODELS_DIR and path.parent.parent.parent == folder:
            return f"{prefix}: {path.parent.parent.name} · {path.name}"
    return str(path)


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
    """The training trace in a folder, ddpscope's or a profiler's (``stamp``, the newest
    file time there, renews the cache). A ddpscope run opens summary first: every rank's
    steps from its summary, the events of the ranks drawn first (``ranks_to_show``:
    all of a run of up to ``GANTT_RANKS``; else rank 0 and the three slowest)."""
    trace = load_training_trace(path, events_for=())
    if trace.source != "ddpscope":
        return trace
    return with_events(trace, ranks_to_show(trace, GANTT_RANKS), missing_ok=True)  # a folder may hold summaries only


def events_trace(path: str, stamp: float):
    """``load_trace``'s trace cut to the ranks whose events it holds (the run's world
    size kept): what a model that needs every rank's buckets and gradients reads."""
    trace = load_trace(path, stamp)
    return trace if trace.all_events else select_ranks(trace, trace.event_ranks)


@st.cache_data(show_spinner="Reading the events of the ranks shown...", max_entries=16)
def load_events(path: str, stamp: float, ranks: tuple[int, ...]):
    """``load_trace``'s trace with the events of ``ranks`` read too (a cached trace
    already holds the ranks drawn first); ranks whose events are not in the folder
    (only their summaries) are left out: ``trace.event_ranks`` says which are in."""
    return with_events(load_trace(path, stamp), ranks, missing_ok=True)


@st.cache_data(show_spinner=False, max_entries=8)
def load_ring_trace(path: str, stamp: float):
    """The ring trace in a folder made by ``ddpscope ring`` (cached as ``load_trace``)."""
    return load_ring(path)


@st.cache_data(show_spinner=False, max_entries=8)
def load_zero_trace(path: str, stamp: float):
    """The ZeRO run in a folder made by ``ddpscope zero`` (cached as ``load_trace``)."""
    return load_zero(path)


def merged_trace_bytes(path: str) -> bytes:
    """Every rank of the run in one Chrome trace on rank 0's clock, for Perfetto."""
    return json.dumps(merge_run(path), separators=(",", ":")).encode()


def stamp_of(path: Path) -> float:
    """The newest file time in a run folder (what renews its cached load); a dangling
    link counts by its own time, not its missing target's."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return p.lstat().st_mtime

    return max((mtime(p) for p in path.iterdir()), default=0.0)


@st.cache_resource
def job_manager(runs_dir: str, warm: bool) -> JobManager:
    """Runs started from the page; with ``warm``, through a launcher kept warm (torch
    imported once, ranks forked from it: the rerun loop does not pay a cold start)."""
    if not warm:
        return JobManager(Path(runs_dir))
    from ddpscope.tracer.launch.warm import shared_launcher

    return JobManager(Path(runs_dir), launcher=shared_launcher().launch)


def first_real_step(trace) -> int:
    """The first step past warm-up (else the first step); ``TraceError`` if the run
    recorded none (every page that draws a step says so in one line)."""
    s = trace.steps
    if not len(s):
        raise TraceError(f"{Path(str(trace.path)).name} holds no finished step: nothing to draw (the run ended "
                         "before its first step closed)")
    ok = s[~s["warmup"] & ~s["incomplete"]]
    return int(ok["step"].min()) if len(ok) else int(s["step"].min())


def handle_upload(upload) -> None:
    """Unpack an uploaded archive into its own folder; one-line error, nothing kept, if bad."""
    if upload is None or st.session_state.get("upload_done") == upload.file_id:
        return
    st.session_state["upload_done"] = upload.file_id
    # a name of its own: two uploads of one file in one second (two tabs, two users) never meet
    dest = uploads_dir() / (f"{safe_name(Path(upload.name).stem)}-{time.strftime('%Y%m%d-%H%M%S')}-"
                            f"{secrets.token_hex(3)}")
    made = False
    try:
        extract_run_archive(upload.getvalue(), upload.name, dest)  # makes dest, or raises if it exists
        made = True
        kind = folder_kind(dest) or "ddp"
        # checked as the page opens it: summaries first (a many-rank run may hold only those)
        {"ring": load_ring, "zero": load_zero}.get(kind, lambda p: load_training_trace(p, events_for=()))(dest)
    except Exception as e:  # noqa: BLE001 - nothing that does not load stays in uploads/ (every page lists it)
        if made or not isinstance(e, FileExistsError):  # never what another upload made
            shutil.rmtree(dest, ignore_errors=True)
        st.session_state["upload_error"] = f"{upload.name}: {_one_line(e)}"
        return
    st.session_state.pop("upload_error", None)
    st.session_state[{"ring": "ring_trace", "zero": "zero_trace"}.get(kind, "trace")] = f"upload: {dest.name}"


def _one_line(e: Exception) -> str:
    return str(e) if isinstance(e, TraceError) else str(TraceError(f"{type(e).__name__}: {e}"))


@contextlib.contextmanager
def page_guard(what: str):
    """Draw a page; if it fails, say so in one line where it would have been and keep the
    other pages (a trace no check foresaw, or a bug: never a traceback on the page).
    Streamlit's own stop and rerun pass (they are not ``Exception``s)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001
        st.error(f"{what} could not be drawn: {_one_line(e)}")


@dataclass(frozen=True)
class CommandPolicy:
    """Whether this page may start commands (a script's, or a new one): starting a
    command from a web page is code execution. ``note``: what the page says about it."""

    allowed: bool
    note: str | None


def command_policy() -> CommandPolicy:
    """Commands are on when the server listens on this machine only (loopback), or when
    it was started with ``ddpscope dashboard --allow-commands``."""
    address = (st.get_option("server.address") or "").strip()
    if _is_loopback(address):
        return CommandPolicy(True, None)
    where = address or "every interface"
    if os.environ.get(ALLOW_COMMANDS_ENV) == "1":
        return CommandPolicy(True, f"This dashboard listens on {where} and was started with --allow-commands: "
                                   "anyone who can reach it can run commands on this machine.")
    return CommandPolicy(False, f"This dashboard listens on {where}, reachable from other machines, so starting "
                                "commands from the page is off (the demo still runs). To allow it, restart with "
                                "`ddpscope dashboard --allow-commands`, or listen on 127.0.0.1 only.")


def _is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


# Seconds between a running job's progress refreshes. Each refresh reruns a fragment on the
# server and redraws in the browser: at 0.5 s, with two refreshers, the page took a third of
# a core on the server and half of one in Chromium, and the job it watched ran 65 % slower
# on 2 cores (benchmarks/idle_page.py). One refresher a page, once a second.
LIVE_REFRESH_S = 1.0


def job_status(jobs: JobManager, runs_dir: Path, refresh: bool = True) -> None:
    """The current job's progress, then its outcome. Only while a job runs does it
    refresh itself (an idle page costs nothing: no timer, no rerun); the click that
    starts a job reruns the page, which then draws the refreshing one. ``refresh=False``:
    drawn once, where the page has its own refresher (the Run page), which reruns the
    whole page when the job ends."""
    if jobs.current is not None and jobs.current.running and refresh:
        _job_status_live(jobs, runs_dir)
    else:
        _job_status(jobs, runs_dir)


@st.fragment(run_every=LIVE_REFRESH_S)
def _job_status_live(jobs: JobManager, runs_dir: Path) -> None:
    _job_status(jobs, runs_dir, LIVE_REFRESH_S)


def _job_status(jobs: JobManager, runs_dir: Path, refresh_s: float = 0.0) -> None:
    job = jobs.current
    if job is None:
        st.caption(f"Runs started here are kept in {runs_dir}.")
        return
    job.settle(refresh_s)  # ending before the next refresh: shown ended now, not a refresh later
    if job.running:
        show_progress(job)
        st.session_state["job_was_running"] = True
        return
    if st.session_state.pop("job_was_running", False):
        st.rerun(scope="app")  # list the new run everywhere, and show it beside its source
    show_outcome(job, where={"ddp": "on the Run tab", "ring": "on the Ring all-reduce tab",
                             "zero": "on the Memory (ZeRO) tab"}[job.kind])


def show_progress(job) -> None:
    total = job.total or 0
    text = f"{job.out.name}: {job.unit} {job.done}" + (f"/{total}" if total else "")
    if job.last_ms and job.kind == "ddp":
        text += f" · {job.last_ms:.0f} ms"
    st.progress(min(job.done / total, 1.0) if total else 0.0, text=text)


def show_outcome(job, where: str) -> None:
    """A finished job: success, or its failing rank, one-line reason and stderr tail."""
    if job.ok and job.result is not None and (job.result.untraced or job.result.incomplete):
        st.warning(f"{job.out.name}: {job.result.untraced or job.result.incomplete}")
    elif job.ok:
        st.success(f"{job.out.name} finished: see it {where}.")
    else:
        reason = job.error or (job.result.reason if job.result else "unknown")
        st.error(f"{job.out.name} failed: {reason}")
        if job.result is not None and (job.result.details or job.result.consequences or job.result.independent):
            st.caption("  \n".join([*job.result.details,
                                    *(f"also failed on its own: {c}" for c in job.result.independent),
                                    *(f"consequence: {c}" for c in job.result.consequences)]))
        if job.result is not None and job.result.stderr_tail:
            st.code(job.result.stderr_tail, language=None)


def job_button(label: str, key: str, start: Callable, settings: Callable[[], dict], *, disabled: bool,
               **button_kw) -> None:
    """A button that starts a job (``start``: a ``JobManager`` method, called with
    ``settings()``, the settings this page shows). It starts the job from the click's
    callback, which Streamlit runs before drawing the page: a click from a page drawn
    before another job began is answered ("a run is already going"), where a button
    drawn disabled on the rerun would drop it. The outcome shows under the button."""
    st.button(label, key=key, disabled=disabled, on_click=_start_from_click, args=(key, start, settings),
              **button_kw)
    said = st.session_state.pop(f"{key}__said", None)
    if said is not None:
        (st.error if said[0] == "error" else st.info)(said[1])


def widget_now(key: str, drawn):
    """A widget's value as the user has just set it: a click's callback runs before the
    page is drawn again (``drawn``: its value on the page drawn before, if it has none)."""
    return st.session_state.get(key, drawn)


def _start_from_click(key: str, start: Callable, settings: Callable[[], dict]) -> None:
    try:
        started = start(**settings())
    except ValueError as e:  # a bad setting, named; nothing started
        st.session_state[f"{key}__said"] = ("error", str(e))
        return
    if started is None:
        st.session_state[f"{key}__said"] = ("info", "A run is already going; it continues. This click started "
                                                    "nothing.")


def lab_controls(prefix: str, disabled: bool = False):
    """A switch for emulated nodes (``ddpscope run|ring --emulate-nodes``) and, on, their
    number and link; returns a function giving the job's settings for them."""
    why = lab.why_not()
    on = st.toggle("Emulate nodes over shaped links", key=f"{prefix}_lab", disabled=disabled or why is not None,
                   help=why or "N network namespaces joined through links of this rate (tc tbf), the world size "
                   "ranks in each: communication crosses a link as between machines. Bandwidth is emulated, "
                   "latency is not.")
    if not on:
        return lambda: {}
    c = st.columns(2)
    nodes = c[0].slider("nodes", 2, 4, 2, key=f"{prefix}_lab_nodes")
    link = c[1].select_slider("link", options=LINKS, value="1gbit", key=f"{prefix}_lab_link")
    return lambda: {"emulate_nodes": widget_now(f"{prefix}_lab_nodes", nodes) if widget_now(f"{prefix}_lab", on)
                    else None, "link": widget_now(f"{prefix}_lab_link", link) if widget_now(f"{prefix}_lab", on)
                    else None}


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
