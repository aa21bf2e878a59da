"""Hangs and crashes are named: which rank, how, where (real 2-rank gloo jobs), and the
watchdog's and the root-cause parser's logic on their own."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.tracer.launch.hangs import HangWatch, diagnose
from ddpscope.tracer.launch.torchrun import agent_exits
from ddpscope.viz.trace import load_run
from tests.conftest import processes_mentioning

AGENT_SUMMARY = """
Failures:
[1]:
  time      : 2026-11-22_15:41:02
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 15671)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 15671
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-22_15:41:02
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 15672)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 15672
"""


def test_torchruns_summary_gives_each_ranks_exit_and_its_root_cause_first():
    exits = agent_exits(AGENT_SUMMARY.splitlines())
    assert exits == {1: -9, 0: -15} and list(exits) == [1, 0]


def _live(out: Path, rank: int, **fields) -> None:
    (out / fmt.LIVE_DIR).mkdir(parents=True, exist_ok=True)
    state = {"rank": rank, "pid": 2**22 + rank, "time_unix": time.time(), "status": "running", **fields}
    (out / fmt.live_file(rank)).write_text(json.dumps(state))


def test_the_watchdog_waits_its_timeout_then_names_the_rank_behind(tmp_path):
    now = [0.0]
    watch = HangWatch(tmp_path, hang_timeout_s=10, first_step_grace_s=100, clock=lambda: now[0])
    assert watch.poll() is None  # no live file: left to the total timeout
    _live(tmp_path, 0, step=0, steps_done=0, phase="forward", activity=[0, 1])
    _live(tmp_path, 1, step=0, steps_done=0, phase="forward", activity=[0, 1])
    for t in (1, 50, 105):  # before a first step, the grace period applies
        now[0] = t
        assert watch.poll() is None
    _live(tmp_path, 0, step=4, steps_done=4, phase="waiting for the all-reduces", activity=[4, 1, 9, 1, 0, False],
          buckets_launched=[0], buckets_in_flight=[0])
    _live(tmp_path, 1, step=4, steps_done=4, phase="forward", activity=[4, 1])
    now[0] = 106
    assert watch.poll() is None  # it moved: the clock restarts
    now[0] = 115
    assert watch.poll() is None
    now[0] = 117
    hang = watch.poll()
    assert hang is not None and hang.stuck == [1]
    assert "rank 1 stopped progressing" in hang.reason and "step 4, forward" in hang.reason
    assert "rank 0: step 4, waiting for the all-reduces; bucket 0 in flight, launched by rank 0 of 2" in hang.details
    assert watch.poll() is None  # once


def test_a_rank_that_can_no_longer_write_its_trace_is_not_watched(tmp_path):
    """A rank whose tracing stopped (its trace could not be written) trains on, its live
    file standing still but saying so (``failed``, as the tracer closes it). That is no
    hang: the watchdog leaves the rank to the total timeout, and watches the ranks still
    tracing as before (found when a loaded CI made a 1000-step run on a
    filled disk outlast the 60-s default and ddpscope stopped a job that was training)."""
    now = [0.0]
    watch = HangWatch(tmp_path, hang_timeout_s=10, first_step_grace_s=0, clock=lambda: now[0])
    _live(tmp_path, 0, step=5, steps_done=5, phase="backward", activity=[5, 1])
    _live(tmp_path, 1, step=5, steps_done=5, phase="backward", activity=[5, 1])
    assert watch.poll() is None
    _live(tmp_path, 0, step=5, steps_done=5, phase="backward", activity=[5, 1], status=fmt.FAILED)
    for t in (5, 12, 30):  # rank 1 still moves: rank 0's standing file is not a hang
        now[0] = t
        _live(tmp_path, 1, step=t, steps_done=t, phase="forward", activity=[t, 1])
        assert watch.poll() is None
    _live(tmp_path, 1, step=30, steps_done=30, phase="forward", activity=[30, 1], status=fmt.FAILED)
    for t in (31, 60, 600):  # neither is watched: left to the total timeout
        now[0] = t
        assert watch.poll() is None
    # a rank still tracing that stops moving is named as before
    other = HangWatch(tmp_path / "b", hang_timeout_s=10, first_step_grace_s=0, clock=lambda: now[0])
    _live(tmp_path / "b", 0, step=5, steps_done=5, phase="backward", activity=[5, 1], status=fmt.FAILED)
    _live(tmp_path / "b", 1, step=4, steps_done=4, phase="forward", activity=[4, 1])
    now[0] = 700
    assert other.poll() is None
    now[0] = 711
    hang = other.poll()
    assert hang is not None and hang.stuck == [1]


def test_on_a_full_disk_the_watchdog_stands_down_rather_than_stop_a_training_job(tmp_path):
    """A real full disk (a small tmpfs, filled): no live file can move and no rank's message
    can reach its log there, so at the moment the job would be called hung the watchdog
    finds the folder unwritable and stands down, once, leaving the job to its total timeout.
    (The disk-fill test in test_unwritable.py runs it end to end.)"""
    from tests.tracer.capture.test_unwritable import small_disk

    now = [0.0]
    with small_disk(tmp_path / "disk", "1m") as disk:
        watch = HangWatch(disk, hang_timeout_s=10, first_step_grace_s=0, clock=lambda: now[0])
        _live(disk, 0, step=5, steps_done=5, phase="backward", activity=[5, 1])
        _live(disk, 1, step=5, steps_done=5, phase="backward", activity=[5, 1])
        assert watch.poll() is None
        with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        for t in (11, 12, 600):
            now[0] = t
            assert watch.poll() is None
        assert watch.stood_down
        # the same standing files on a disk with room: a hang, named
        again = HangWatch(disk, hang_timeout_s=10, first_step_grace_s=0, clock=lambda: now[0])
        (disk / "filler").unlink()
        assert again.poll() is None
        now[0] = 611
        assert again.poll() is not None and not again.stood_down


def test_a_rank_without_heartbeat_is_the_one_named(tmp_path):
    _live(tmp_path, 0, step=3, steps_done=3, phase="waiting for the all-reduces", activity=[3])
    _live(tmp_path, 1, step=2, steps_done=2, phase="optimizer", activity=[2], time_unix=time.time() - 30)
    pos = {r: json.loads((tmp_path / fmt.live_file(r)).read_text()) for r in (0, 1)}
    hang = diagnose(tmp_path, pos, 60)
    assert hang.stuck == [1] and "no heartbeat" in hang.reason and "no stack" in hang.reason




def _start(out: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddpscope.cli", "run", "--nproc", "2", "--demo", "mlp", "--steps", "400",
                             "--bucket-cap-mb", "1", "--out", str(out), *extra], cwd="/", stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _pid_after_steps(out: Path, rank: int, steps: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            live = json.loads((out / fmt.live_file(rank)).read_text())
            if live["steps_done"] >= steps:
                return int(live["pid"])
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"rank {rank} never reached step {steps}")


@pytest.mark.ddp
@pytest.mark.failures
def test_a_rank_stuck_in_its_forward_is_named_with_its_stack(tmp_path):
    out = tmp_path / "stuck"
    proc = _start(out, "--hang-timeout", "8", env={"DDPSCOPE_TEST_STALL_FORWARD": "1:4"})
    _, err = proc.communicate(timeout=240)
    ended = time.perf_counter_ns() / 1e3  # the trace's clock: the host's monotonic clock
    assert proc.returncode == 1, err
    assert "hang: no rank progressed" in err and "rank 1 stopped progressing" in err and "step 4, forward" in err
    assert "rank 0: step 4, waiting for the all-reduces; bucket" in err and "launched by rank 0 of 2" in err
    stacks = (out / fmt.stacks_file(1)).read_text()
    assert "forward_pre_hook" in stacks and "_run_ddp_forward" in stacks  # where it sleeps
    # named within hang-timeout + 10 s of its last recorded moment
    last = load_run(out).steps.query("rank == 1")["end_us"].max()
    assert (ended - last) / 1e6 < 8 + 10
    run = json.loads((out / "run.json").read_text())
    assert run["failure"]["hung"] and run["failure"]["rank"] == 1 and run["failed_rank"] == 1
    assert processes_mentioning(str(out)) == []


@pytest.mark.ddp
@pytest.mark.failures
def test_a_stopped_rank_is_named_and_its_missing_stack_said(tmp_path):
    out = tmp_path / "stopped"
    proc = _start(out, "--hang-timeout", "6")
    pid = _pid_after_steps(out, 1, 3)
    os.kill(pid, signal.SIGSTOP)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 1, err
    assert "rank 1 stopped running (no heartbeat" in err and "rank 1: no stack" in err
    assert processes_mentioning(str(out)) == []


@pytest.mark.ddp
@pytest.mark.failures
def test_a_killed_rank_is_the_root_cause_not_the_peer_that_lost_it(tmp_path):
    out = tmp_path / "killed"
    proc = _start(out)
    pid = _pid_after_steps(out, 1, 3)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 1, err
    line = next(l for l in err.splitlines() if "run failed" in l)
    assert "rank 1 was killed by SIGKILL" in line and "; it was at step " in line
    run = json.loads((out / "run.json").read_text())
    assert run["failed_rank"] == 1 and run["failure"]["how"] == "SIGKILL" and run["error"] in line
    assert any(c.startswith("rank 0") for c in run["failure"]["consequences"])
    assert len(load_run(out).steps.query("rank == 0 and not incomplete")) >= 3  # finished steps kept
    assert processes_mentioning(str(out)) == []
