"""The user's training comes first: a trace that can no longer be written stops tracing
(one line per rank), and training runs to its end, unchanged."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, processes_mentioning
from tests.test_autotrace import USER, checks, untraced
from tracer import format as fmt

pytestmark = pytest.mark.ddp


def test_training_goes_on_when_the_run_folder_disappears(tmp_path):
    # As root (as here), permission bits do not stop a write: removing the folder does.
    out, report = tmp_path / "gone", tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "tracer", "run", "--nproc", "2", "--out", str(out), "--", USER,
                             "--steps", "30", "--report", str(report)], cwd="/", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if json.loads((out / fmt.live_file(0)).read_text())["steps_done"] >= 3:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    # One rename removes the folder at once (rmtree races the writers: a file made between its
    # listing and its rmdir fails it); the renamed copy goes when the run is over.
    out.rename(tmp_path / "removed")
    _, err = proc.communicate(timeout=240)
    shutil.rmtree(tmp_path / "removed")
    assert proc.returncode == 0, err
    stops = [l for l in err.splitlines() if "tracing stops here, training goes on" in l]
    assert 1 <= len(stops) <= 2 and "Traceback" not in err  # one line per rank, at most
    assert "was removed during the run" in err
    plain = untraced(tmp_path, USER, "--steps", "30")
    for r in (0, 1):  # trained to its end (it writes its report last), bit-identical to the same script untraced
        assert checks(report)[r]["params_sha256"] == checks(plain)[r]["params_sha256"]
    assert processes_mentioning(str(out)) == []
