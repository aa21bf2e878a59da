"""Starting and watching jobs from a page: the job manager, whether this page may start
commands, the buttons that start a job, its progress and outcome, and the emulated
nodes' controls."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import streamlit as st

from ddpscope.dashboard.environment import ALLOW_COMMANDS_ENV
from ddpscope.tracer.launch import lab
from ddpscope.tracer.launch.jobs import JobManager

#: the link rates the pages offer for emulated nodes (tc's units)
LINKS = ["100mbit", "200mbit", "1gbit", "10gbit"]


@st.cache_resource
def job_manager(runs_dir: str, warm: bool) -> JobManager:
    """Runs started from the page; with ``warm``, through a launcher kept warm (torch
    imported once, ranks forked from it: the rerun loop does not pay a cold start)."""
    if not warm:
        return JobManager(Path(runs_dir))
    from ddpscope.tracer.launch.warm import shared_launcher

    return JobManager(Path(runs_dir), launcher=shared_launcher().launch)


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
                             "zero": "on the Memory (ZeRO) tab",
                             "calibrate": "on the What-if tab, whose predictions now use it"}[job.kind])


def show_progress(job) -> None:
    total = job.total or 0
    text = f"{job.out.name}: {job.unit} {job.done}" + (f"/{total}" if total else "")
    if job.kind == "calibrate":  # its sizes are said as their last pass ends
        sizes = max(total - 1, 0)  # then the contention phase
        text = f"calibrating {job.out.name}: " + (f"all-reduce sizes {min(job.done, sizes)}/{sizes}, then contention "
                                                  "beside compute" if total else "starting")
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
