"""The dashboard in a real browser: ``streamlit run app.py`` on a free local port,
opened in headless Chromium (Debian's, driven by Playwright), chart checked, screenshot
taken (``DDPSCOPE_UPDATE_IMAGES=1`` makes it the README's picture). Skipped where Chromium or Playwright is absent (.ci/run installs both)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from ddpscope.cli.dashboard import streamlit_command
from ddpscope.tracer.launch.torchrun import free_port
from tests.conftest import ROOT

CHROMIUM = Path("/usr/bin/chromium")
SCREENSHOT = ROOT / "docs" / "images" / "timeline.png"  # README.md shows it
UPDATE_IMAGES = "DDPSCOPE_UPDATE_IMAGES"  # =1: the test's screenshot replaces it
playwright = pytest.importorskip("playwright.sync_api")
pytestmark = [pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed"),
              pytest.mark.browser]


def _wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "streamlit exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError("streamlit did not come up")


@contextlib.contextmanager
def dashboard_page(runs: Path):
    """``streamlit run app.py`` as ``ddpscope dashboard`` starts it (``ddpscope.dashboard.serve``)
    on a free local port with ``runs`` as the runs folder,
    opened in headless Chromium at its first timeline: yields ``(page, port, server)``
    (``server``: the streamlit process); the server is stopped and its process group
    ended afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [*streamlit_command(Path("app.py"), "127.0.0.1", port), "--server.headless", "true"],  # as the user gets it
        cwd=ROOT, env={**os.environ, "DDPSCOPE_RUNS_DIR": str(runs)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        _wait_healthy(port, proc)
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(CHROMIUM), args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/", timeout=60_000)
                page.wait_for_selector(".js-plotly-plot .barlayer .point", timeout=60_000)
                yield page, port, proc
            finally:
                browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_dashboard_renders_the_timeline_for_both_ranks(tmp_path):
    with dashboard_page(tmp_path / "runs") as (page, port, _):
        ticks = page.eval_on_selector_all(".js-plotly-plot .ytick text", "els => els.map(e => e.textContent)")
        assert {"rank 0 · compute", "rank 0 · all-reduce", "rank 1 · compute", "rank 1 · all-reduce"} <= set(ticks)
        bars = page.locator(".js-plotly-plot .barlayer .point").count()
        assert bars >= 2 * 20  # at least every bucket of both ranks
        # bars sit on both ranks' lanes: y centres of bars span the plot
        ys = page.eval_on_selector_all(".js-plotly-plot .barlayer .point path",
                                       "els => els.map(e => e.getBoundingClientRect().y)")
        assert max(ys) - min(ys) > 100
        assert page.get_by_text("Deploy", exact=True).count() == 0  # no developer menu for a user
        page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
        # the README's picture, made here from the sample so that it shows the page as it is;
        # copied into docs/ only when asked (a test run leaves the checkout as it found it)
        page.locator(".js-plotly-plot").first.screenshot(path=str(tmp_path / "timeline.png"))
        assert (tmp_path / "timeline.png").stat().st_size > 10_000
        if os.environ.get(UPDATE_IMAGES) == "1":
            shutil.copyfile(tmp_path / "timeline.png", SCREENSHOT)
        _ring_animation_plays(page, tmp_path)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0  # nothing listens any more


def _ring_animation_plays(page, tmp_path: Path) -> None:
    """The Ring tab's animation: play runs every frame in order, with per-frame durations."""
    page.get_by_role("tab", name="Ring all-reduce").click()
    page.get_by_text("▶ play").wait_for(timeout=60_000)
    find = "() => [...document.querySelectorAll('.js-plotly-plot')].find(g => (g._transitionData || {})._frames?.length)"
    page.wait_for_function(f"() => !!({find})()", timeout=60_000)
    info = page.evaluate(f"""() => {{
        const gd = ({find})();
        window.ringSeen = [];
        gd.on('plotly_animatingframe', e => window.ringSeen.push(e.name));
        const play = gd.layout.updatemenus[0].buttons[0].args[1];
        return {{frames: gd._transitionData._frames.length, durations: play.frame.map(f => f.duration),
                 meta: gd.layout.meta.frame_ms, slots: gd._fullData[0].x.length}};
    }}""")
    assert info["frames"] == 7 and info["slots"] == 16  # 4 ranks x 4 chunk slots
    assert info["durations"] == info["meta"] and len(set(info["durations"])) > 1  # one duration per frame
    page.get_by_text("▶ play").click()
    page.wait_for_function("() => window.ringSeen.length >= 7", timeout=sum(info["durations"]) + 30_000)
    assert page.evaluate("window.ringSeen") == [str(k) for k in range(7)]
    page.screenshot(path=str(tmp_path / "ring.png"), full_page=True)


@pytest.mark.skipif(not (ROOT.parent / "shared" / "data" / "kineto").is_dir(), reason="../shared/data/kineto is absent")
def test_a_big_profiler_trace_opens_and_draws_its_timeline(tmp_path):
    """243 k events (the shared trace's steps repeated, as benchmarks/kineto.py builds
    them; rank 0 of 2): picked in the sidebar, its kernel timeline is on screen within a minute."""
    from benchmarks.kineto import build_job

    build_job(tmp_path / "runs" / "big-profile", ranks=1, copies=6, world_size=2)
    with dashboard_page(tmp_path / "runs") as (page, _, _):
        page.locator("[data-testid='stSidebar'] [data-testid='stSelectbox']").first.click()
        page.get_by_role("option", name="run: big-profile").click()
        page.wait_for_function(
            "() => [...document.querySelectorAll('.js-plotly-plot .ytick text')]"
            ".some(e => e.textContent === 'rank 0 · allreduce')", timeout=60_000)
        ticks = page.eval_on_selector_all(".js-plotly-plot .ytick text", "els => els.map(e => e.textContent)")
        assert {"rank 0 · compute", "rank 0 · allreduce", "rank 0 · exposed comm"} <= set(ticks)
        assert page.locator(".js-plotly-plot .barlayer .point").count() > 100  # one step's kernels
        assert page.get_by_text("1 of 2").count() >= 1  # ranks present of the job
        page.screenshot(path=str(tmp_path / "profile.png"), full_page=True)
