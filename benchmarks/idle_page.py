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

Benchmarks are not tests: nothing is asserted; ``--smoke`` idles 3 s.
"""

from __future__ import annotations

import argparse
import os
import signal
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


def measure(seconds: float, watcher: bool = False) -> dict[str, float]:
    """CPU % of a core of the server and the browser over ``seconds`` of an idle page;
    ``watcher``: with Streamlit's file watcher on (``streamlit run app.py`` in this tree),
    else as ``ddpscope dashboard`` runs it (none)."""
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory(prefix="ddpscope-idle-") as tmp:
        proc, port = serve(ROOT / "app.py", Path(tmp) / "runs", watch=watcher)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--no-first-run"])
                try:
                    page = browser.new_page(viewport={"width": 1400, "height": 1000})
                    page.goto(f"http://127.0.0.1:{port}/", timeout=60_000)
                    page.wait_for_selector(".js-plotly-plot .barlayer .point", timeout=90_000)
                    page.wait_for_timeout(3000)  # settle: fonts, the last layout
                    parents = _parents()
                    server = _tree(proc.pid, parents)
                    ours = _tree(os.getpid(), parents) - server - {os.getpid()}  # Playwright's driver and Chromium
                    t0, s0, b0 = time.monotonic(), _cpu_ticks(server), _cpu_ticks(ours)
                    time.sleep(seconds)
                    wall = time.monotonic() - t0
                    s1, b1 = _cpu_ticks(server), _cpu_ticks(ours)
                finally:
                    browser.close()
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    return {"server": 100.0 * (s1 - s0) / TICK / wall, "browser": 100.0 * (b1 - b0) / TICK / wall, "wall": wall}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="how long the page sits idle while measured")
    p.add_argument("--smoke", action="store_true", help="idle 3 s: the script runs, nothing more")
    args = p.parse_args(argv)
    if args.smoke:
        args.seconds = 3.0
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


if __name__ == "__main__":
    main()
