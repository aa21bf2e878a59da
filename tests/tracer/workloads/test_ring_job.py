"""``ddpscope ring`` end to end: a real 4-rank ring beside dist.all_reduce, its
trace, the bytes it moved, and failures, watchdog and bad input."""

from __future__ import annotations

import json
import time

import pytest

from ddpscope.viz.ring.metrics import compute_ring_rounds, compute_ring_traffic
from ddpscope.viz.ring.trace import load_ring
from ddpscope.viz.run_files import read_rank_file
from tests.chrome_trace import check_chrome_trace
from tests.conftest import assert_refused, processes_mentioning, run_cli

pytestmark = pytest.mark.ddp
MIB = 2**20


def test_ring_run_writes_a_trace_per_rank(ring_run):
    out, proc = ring_run
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    assert "round 3/3" in proc.stderr and "dist.all_reduce" in proc.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["status"] == "complete" and run["kind"] == "ring" and run["world_size"] == 4
    assert run["bytes"] == MIB and run["chunk_numel"] == [MIB // 16] * 4
    assert run["command"].startswith("ddpscope ring --nproc 4 ") and run["started_at"].endswith("+00:00")
    assert [s["calibration"] for s in run["sizes"]] == [True, True, False]
    for r in range(4):
        doc = json.loads((out / f"rank-{r}.json").read_text())
        assert check_chrome_trace(doc) == []
        assert read_rank_file(out / f"rank-{r}.json")[0]["status"] == "complete"
    trace = load_ring(out)
    # 3 sizes x (1 warm-up + 3 timed) rounds, each with 2(N-1) = 6 steps per rank and a reference
    assert trace.rounds.groupby("rank").size().tolist() == [12] * 4
    assert trace.steps.groupby(["rank", "round"]).size().eq(6).all()
    assert len(trace.refs) == 12 * 4
    rounds = compute_ring_rounds(trace)
    assert (rounds["max_abs_diff"] < 1e-4).all() and (rounds["ring_ms"] > 0).all() and (rounds["ref_ms"] > 0).all()


def test_each_rank_sends_2_n_minus_1_over_n_of_the_tensor(ring_run):
    trace = load_ring(ring_run[0])
    traffic = compute_ring_traffic(trace)
    main = traffic[traffic["size_bytes"] == MIB]
    assert len(main) == 4 * 4
    # counted from the trace's steps: 2(N-1)/N x M = 1.5 MiB sent and received by every rank
    assert (main["sent_bytes"] == 3 * MIB // 2).all() and (main["recv_bytes"] == 3 * MIB // 2).all()
    # a size that does not divide by 4: per rank within one element, in total exact
    small = traffic[traffic["size_bytes"] == 4096]
    assert (small.groupby("round")["sent_bytes"].sum() == 2 * 3 * 4096).all()


def test_a_ring_of_3_on_a_size_not_divisible_by_3(tmp_path):
    out = tmp_path / "ring3"
    proc = run_cli("ring", "--nproc", "3", "--mb", "0.25", "--repeat", "1", "--dtype", "float64",
                   "--no-calibration", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    trace = load_ring(out)
    traffic = compute_ring_traffic(trace)
    m = 2**18  # bytes: 32768 float64 elements, 10923 + 10923 + 10922 per chunk
    per_round = traffic.groupby("round")["sent_bytes"]
    assert (per_round.sum() == 2 * 2 * m).all()  # 2(N-1) x M over the ring, exactly
    assert ((traffic["sent_bytes"] - 2 * 2 * m / 3).abs() <= 2 * 8).all()  # each rank: 2(N-1)/N x M to an element
    assert sorted(trace.rounds["round"].unique()) == [0, 1]  # warm-up and one timed round, no calibration


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1"], "a ring needs two ranks: give --nproc 2 or more, or --emulate-nodes 2"),
    (["--nproc", "65"], "--nproc must be in 1..64"),
    (["--link", "1gbit"], "--link goes with --emulate-nodes N"),
    (["--nnodes", "2"], "--rdzv-endpoint HOST:PORT is required with --nnodes > 1"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank must be in 0..1"),
    (["--emulate-nodes", "2", "--nnodes", "2", "--rdzv-endpoint", "h:1"], "--emulate-nodes runs every node here"),
    (["--mb", "0"], "--mb must be > 0"),
    (["--mb", "-1"], "--mb must be > 0"),
    (["--mb", "1e6"], "--mb must be > 0 and <= 4096"),
    (["--mb", "nan"], "--mb must be > 0"),
    (["--mb", "4000", "--nproc", "64"], "more than this machine's"),
    (["--repeat", "0"], "--repeat must be in 1..1000"),
    (["--dtype", "complex64"], "--dtype must be one of"),
    (["--mb", "big"], "invalid float value"),
    (["--timeout", "0"], "--timeout must be > 0"),
])
def test_bad_arguments_exit_2_with_one_line_and_write_nothing(tmp_path, args, message):
    assert_refused("ring", args, message, tmp_path / "never")


def test_non_empty_out_folder_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    proc = run_cli("ring", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_failing_rank_keeps_the_finished_rounds(tmp_path):
    out = tmp_path / "fails"
    proc = run_cli("ring", "--nproc", "2", "--mb", "0.5", "--repeat", "4", "--out", str(out),
                   env={"DDPSCOPE_TEST_FAIL": "1:2"})
    assert proc.returncode == 1
    assert "rank 1 failed: RuntimeError: injected failure on rank 1 at round 2" in proc.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    trace = load_ring(out)  # what finished is readable
    assert trace.ranks[1]["status"] == "failed"
    assert trace.main_rounds() == [11, 12]  # 2 calibration sizes x (warm-up + 4), warm-up, then timed 0 and 1
    assert processes_mentioning(str(out)) == []


@pytest.mark.failures
def test_watchdog_stops_a_hung_ring(tmp_path):
    out = tmp_path / "hangs"
    t0 = time.monotonic()
    proc = run_cli("ring", "--nproc", "2", "--mb", "0.25", "--repeat", "5", "--out", str(out), "--timeout", "20",
                   env={"DDPSCOPE_TEST_HANG": "0:1"})
    assert proc.returncode == 1
    assert time.monotonic() - t0 < 80
    assert "watchdog" in proc.stderr and "--timeout 20" in proc.stderr
    assert json.loads((out / "run.json").read_text())["status"] == "failed"
    assert len(load_ring(out).main_rounds()) == 1
    assert processes_mentioning(str(out)) == []
