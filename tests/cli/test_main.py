"""The ``ddpscope`` command as installed (console script), from a folder that is not
this project: help, bad arguments, the dashboard command's checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SAMPLES

DDPSCOPE = shutil.which("ddpscope") or str(Path(sys.executable).parent / "ddpscope")
pytestmark = pytest.mark.skipif(not Path(DDPSCOPE).exists(), reason="ddpscope is not installed (pip install -e .)")


def _run(*args: str, cwd="/") -> subprocess.CompletedProcess:
    return subprocess.run([DDPSCOPE, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_every_subcommand_is_there():
    proc = _run("--help")
    assert proc.returncode == 0
    for cmd in ("run", "ring", "zero", "summary", "perfetto", "dashboard"):
        assert cmd in proc.stdout


def test_summary_reads_a_sample_from_anywhere():
    sample = SAMPLES / "gpt-2rank-cap1mb"
    proc = _run("summary", str(sample), "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"bucket_cap_mb": 1.0' in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["dashboard", "--port", "0"], "--port must be in 1..65535"),
    (["dashboard", "/etc/hostname"], "is not a folder"),
    (["run", "--out", "/tmp/never-made", "--", "no-such-script.py"], "script no-such-script.py does not exist"),
    (["summary", "/nonexistent"], "is not a folder"),
    # a value given to a switch starts the script early: said, not "--out is required"
    (["run", "--profile", "3", "--out", "/tmp/never-made", "--", "train.py"],
     "'3' was taken as the script, before --, and '--out /tmp/never-made' as its arguments"),
])
def test_bad_arguments_one_line_exit_2(args, message):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not Path("/tmp/never-made").exists()


def test_the_parent_never_imports_torch():
    """The launch side is torch-free: checking arguments costs no torch import."""
    code = ("import sys; from ddpscope.cli.main import build_parser; from ddpscope.tracer.launch.runner import RunConfig; "
            "from ddpscope.tracer.launch.jobs import JobManager; build_parser(); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.stdout.strip() == "False", proc.stderr


CHATTY = str(ROOT / "tests" / "workers" / "chatty_train.py")


@pytest.mark.ddp
@pytest.mark.parametrize("flag", ["", pytest.param("-q", marks=pytest.mark.breadth),
                                  pytest.param("-v", marks=pytest.mark.breadth)])
def test_the_scripts_own_output_is_shown_as_under_torchrun(tmp_path, flag):
    """By default rank 0's output comes as it would under torchrun (stdout to stdout,
    warnings to stderr) beside ddpscope's own lines, each marked ``ddpscope: ``; the other
    ranks' output is in the logs, and the run says where. ``-q``: ddpscope's lines only;
    ``-v``: every rank's, marked with its rank."""
    out = tmp_path / "run"
    proc = _run("run", "--nproc", "2", *([flag] if flag else []), "--out", str(out), "--", CHATTY)
    assert proc.returncode == 0, proc.stderr
    mine = [line for line in proc.stderr.splitlines() if line.startswith("ddpscope: ")]
    assert any(line.startswith("ddpscope: step 2") for line in mine)  # progress, marked
    assert any(f"kept in {out / 'logs'}" in line for line in mine)
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    logs = {p.parent.name + "/" + p.name: p.read_text() for p in (out / "logs").glob("*/attempt_0/*/std*.log")}
    assert "loss line from rank 1, step 1" in logs["1/stdout.log"] and "a warning from rank 1" in logs["1/stderr.log"]
    if flag == "":
        assert "loss line from rank 0, step 0" in proc.stdout and "loss line from rank 0, step 1" in proc.stdout
        assert "a warning from rank 0, step 1" in proc.stderr and "the script's last line, rank 0" in proc.stderr
        assert "rank 0" not in proc.stdout.replace("loss line from rank 0", "")
        assert "rank 1" not in proc.stdout + proc.stderr
    elif flag == "-q":
        assert "loss line" not in proc.stdout + proc.stderr and "a warning" not in proc.stderr
    else:
        assert "[rank 1] loss line from rank 1, step 1" in proc.stdout
        assert "a warning from rank 1, step 0" in proc.stderr and "[rank 0] loss line from rank 0" in proc.stdout


def test_verbose_and_quiet_together_are_refused():
    proc = _run("run", "-v", "-q", "--out", "/tmp/never-made", "--demo", "mlp")
    assert proc.returncode == 2 and "either --verbose or --quiet" in proc.stderr
    assert not Path("/tmp/never-made").exists()


def test_the_dashboard_hides_streamlits_developer_menu_and_watches_no_files():
    """A user's page: no deploy button or developer menu, no file watcher on the installed
    source tree (whose inotify queue overflowed into the terminal); flags Streamlit knows."""
    import subprocess
    import sys
    from pathlib import Path

    from ddpscope.cli.dashboard import streamlit_command

    cmd = streamlit_command(Path("app.py"), "127.0.0.1", 8501)
    pairs = dict(zip(cmd[5::2], cmd[6::2]))
    assert pairs["--client.toolbarMode"] == "minimal" and pairs["--server.fileWatcherType"] == "none"
    assert pairs["--runner.postScriptGC"] == "false"  # no full collection after every page run (~0.18 s a core)
    assert cmd[:4] == [sys.executable, "-m", "ddpscope.dashboard.serve", "run"]  # the page's imports preloaded
    known = subprocess.run([*cmd[:4], "--help"], capture_output=True, text=True, timeout=60).stdout  # Streamlit's own
    for flag in pairs:
        assert flag in known, flag
