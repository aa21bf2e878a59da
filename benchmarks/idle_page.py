"""What an open, idle dashboard costs: CPU of the server and of the browser while nobody
touches the page.

    python -m benchmarks.idle_page [--seconds 20] [--smoke]

A fresh ``streamlit run app.py`` (headless, a free local port) on an empty runs folder
(the samples), opened in headless Chromium (Debian's, through Playwright) at the
Timeline; once its chart is drawn and the page has settled (3 s), the CPU time of the
server's processes and of the browser's (utime + stime from ``/proc``) is read before
and after ``--seconds`` of nobody touching it, and printed as % of one core, as ``ddpscope dashboard`` runs the server (no file watcher)
and, beside it, with Streamlit's file watcher on this tree (``streamlit run app.py`` here:
watching a tree that holds a venv costs about a core). Goal (issue 33): <= 1 % each: the
page refreshes only while a job runs (``job_status``), never on a timer when idle (two
0.5 s refreshers cost ~32 % of a core here before).

Beside a running job (``--job``, on by default): the same page on the Run tab reruns the
open sample (the GPT demo, 2 ranks, 50 steps) and, while the job runs, the server's own
process (not the job's, its children) and the browser are measured as above, a second at
a time while the page's bar shows the job short of its last step (the page's end, the
new run's charts drawn, is a page run, not refreshing); then the
command the page wrote in run.json is run again from a shell with no page open, and the
two runs' median steps are printed side by side (``viz.ddp.compare``: the difference
and its 95 % interval), which is what the page's refreshing costs the training it watches.

Benchmarks are not tests: nothing is asserted; ``--smoke`` idles 3 s and skips the job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.rerun import serve

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
TICK = os.sysconf("SC_CLK_TCK")


def _parents() -> dict[int, int]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    return out


def _tree(root: int, parents: dict[int, int]) -> set[int]:
    found, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in found and pid not in found:
                found.add(pid)
                grew = True
    return found


def _cpu_ticks(pids: set[int]) -> int:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
    return total


@contextlib.contextmanager
def _served_page(runs: Path, query: str = "", watcher: bool = False):
    """A fresh server on ``runs`` and headless Chromium opened on it (``query``: e.g.
    ``?page=Run``): yields ``(page, server)``; both are ended afterwards."""
    from playwright.sync_api import sync_playwright

    proc, port = serve(ROOT / "app.py", runs, watch=watcher)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page.goto(f"http://127.0.0.1:{port}/{query}", timeout=60_000)
                yield page, proc
            finally:
                browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _browser_pids(server: set[int]) -> set[int]:
    """Playwright's driver and Chromium: this process's descendants but the server's."""
    return _tree(os.getpid(), _parents()) - server - {os.getpid()}


def measure(seconds: float, watcher: bool = False) -> dict[str, float]:
    """CPU % of a core of the server and the browser over ``seconds`` of an idle page;
    ``watcher``: with Streamlit's file watcher on (``streamlit run app.py`` in this tree),
    else as ``ddpscope dashboard`` runs it (none)."""
    with tempfile.TemporaryDirectory(prefix="ddpscope-idle-") as tmp, \
            _served_page(Path(tmp) / "runs", watcher=watcher) as (page, proc):
        page.wait_for_selector(".js-plotly-plot .barlayer .point", timeout=90_000)
        page.wait_for_timeout(3000)  # settle: fonts, the last layout
        server = _tree(proc.pid, _parents())
        ours = _browser_pids(server)
        t0, s0, b0 = time.monotonic(), _cpu_ticks(server), _cpu_ticks(ours)
        time.sleep(seconds)
        wall = time.monotonic() - t0
        s1, b1 = _cpu_ticks(server), _cpu_ticks(ours)
    return {"server": 100.0 * (s1 - s0) / TICK / wall, "browser": 100.0 * (b1 - b0) / TICK / wall, "wall": wall}


def measure_beside_job(steps: int = 50) -> dict:
    """The page on the Run tab while the job it started runs: CPU % of a core of the
    server's own process and of the browser, the job's median step, and the same command
    run from a shell with no page: its median step and the difference's interval."""
    sys.path.insert(0, str(ROOT))
    from ddpscope.viz.ddp.compare import compute_run_comparison
    from ddpscope.viz.trace import load_run

    with tempfile.TemporaryDirectory(prefix="ddpscope-idle-job-") as tmp:
        runs = Path(tmp) / "runs"
        with _served_page(runs, "?page=Run") as (page, proc):
            button = page.get_by_role("button", name=re.compile(r"^Rerun"))
            button.wait_for(timeout=90_000)
            page.get_by_role("slider").nth(1).focus()  # cap, steps, world size
            for _ in range(60):  # down to 3, then up to the asked count
                page.keyboard.press("ArrowLeft")
            for _ in range(steps - 3):
                page.keyboard.press("ArrowRight")
            page.wait_for_timeout(2000)  # the page reruns with the new settings
            button.click()
            page.wait_for_selector('[data-testid="stProgress"]', timeout=60_000)
            page.wait_for_timeout(2000)  # past the launch: the ranks are stepping
            ours = _browser_pids(_tree(proc.pid, _parents()))
            # the server's own process (the job it started is its child, measured apart), a
            # second at a time while the bar says the job is short of its last step: the
            # page's end (the run's charts, Plotly loaded: ~1 s of the browser) is not refreshing
            bar = page.locator('[data-testid="stProgress"]')
            wall = s_ticks = b_ticks = 0.0
            before = time.monotonic(), _cpu_ticks({proc.pid}), _cpu_ticks(ours)
            while True:
                page.wait_for_timeout(1000)
                after = time.monotonic(), _cpu_ticks({proc.pid}), _cpu_ticks(ours)
                step = re.search(r"step (\d+)/(\d+)", bar.last.inner_text(timeout=2000)) if bar.count() else None
                if step is None or int(step[1]) >= int(step[2]):
                    break
                wall += after[0] - before[0]
                s_ticks += after[1] - before[1]
                b_ticks += after[2] - before[2]
                before = after
            page.wait_for_selector('[data-testid="stProgress"]', state="detached", timeout=600_000)
        page_dir = next(d for d in runs.iterdir() if d.name != "uploads")
        words = shlex.split(load_run(page_dir).run["command"])
        cli_dir = Path(tmp) / "cli-run"
        words[words.index("--out") + 1] = str(cli_dir)
        subprocess.run([sys.executable, "-m", "ddpscope.cli", *words[1:]], cwd="/", check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
        table = compute_run_comparison({"from the page": load_run(page_dir), "from a shell": load_run(cli_dir)})
    wall = max(wall, 1e-9)  # a job over before its first whole second: nothing measured (0 %)
    return {"server": 100.0 * s_ticks / TICK / wall, "browser": 100.0 * b_ticks / TICK / wall, "wall": wall,
            "table": table}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="how long the page sits idle while measured")
    p.add_argument("--smoke", action="store_true", help="idle 3 s, no job: the script runs, nothing more")
    p.add_argument("--no-job", dest="job", action="store_false", help="leave out the page beside a running job")
    args = p.parse_args(argv)
    if args.smoke:
        args.seconds, args.job = 3.0, False
    if not os.path.exists(CHROMIUM):
        print(f"benchmarks.idle_page: needs Debian's chromium at {CHROMIUM}", file=sys.stderr)
        raise SystemExit(2)
    load = os.getloadavg()[0]
    r = measure(args.seconds)
    w = measure(args.seconds, watcher=True)
    print(f"idle page (the Timeline on a sample, {r['wall']:.1f} s untouched; load average {load:.2f} before), "
          "% of a core:")
    print(f"  {'':34} {'server':>7} {'browser':>8}")
    print(f"  {'as ddpscope dashboard runs it':34} {r['server']:7.2f} {r['browser']:8.2f}")
    print(f"  {'with a file watcher on this tree':34} {w['server']:7.2f} {w['browser']:8.2f}")
    met = r["server"] <= 1.0 and r["browser"] <= 1.0
    print(f"  goal <= 1 % each (ddpscope dashboard): {'met' if met else 'NOT met'}")
    if not args.job:
        return
    j = measure_beside_job()
    print(f"beside a running job (the Run tab, the GPT demo's 50 steps on 2 ranks; {j['wall']:.1f} s measured), "
          "% of a core:")
    print(f"  {'the page while its job runs':34} {j['server']:7.2f} {j['browser']:8.2f}")
    t = j["table"]
    for r in t.itertuples():
        print(f"  {r.run:>14}: median step {r.step_ms:.1f} ms (95 % {r.step_ms_lo:.1f}..{r.step_ms_hi:.1f}), "
              f"{r.steps} steps")
    r = t.iloc[1]
    print(f"  a shell's run - the page's: {r['step_ms_vs_first']:+.1f} ms (95 % {r['step_ms_vs_first_lo']:+.1f}.."
          f"{r['step_ms_vs_first_hi']:+.1f}){', inside the noise' if r['within_noise'] else ''}")


if __name__ == "__main__":
    main()
