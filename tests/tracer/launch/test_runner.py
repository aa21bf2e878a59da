"""``ddpscope run --demo`` end to end: real torchrun jobs, failures, watchdog, bad input."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest

from ddpscope.viz.run_files import read_rank_file
from ddpscope.viz.trace import load_run
from tests.chrome_trace import check_chrome_trace
from tests.conftest import assert_refused, processes_mentioning, run_cli

pytestmark = pytest.mark.ddp


def _port_is_free(port: int) -> bool:
    """Nothing listens on the port any more (connections are refused)."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def test_run_writes_a_complete_trace_per_rank(mlp_run):
    out, proc = mlp_run
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert "step 6/6" in proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and run["world_size"] == 2 and run["backend"] == "gloo"
    assert run["model"] == "mlp" and run["bucket_cap_mb"] == 1.0 and run["steps"] == 6
    assert len(run["clock_offsets"]["start"]) == 2 and run["clock_offsets"]["end"] is not None
    for r in (0, 1):
        doc = json.loads((out / f"rank-{r}.json").read_text())
        assert check_chrome_trace(doc) == []
        assert read_rank_file(out / f"rank-{r}.json")[0]["status"] == "complete"
    trace = load_run(out)
    assert sorted(trace.steps.groupby("rank").size().to_dict().items()) == [(0, 6), (1, 6)]
    # many buckets at a 1 MiB cap, each holding parameters, on every step after warm-up
    per_step = trace.buckets[trace.buckets.step > 0].groupby(["rank", "step"]).size()
    assert per_step.min() >= 10 and per_step.nunique() == 1
    assert (trace.memory.optimizer_state_bytes == 2 * trace.memory.params_bytes + 4 * 34).all()  # AdamW: 2 moments + a float32 step, 34 tensors
    # every rank's stdout and stderr kept; no empty stack file (a rank writes one only when the watchdog asks)
    logs = sorted(p.name for p in (out / "logs").rglob("*") if p.is_file())
    assert [n for n in logs if n.startswith("stacks-")] == [] and any("stderr" in n for n in logs), logs


def test_no_cap_given_records_what_ddp_used(tmp_path):
    """No --bucket-cap-mb and none in the script: DDP's default, which is not the same as
    an explicit 25 (its first bucket is capped at 1 MiB)."""
    proc = run_cli("run", "--nproc", "2", "--demo", "gpt", "--steps", "3", "--out", str(tmp_path / "r"))
    assert proc.returncode == 0, proc.stderr
    trace = load_run(tmp_path / "r")
    run = trace.run
    assert run["bucket_cap_bytes"] == 25 * 2**20 and run["bucket_cap_default"] is True
    assert run["first_bucket_cap_bytes"] == 2**20 and run["bucket_cap_mb_requested"] is None
    assert 1 <= len(run["bucket_layout"]) <= 3
    first = trace.buckets[(trace.buckets.step == 2) & (trace.buckets.bucket == 0)]["bytes"]
    assert (first <= 2 * 2**20 + 1).all()  # the first bucket closes once past 1 MiB (lm_head.weight: 2 MiB)


@pytest.mark.parametrize("args, message", [
    (["--bucket-cap-mb", "0"], "--bucket-cap-mb must be > 0"),
    (["--bucket-cap-mb", "-3"], "--bucket-cap-mb must be > 0"),
    (["--bucket-cap-mb", "1e9"], "--bucket-cap-mb must be > 0 and <= 10240"),
    (["--bucket-cap-mb", "nan"], "--bucket-cap-mb must be > 0"),
    (["--nproc", "0"], "--nproc must be in 1..64"),
    (["--nproc", "500"], "--nproc must be in 1..64"),
    (["--demo", "resnet"], "--demo must be one of mlp, gpt"),
    (["--steps", "0"], "--steps must be"),
    (["--steps", "many"], "invalid int value"),
    (["--timeout", "-1"], "--timeout must be > 0"),
    (["--bucket-cap-mb-list", "1,x"], "--bucket-cap-mb-list must be sizes in MiB separated by commas"),
    (["--bucket-cap-mb-list", "1,0"], "--bucket-cap-mb-list must each be > 0"),
    (["--bucket-cap-mb-list", ","], "--bucket-cap-mb-list must name 1 to"),
    (["--bucket-cap-mb-list", "1,4", "--bucket-cap-mb", "2"], "give --bucket-cap-mb or --bucket-cap-mb-list, not both"),
    (["--grad-marks-every", "0"], "--grad-marks-every must be in 1..100000"),
    (["--grad-marks-every", "2.5"], "invalid int value"),
])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(tmp_path, args, message):
    assert_refused("run", ["--demo", "mlp", *args], message, tmp_path / "never")


def test_unusable_out_folder_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    proc = run_cli("run", "--demo", "mlp", "--out", str(tmp_path / "file" / "sub"), timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "not a folder" in proc.stderr
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    proc = run_cli("run", "--demo", "mlp", "--out", str(busy), timeout=60)
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    proc = run_cli("run", "--demo", "mlp", "--out", "/proc/ddpscope-cannot-exist", timeout=60)
    assert proc.returncode == 2 and "not writable" in proc.stderr


def test_failing_rank_reports_reason_keeps_finished_steps_and_leaves_nothing_behind(tmp_path):
    out = tmp_path / "fails"
    proc = run_cli("run", "--nproc", "2", "--demo", "mlp", "--steps", "8", "--bucket-cap-mb", "1", "--out", str(out),
                   env={"DDPSCOPE_TEST_FAIL": "1:3"})
    assert proc.returncode == 1
    assert "run failed: rank 1 failed: RuntimeError: injected failure on rank 1 at step 3" in proc.stderr
    assert "--- rank 1 stderr" in proc.stderr and "Traceback" in proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and run["failed_rank"] == 1 and "injected failure" in run["error"]
    trace = load_run(out)  # the partial trace is readable
    done = trace.steps[~trace.steps.incomplete]
    assert set(done[done["rank"] == 1].step) == {0, 1, 2}
    assert trace.ranks[1]["status"] == "failed"
    assert processes_mentioning(str(out)) == []


def test_a_script_that_exits_on_its_own_arguments_is_named_with_what_it_said(tmp_path):
    """A script's argparse error is a ``SystemExit(2)``, no traceback: the reason is that rank
    and the last line it wrote on stderr (was: "killed or crashed without a Python error"),
    shown also under ``-q``, which hides the script's own output."""
    script = tmp_path / "train.py"
    script.write_text("import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', required=True)\n"
                      "p.parse_args()\n")
    out = tmp_path / "bad-args"
    proc = run_cli("run", "-q", "--nproc", "2", "--out", str(out), "--", str(script), "--learning-rate", "3")
    assert proc.returncode == 1
    said = "exited with code 2; its last line on stderr: train.py: error: the following arguments are required: --lr"
    assert "run failed: rank " in proc.stderr and said in proc.stderr, proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "failed" and run["failed_rank"] in (0, 1) and said in run["error"]
    assert processes_mentioning(str(out)) == []


@pytest.mark.failures
def test_watchdog_stops_a_hung_run(tmp_path):
    out = tmp_path / "hangs"
    t0 = time.monotonic()
    proc = run_cli("run", "--nproc", "2", "--demo", "mlp", "--steps", "50", "--out", str(out), "--timeout", "25",
                   env={"DDPSCOPE_TEST_HANG": "1:2"})
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 90
    assert "watchdog" in proc.stderr and "--timeout 25" in proc.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert len(load_run(out).steps.query("rank == 0 and not incomplete")) >= 2  # finished steps kept
    assert processes_mentioning(str(out)) == []


@pytest.mark.failures
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_stopping_the_runner_stops_and_reaps_the_job(tmp_path, sig):
    import signal
    import subprocess
    import sys


    out = tmp_path / "stopped"
    proc = subprocess.Popen([sys.executable, "-m", "ddpscope.cli", "run", "--nproc", "2", "--demo", "mlp", "--steps", "500", "--out", str(out)],
                            cwd="/", text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (out / "rank-0.json").exists():
        time.sleep(0.2)
    time.sleep(1.5)  # a few steps in
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert len(load_run(out).steps.query("rank == 0 and not incomplete")) >= 1
    assert processes_mentioning(str(out)) == []


@pytest.mark.ddp
@pytest.mark.failures
def test_a_terminal_that_goes_away_does_not_end_the_job(tmp_path):
    """``ddpscope run ... | head -c 1``: the pipe closes after one byte; the job runs to
    its end all the same (its output is in its logs) and its trace is complete."""
    out = tmp_path / "piped"
    subprocess.run(f"{sys.executable} -m ddpscope.cli run --demo mlp --steps 6 --out {out} 2>&1 | head -c 1",
                   shell=True, cwd="/", timeout=240, capture_output=True)
    trace = load_run(out)
    assert trace.status == "complete" and trace.steps.groupby("rank").size().to_dict() == {0: 6, 1: 6}
    assert not processes_mentioning(str(out))
