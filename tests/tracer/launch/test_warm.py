"""The warm launcher: one zygote with torch imported, ranks forked from it."""

from __future__ import annotations

import os
import threading
import time

import pytest

from ddpscope.tracer.launch import warm
from ddpscope.tracer.launch.procfs import alive
from ddpscope.tracer.launch.runner import RunConfig, run_job
from ddpscope.tracer.launch.warm import WarmLauncher
from tests.conftest import processes_mentioning

pytestmark = pytest.mark.ddp


def test_a_zygote_started_from_a_short_lived_thread_stays_warm_and_runs_jobs(tmp_path):
    """Each Streamlit page run has a thread of its own, gone when the page is drawn. The
    zygote must outlive it (it dies with the thread that started it, PR_SET_PDEATHSIG):
    it did not, and every dashboard rerun paid a cold start, or lost the race and failed
    ("the zygote died under the job")."""
    launcher = WarmLauncher()

    def page_run() -> None:  # starts the zygote, ends once it is warm (a page drawn after torch imported)
        launcher.start()
        deadline = time.monotonic() + 120
        while launcher.ready_s is None and time.monotonic() < deadline:
            time.sleep(0.1)

    thread = threading.Thread(target=page_run, name="page-run")
    thread.start()
    thread.join()
    try:
        assert launcher.ready_s is not None, "the zygote never became ready"
        pid = launcher._proc.pid
        time.sleep(1.0)
        assert alive(pid), "the zygote died with the thread that started it"
        for k in range(2):  # two jobs from the same warm zygote
            result = run_job(RunConfig(out=tmp_path / f"run{k}", demo="mlp", nproc=2, steps=3, bucket_cap_mb=1.0),
                             launcher=launcher.launch)
            assert result.ok, result.reason
            assert launcher._proc.pid == pid and (tmp_path / f"run{k}" / "rank-1.json").exists()
    finally:
        launcher.close()
    assert not alive(pid)  # reaped: no zombie either
    assert processes_mentioning(str(tmp_path)) == []
    assert pid not in [int(p) for p in os.listdir("/proc") if p.isdigit()]


def test_the_dashboards_launcher_warms_up_after_the_first_view_and_again_after_it_is_closed(monkeypatch):
    """The dashboard asks for its launcher on every page run. Its zygote's ``import torch``
    beside the first view slowed the first chart (benchmarks/first_chart.py): it warms up
    ``WARM_AFTER_S`` after the first ask, not at it; once warmed, a zygote gone (closed
    after a rank that would not die) warms up again at the next page run."""
    monkeypatch.setattr(warm, "WARM_AFTER_S", 0.5)
    monkeypatch.setattr(warm, "_shared", None)
    launcher = warm.shared_launcher()
    pids = []
    try:
        assert launcher._proc is None and warm.shared_launcher() is launcher and launcher._proc is None
        deadline = time.monotonic() + 120
        while launcher.ready_s is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert launcher.ready_s is not None, "the zygote never warmed up"
        pids.append(launcher._proc.pid)
        launcher.close()
        assert warm.shared_launcher() is launcher and launcher._proc is not None  # at once, this time
        pids.append(launcher._proc.pid)
        assert pids[1] != pids[0]
    finally:
        launcher.close()
    assert not any(alive(pid) for pid in pids)
