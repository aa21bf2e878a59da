"""``ddpscope dashboard [RUNS_DIR]``: the Streamlit page on a runs folder."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ddpscope.cli.output import PROG


def dashboard_command(args: argparse.Namespace) -> int:
    """Replace this process with ``streamlit run app.py`` on ``runs_dir``."""
    app = app_path()
    if app is None:
        print(f"{PROG} dashboard: error: cannot find ddpscope's app.py next to the tracer package", file=sys.stderr)
        return 2
    runs = Path(args.runs_dir).resolve()
    if runs.exists() and not runs.is_dir():
        print(f"{PROG} dashboard: error: {runs} is not a folder", file=sys.stderr)
        return 2
    if not 1 <= args.port <= 65535:
        print(f"{PROG} dashboard: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    env = {**os.environ, "DDPSCOPE_RUNS_DIR": str(runs)}
    if args.allow_commands:
        env["DDPSCOPE_ALLOW_COMMANDS"] = "1"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", args.host,
           "--server.port", str(args.port), "--browser.gatherUsageStats", "false",
           "--server.maxUploadSize", "200", "--server.showEmailPrompt", "false"]
    print(f"ddpscope dashboard on http://{args.host}:{args.port} (runs in {runs})", file=sys.stderr)
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def app_path() -> Path | None:
    """``app.py``: beside the packages (a source checkout or ``pip install -e``), or in
    ``<prefix>/share/ddpscope`` (``pip install .``)."""
    for candidate in (Path(__file__).resolve().parents[1] / "app.py", Path(sys.prefix) / "share" / "ddpscope" / "app.py"):
        if candidate.is_file():
            return candidate
    return None
