"""The user's training comes first: a trace that can no longer be written stops tracing
(one line per rank), and training runs to its end, unchanged."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.viz.sources import load_training_trace
from tests.conftest import processes_mentioning
from tests.tracer.capture.autotrace.test_autotrace import USER, checks, untraced

pytestmark = [pytest.mark.ddp, pytest.mark.failures]
STEPS = 400  # the disk-full run's steps (its comment says why they are enough)


def _traced(out: Path, report: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpscope.cli", "run", "--nproc", "2", "--out", str(out), "--", USER,
                             "--steps", str(steps), "--report", str(report)], cwd="/", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_step(out: Path, step: int) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if json.loads((out / fmt.live_file(0)).read_text())["steps_done"] >= step:
                return
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"rank 0 did not reach step {step}")


@contextlib.contextmanager
def small_disk(where: Path, size: str = "3m"):
    """A tmpfs of ``size`` at ``where`` (a real full disk: ENOSPC), holding one empty file,
    ``where / "filler"``; skips where mounting is not allowed (not root, or no
    CAP_SYS_ADMIN in a container)."""
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN)")
    try:
        _first_file(where / "filler")
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def _first_file(path: Path) -> None:
    """The fresh tmpfs's first file, made once and kept (a test fills the disk through it,
    opening it without creating anything); skips, saying what the machine showed, where
    the tmpfs refuses it: the tests are of a disk that fills during the run, not of one
    that takes no file at its start. (CI failed so twice, 2026-12-03, beside the other
    lane's jobs: ENOSPC creating a file on a fresh 16 MiB tmpfs right after a first one
    had been made and removed there; the cause is not known.)"""
    st = os.statvfs(path.parent)
    seen = (f"mounted={os.path.ismount(path.parent)}, {st.f_bavail * st.f_frsize} bytes and "
            f"{st.f_favail} inodes free; / has {shutil.disk_usage('/').free} bytes free")
    try:
        path.touch()
    except OSError as e:
        pytest.skip(f"a fresh small tmpfs refused its first file here ({e.strerror}; {seen})")


def test_training_goes_on_when_the_disk_fills_and_the_trace_says_incomplete(tmp_path):
    # 400 steps write ~3.6 MB of trace in ~6 s (~25 s beside CI's other lane): the 16 MiB disk
    # does not fill by itself, and the filler, a few ms of writes once step 3 is seen, fills it
    # mid-run even when the test is held off its core for seconds. (1000 steps, as here until
    # 2026-12-01, cost ~130 s of CI's lane A for the same check.)
    with small_disk(tmp_path / "disk", "16m") as disk:
        out, report = disk / "run", tmp_path / "report"
        # The filler was made with the disk (small_disk), before the run: on a loaded machine the
        # trace may fill the small disk itself before step 3 is seen, and creating a file on a
        # full disk fails (ENOSPC); opening it for writing ("r+b") creates nothing.
        with open(disk / "filler", "r+b") as f:
            proc = _traced(out, report, STEPS)
            _wait_for_step(out, 3)
            with contextlib.suppress(OSError):  # fill the disk: every later write fails with ENOSPC
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        _, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err
        assert "Traceback" not in err
        assert "the trace is incomplete (rank 0 stopped tracing at step" in err
        trace = load_training_trace(out)  # what was written whole before the disk filled
        assert trace.status == fmt.INCOMPLETE and "not finished" in trace.unfinished
        done = trace.steps.groupby("rank")["step"].max()
        assert set(done.index) == {0, 1} and (done >= 3).all() and (done < STEPS - 1).all()
    plain = untraced(tmp_path, USER, "--steps", str(STEPS))
    for r in (0, 1):  # trained to its end, bit-identical to the same script untraced
        assert checks(report)[r]["params_sha256"] == checks(plain)[r]["params_sha256"]


def test_training_goes_on_when_the_run_folder_disappears(tmp_path):
    # As root (as here), permission bits do not stop a write: removing the folder does.
    out, report = tmp_path / "gone", tmp_path / "report"
    proc = _traced(out, report, 100)  # ~2 s: the writer's next flush (every 0.25 s) comes while it trains
    _wait_for_step(out, 3)
    # One rename removes the folder at once (rmtree races the writers: a file made between its
    # listing and its rmdir fails it); the renamed copy goes when the run is over.
    out.rename(tmp_path / "removed")
    _, err = proc.communicate(timeout=240)
    shutil.rmtree(tmp_path / "removed")
    assert proc.returncode == 0, err
    stops = [l for l in err.splitlines() if "tracing stops here, training goes on" in l]
    assert 1 <= len(stops) <= 2 and "Traceback" not in err, err  # one line per rank, at most
    assert "was removed during the run" in err
    plain = untraced(tmp_path, USER, "--steps", "100")
    for r in (0, 1):  # trained to its end (it writes its report last), bit-identical to the same script untraced
        assert checks(report)[r]["params_sha256"] == checks(plain)[r]["params_sha256"]
    assert processes_mentioning(str(out)) == []
