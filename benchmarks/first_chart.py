"""From opening the dashboard to its first chart, in a real browser, on a fresh server.

    python -m benchmarks.first_chart [--repeat 3] [--smoke]

Each repeat starts a fresh ``streamlit run`` (headless, a free local port; the app run
through a thin wrapper that stamps each script run on the host's monotonic clock), waits
until it answers, then opens the page in headless Chromium (Debian's, through
Playwright) and waits for the first chart with its bars drawn. Printed per page opened
(the Timeline, and deep links to the Memory and What-if pages), medians:

- total: ``page.goto`` -> the first chart on screen;
- script run: the server running app.py for that first view (the wrapper's stamps);
- the rest: the browser loading Streamlit's front end, the websocket, shipping the
  elements and Plotly drawing them (total minus the script run).

Each server is started as ``ddpscope dashboard`` starts it (``python -m
ddpscope.dashboard.serve run``: the page's heavy imports done on a thread while the
browser loads); the last row, the Timeline on a plain ``python -m streamlit run``, is
what that preloading saves, measured beside it.

Goals (issue 33, on these 2 cores): the Timeline's first chart <= 3 s, the What-if's <= 5 s
(the Memory page's < 5 s, issue 22's), printed beside the machine's load average before
and after, as a loaded machine moves every number. Only computing the open page
(``st.tabs(..., bind="query-params")``, ``tab.open``) makes them possible: every tab's
content used to be built on every run (7.5-13 s). Benchmarks are not tests: nothing is
asserted; ``--smoke``: the Timeline once.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import textwrap
import time
import urllib.parse
import urllib.request
from pathlib import Path

from benchmarks.rerun import serve

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
STAMP = "ddpscope-bench-script-run"
PLAIN = "Timeline, streamlit run"  # the comparison row: no preloading
GOALS_S = {"Timeline (/)": 3.0, "?page=Memory (ZeRO)": 5.0, "?page=What-if": 5.0}  # median first chart

# Runs app.py as Streamlit would, stamping each script run (start, end: monotonic µs).
WRAPPER = textwrap.dedent(f'''
    import sys, time
    t0 = time.monotonic_ns() / 1e3
    try:
        exec(compile(open({str(ROOT / "app.py")!r}).read(), {str(ROOT / "app.py")!r}, "exec"),
             {{"__name__": "__main__", "__file__": {str(ROOT / "app.py")!r}}})
    finally:
        print("{STAMP}", t0, time.monotonic_ns() / 1e3, file=sys.stderr, flush=True)
''')


def _script_runs(log: Path) -> list[tuple[float, float]]:
    out = []
    for line in log.read_text().splitlines():
        if line.startswith(STAMP):
            _, a, b = line.split()
            out.append((float(a), float(b)))
    return out


def open_once(page_label: str | None, runs: Path, tmp: Path, entry: str = "ddpscope.dashboard.serve"
              ) -> dict[str, float]:
    from playwright.sync_api import sync_playwright

    wrapper, log = tmp / "bench_app.py", tmp / "server.log"
    wrapper.write_text(WRAPPER)
    with open(log, "w") as err:
        proc, port = serve(wrapper, runs, stderr=err, entry=entry)
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=[
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"])
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            query = "" if page_label is None else "?" + urllib.parse.urlencode({"page": page_label})
            t0 = time.monotonic_ns() / 1e3
            page.goto(f"http://127.0.0.1:{port}/{query}", timeout=90_000)
            page.wait_for_function("""() => [...document.querySelectorAll('.js-plotly-plot')]
                .some(g => g.querySelector('.barlayer .point, .scatterlayer .trace, .scatterlayer path'))""",
                                   timeout=90_000)
            t1 = time.monotonic_ns() / 1e3
            browser.close()
        # a page may draw its chart before its script run ends (the What-if's does): its
        # stamp is written when the run ends, so the server lives until then
        deadline = time.monotonic() + 30
        while not [r for r in _script_runs(log) if r[0] >= t0] and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    first = [r for r in _script_runs(log) if r[0] >= t0]
    script = (first[0][1] - first[0][0]) / 1e3 if first else float("nan")
    total = (t1 - t0) / 1e3
    return {"total": total, "script run": script, "the rest": total - script}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="the Timeline once: the script runs, nothing more")
    args = p.parse_args()
    # (row, page, the server's entry): ddpscope dashboard's, and for comparison the Timeline
    # on a plain `streamlit run` (no preloading: dashboard/serve.py)
    pages = [("Timeline (/)", None, "ddpscope.dashboard.serve"),
             ("?page=Memory (ZeRO)", "Memory (ZeRO)", "ddpscope.dashboard.serve"),
             ("?page=What-if", "What-if", "ddpscope.dashboard.serve"),
             (PLAIN, None, "streamlit")]
    if args.smoke:
        args.repeat, pages = 1, pages[:1]
    results: dict[str, list[dict]] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = tmp / "runs"
        runs.mkdir()
        for _ in range(args.repeat):
            for name, label, entry in pages:  # interleaved: the machine's drift hits every page alike
                results.setdefault(name, []).append(open_once(label, runs, tmp, entry))
    cols = ["total", "script run", "the rest"]
    print(f"fresh server -> first chart on screen, headless Chromium, median of {args.repeat} (ms)")
    print(f"{'':24}" + "".join(f"{c:>12}" for c in cols))
    for name, rows in results.items():
        print(f"{name:24}" + "".join(f"{statistics.median(r[c] for r in rows):12.0f}" for c in cols))
    load_after = os.getloadavg()
    print(f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}, after "
          f"{', '.join(f'{x:.2f}' for x in load_after)}, on {os.cpu_count()} cores")
    for name, rows in results.items():
        if name not in GOALS_S:
            continue
        goal = GOALS_S[name]
        got = statistics.median(r["total"] for r in rows) / 1e3
        print(f"{name}: first chart {got:.2f} s, goal <= {goal:g} s: {'met' if got <= goal else 'NOT met'}")


if __name__ == "__main__":
    main()
