"""``ddpscope.dashboard.serve``: the server ``ddpscope dashboard`` starts, which imports the
page's heavy modules on a thread once Streamlit is up. Real processes: a fresh
interpreter for what the modules do when imported, a real Streamlit server for when the
thread imports."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from ddpscope.dashboard import serve
from ddpscope.tracer.launch.torchrun import free_port
from tests.conftest import ROOT


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_what_is_preloaded_is_what_the_page_imports_and_none_of_it_calls_streamlit():
    # the page's imports, as app.py makes them (bare: no runtime, as the thread imports)
    page = _python("""
        import json, sys
        before = set(sys.modules)
        import ddpscope.dashboard.catalog, ddpscope.dashboard.job_controls, ddpscope.dashboard.loaders
        import ddpscope.dashboard.tables, ddpscope.dashboard.page_guard
        import ddpscope.dashboard.memory_page, ddpscope.dashboard.ring_page
        import ddpscope.dashboard.run_page, ddpscope.dashboard.timeline_page, ddpscope.dashboard.whatif_page
        import streamlit.emojis
        print(json.dumps(sorted(set(sys.modules) - before)))
    """)
    assert page.returncode == 0, page.stderr
    imported_by_page = set(json.loads(page.stdout))
    assert set(serve.PRELOAD) - imported_by_page == set()  # nothing the page would not import anyway

    alone = _python("""
        import json, sys
        from ddpscope.dashboard import serve
        failed = serve.preload()
        print(json.dumps({"failed": failed, "missing": [n for n in serve.PRELOAD if n not in sys.modules],
                          "dashboard": sorted(m for m in sys.modules if m.startswith("ddpscope.dashboard."))}))
    """)
    assert alone.returncode == 0, alone.stderr
    out = json.loads(alone.stdout)
    assert out == {"failed": [], "missing": [], "dashboard": ["ddpscope.dashboard.serve"]}
    # a module that made a Streamlit cache or element when imported would say so here
    assert "No runtime found" not in alone.stderr and "ScriptRunContext" not in alone.stderr, alone.stderr


def test_a_module_that_fails_to_import_is_left_to_the_page():
    assert serve.preload(("ddpscope.no_such_module", "json")) == ["ddpscope.no_such_module"]


def test_the_server_preloads_once_it_is_up_and_the_page_waits_for_it():
    """A real ``python -m ddpscope.dashboard.serve run`` server: the thread starts importing
    only after Streamlit's runtime has left INITIAL (no import beside the server's own), and
    ``wait_for_preload`` returns with pandas imported; the process then ends itself."""
    probe = textwrap.dedent("""
        import os, signal, sys, threading
        from ddpscope.dashboard import serve
        from streamlit.runtime import Runtime

        seen = {}
        up = serve.server_up

        def server_up(*args, **kwargs):
            ok = up(*args, **kwargs)
            seen["state"] = Runtime.instance().state.name if Runtime.exists() else None
            seen["pandas_before"] = "pandas" in sys.modules
            return ok

        serve.server_up = server_up

        def report():
            while serve._thread is None:
                threading.Event().wait(0.01)
            serve.wait_for_preload()
            print("PROBE", seen, "pandas" in sys.modules, serve._thread.is_alive(), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=report, daemon=True).start()
        serve.main(sys.argv[1:])
    """)
    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-c", probe, "run", str(ROOT / "app.py"), "--server.headless", "true", "--server.port",
         str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert line == "PROBE {'state': 'NO_SESSIONS_CONNECTED', 'pandas_before': False} True False", line
