"""The ``ddpscope`` command as installed (console script), from a folder that is not
this project: help, bad arguments, the dashboard command's checks."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
    sample = Path(__file__).resolve().parents[1] / "samples" / "gpt-2rank-cap1mb"
    proc = _run("summary", str(sample), "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"bucket_cap_mb": 1.0' in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["dashboard", "--port", "0"], "--port must be in 1..65535"),
    (["dashboard", "/etc/hostname"], "is not a folder"),
    (["run", "--out", "/tmp/never-made", "--", "no-such-script.py"], "script no-such-script.py does not exist"),
    (["summary", "/nonexistent"], "is not a folder"),
])
def test_bad_arguments_one_line_exit_2(args, message):
    proc = _run(*args)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr
    assert not Path("/tmp/never-made").exists()


def test_the_parent_never_imports_torch():
    """The launch side is torch-free: checking arguments costs no torch import."""
    code = ("import sys; from ddpscope.tracer.cli import build_parser; from ddpscope.tracer.launch.runner import RunConfig; "
            "from ddpscope.tracer.launch.jobs import JobManager; build_parser(); print('torch' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert proc.stdout.strip() == "False", proc.stderr
