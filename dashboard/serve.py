"""``python -m ddpscope.dashboard.serve run app.py [flags]``: Streamlit's own ``streamlit
run``, with the page's heavy imports done while the browser loads Streamlit's front end.

A fresh server's first page run spent about half its time importing (pandas ~0.4 s on
these 2 cores, ddpscope's ``viz`` modules, Streamlit's emoji table at the first
``st.warning``: benchmarks/first_chart.py), and nothing ran them sooner: Streamlit runs
``app.py`` only when a browser's session starts, ~2 s after the page is asked for (the
front end loads first). ``ddpscope dashboard`` starts the server through this module,
which imports them on a thread as the server starts.

Two threads importing modules that import each other can deadlock Python's module locks
(or one gets a half-made module), so no two import at once: the thread starts importing
once Streamlit's server is up (its runtime out of ``INITIAL``: the server has imported
what it serves with, uvicorn's ``multiprocessing`` and ``zoneinfo`` among them, which
pandas imports too), and ``app.py`` waits for the thread (``wait_for_preload``) before
its own imports. Only modules that make no Streamlit call at import are preloaded: the
dashboard's own modules make their caches when imported, and a cache made before
Streamlit's runtime exists is a plain in-memory one (Streamlit says "No runtime found").
An import that fails here is left to the page, which says what is wrong where the user
looks.
"""

from __future__ import annotations

import importlib
import sys
import threading
import time
from typing import Callable

# what the first view imports, heaviest first; none calls Streamlit when imported
PRELOAD = (
    "pandas",
    "plotly.graph_objects",
    "streamlit.emojis",  # Streamlit's: the emoji regex every icon-less st.warning/info compiles once
    "ddpscope.tracer.launch.jobs",
    "ddpscope.viz.sources",
    "ddpscope.viz.sources.archive",
    "ddpscope.viz.sources.rank_events",
    "ddpscope.viz.perfetto",
    "ddpscope.viz.ring.trace",
    "ddpscope.viz.zero.trace",
    "ddpscope.viz.ddp.gantt",
    "ddpscope.viz.ddp.buckets",
    "ddpscope.viz.ddp.compare",
    "ddpscope.viz.ddp.overlap",
    "ddpscope.viz.ddp.stragglers",
    "ddpscope.viz.ddp.rank_overview",
    "ddpscope.viz.ddp.kernel_gantt",
    "ddpscope.viz.ddp.kernel_overlap",
    "ddpscope.viz.ddp.profile_check",
    "ddpscope.viz.sharded.figures",
    "ddpscope.viz.sharded.metrics",
)
SERVER_UP_S = 30.0  # the thread waits this long for the server, then imports anyway
WAIT_S = 60.0  # the page waits at most this long for the thread (it only imports)

_thread: threading.Thread | None = None


def preload(names: tuple[str, ...] = PRELOAD, after: Callable[[], object] = lambda: None) -> list[str]:
    """Import ``names`` once ``after()`` returns; returns those that failed (the page's own
    import says why)."""
    after()
    failed = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the page imports it again and shows the error there
            failed.append(name)
    return failed


def server_up(timeout_s: float = SERVER_UP_S) -> bool:
    """Wait until Streamlit's runtime has started (it then accepts sessions)."""
    from streamlit.runtime import Runtime, RuntimeState

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Runtime.exists() and Runtime.instance().state != RuntimeState.INITIAL:
            return True
        time.sleep(0.01)
    return False


def start_preload() -> None:
    global _thread
    thread = threading.Thread(target=preload, kwargs={"after": server_up}, name="ddpscope-preload", daemon=True)
    thread.start()
    _thread = thread  # published once started: a thread seen but not yet alive would not be waited for


def wait_for_preload() -> None:
    """Return once the preloading thread is done (at once without one: ``streamlit run
    app.py``, a test's AppTest, or every run after the first)."""
    thread = _thread
    if thread is not None and thread.is_alive():
        thread.join(WAIT_S)


def main(argv: list[str] | None = None) -> None:
    """``streamlit ARGV`` (``run app.py --flags``) in this process, preloading once it is up."""
    from streamlit.web import cli  # imports streamlit.runtime too: the thread's server_up imports nothing new

    start_preload()
    sys.argv = ["streamlit", *(sys.argv[1:] if argv is None else argv)]
    cli.main(prog_name="streamlit")


if __name__ == "__main__":
    # run as the module ddpscope.dashboard.serve, not as __main__: app.py's wait_for_preload
    # reads the thread from that module
    from ddpscope.dashboard import serve

    serve.main()
