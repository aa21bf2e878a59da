"""``ddpscope dashboard [RUNS_DIR]``: the Streamlit page on a runs folder."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ddpscope.cli.output import PROG
from ddpscope.dashboard.environment import ALLOW_COMMANDS_ENV, OPEN_RUN_ENV, RUNS_DIR_ENV


def dashboard_command(args: argparse.Namespace) -> int:
    """Replace this process with ``streamlit run app.py`` on ``runs_dir`` (``streamlit_command``)."""
    app = app_path()
    if app is None:
        print(f"{PROG} dashboard: error: cannot find ddpscope's app.py next to the tracer package", file=sys.stderr)
        return 2
    runs = Path(args.runs_dir).resolve()
    if runs.exists() and not runs.is_dir():
        print(f"{PROG} dashboard: error: {runs} is not a folder", file=sys.stderr)
        return 2
    if not 1 <= args.port <= 65535:  # every refusal before anything else is said
        print(f"{PROG} dashboard: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    env = {**os.environ}
    if is_run_folder(runs):  # one run: the page opens it, among its neighbours
        env[OPEN_RUN_ENV] = runs.name
        print(f"{PROG} dashboard: {runs} is a run folder: the page opens it (runs in {runs.parent})", file=sys.stderr)
        runs = runs.parent
    elif not runs.is_dir():
        print(f"{PROG} dashboard: {runs} does not exist: the page shows ddpscope's samples (a run started there "
              "creates it)", file=sys.stderr)
    env[RUNS_DIR_ENV] = str(runs)
    if args.allow_commands:
        env[ALLOW_COMMANDS_ENV] = "1"
    cmd = streamlit_command(app, args.host, args.port)
    print(f"ddpscope dashboard on http://{args.host}:{args.port} (runs in {runs})", file=sys.stderr)
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def streamlit_command(app: Path, host: str, port: int) -> list[str]:
    """``streamlit run app.py`` as a user gets it: through ``ddpscope.dashboard.serve``
    (the page's heavy imports done while the browser loads), no deploy button or developer
    menu (``toolbarMode minimal``), no watcher on the installed source tree (its inotify
    queue overflows on a large venv and says so in the terminal), no usage statistics, and
    no full garbage collection after every page run (``runner.postScriptGC``: ~0.18 s of a
    core each in a server holding pandas and plotly, so ~18 % of a core while the Run
    page refreshes once a second beside a job; Python's own collector still runs)."""
    return [sys.executable, "-m", "ddpscope.dashboard.serve", "run", str(app), "--server.address", host,
            "--server.port", str(port), "--browser.gatherUsageStats", "false",
            "--server.maxUploadSize", "200", "--server.showEmailPrompt", "false",
            "--client.toolbarMode", "minimal", "--server.fileWatcherType", "none", "--server.runOnSave", "false",
            "--runner.postScriptGC", "false"]


def is_run_folder(path: Path) -> bool:
    """A folder that is one run (its run.json, or rank files), not a folder of runs."""
    from ddpscope.tracer import format as fmt

    if not path.is_dir():
        return False
    return (path / fmt.RUN_FILE).is_file() or any(fmt.RANK_FILE_RE.match(p.name) for p in path.iterdir())


def app_path() -> Path | None:
    """``app.py``: beside the packages (a source checkout or ``pip install -e``), or in
    ``<prefix>/share/ddpscope`` (``pip install .``)."""
    for candidate in (Path(__file__).resolve().parents[1] / "app.py", Path(sys.prefix) / "share" / "ddpscope" / "app.py"):
        if candidate.is_file():
            return candidate
    return None
