"""Stragglers: the rank every other rank's all-reduce waited for, and by how much."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from ddpscope.viz.ddp.compare import compute_run_comparison, compute_waited_steps
from ddpscope.viz.ddp.gantt import make_timeline_figure
from ddpscope.viz.ddp.overlap import compute_step_breakdown
from ddpscope.viz.ddp.stragglers import compute_launch_spread, compute_straggler_summary, compute_wait_caused
from ddpscope.viz.trace import RunTrace, load_run
from tests.conftest import SAMPLES, run_cli


def _trace(launches: dict[int, list[list[float]]]) -> RunTrace:
    """launches[rank][step] = launch times (µs) of buckets 0.."""
    b, s = [], []
    for rank, steps in launches.items():
        for step, times in enumerate(steps):
            s.append({"rank": rank, "step": step, "warmup": False, "incomplete": False, "start_us": 0, "end_us": 1})
            for k, t in enumerate(times):
                b.append({"rank": rank, "step": step, "bucket": k, "bytes": 1, "num_params": 1, "params": ["w"],
                          "launch_us": t, "done_us": t + 5, "incomplete": False})
    return RunTrace(path=SAMPLES, run={"world_size": len(launches)}, ranks={r: {} for r in launches},
                    steps=pd.DataFrame(s), buckets=pd.DataFrame(b), grads=pd.DataFrame(), memory=pd.DataFrame())


def test_the_last_launcher_and_the_wait_it_caused():
    t = _trace({0: [[100, 200, 300], [100, 200, 300]], 1: [[130, 260, 290], [100, 200, 350]], 2: [[100, 210, 300],
                                                                                                 [110, 200, 300]]})
    spread = compute_launch_spread(t)
    assert spread["last_rank"].tolist() == [1, 1, 0, 2, 0, 1]  # ties: the first rank with the latest launch
    assert spread["spread_ms"].tolist() == pytest.approx([0.03, 0.06, 0.01, 0.01, 0.0, 0.05])
    w = compute_wait_caused(t).set_index(["rank", "step"])
    # step 0: rank 1 launched buckets 0 and 1 last: rank 0 waited max(30, 60), rank 2 max(30, 50)
    assert w.loc[(1, 0), "wait_caused_ms"] == pytest.approx(0.055)
    assert w.loc[(1, 1), "wait_caused_ms"] == pytest.approx(0.05)
    s = compute_straggler_summary(t).set_index("rank")
    assert s["wait_caused_ms"].idxmax() == 1 and s.loc[1, "last_launch_pct"] == pytest.approx(50.0)
    # its first launch 30 µs after rank 0's in step 0, with it in step 1: the median of its steps
    assert s.loc[1, "launch_delay_ms"] == pytest.approx(0.015) and s.loc[2, "launch_delay_ms"] == pytest.approx(0.005)


def test_one_rank_has_no_stragglers():
    t = _trace({0: [[100, 200]]})
    assert compute_straggler_summary(t).empty and compute_launch_spread(t).empty


@pytest.mark.ddp
def test_a_delayed_rank_is_named_and_its_delay_measured(tmp_path):
    out = tmp_path / "late"
    # 60 ms of sleep in rank 1's every forward: its launches trail by that plus how much slower its
    # compute reaches the first bucket, which varies with the machine's load
    proc = run_cli("run", "--nproc", "2", "--demo", "mlp", "--steps", "14", "--bucket-cap-mb", "1", "--out", str(out),
                   env={"DDPSCOPE_TEST_DELAY_FORWARD": "1:60"})
    assert proc.returncode == 0, proc.stderr
    summary = run_cli("summary", "--json", str(out))
    stragglers = json.loads(summary.stdout)["stragglers"]
    assert max(stragglers, key=lambda r: stragglers[r]["wait_caused_ms"]) == "1"
    assert stragglers["1"]["last_launch_pct"] > 90
    # At least the 60 ms sleep, less a quarter for how the ranks' compute drifts apart under load. No
    # fixed bound above: how much slower the late rank's compute ran rides on it, which the other xdist
    # worker's load moves (81.1 ms once in a fresh-clone CI). The bound above is causal instead: an
    # all-reduce ends on no rank before every rank launched it, so rank 0's first all-reduce of a step
    # lasted at least the late rank's delay that step, as the all-reduce's own end says.
    delay = stragglers["1"]["launch_delay_ms"]
    assert delay >= 45
    run = load_run(out)  # read once: every check below is of the same run
    b = run.buckets.query("rank == 0 and not incomplete")
    first = b.loc[b.groupby("step")["launch_us"].idxmin()]
    steps = compute_launch_spread(run)["step"].unique()
    waited = ((first["done_us"] - first["launch_us"]) / 1e3)[first["step"].isin(steps)]
    assert delay <= waited.median() + 0.1, (delay, waited.tolist())
    assert stragglers["1"]["wait_caused_ms"] >= stragglers["1"]["launch_delay_ms"]
    text = run_cli("summary", str(out)).stdout
    assert "straggler: rank 1 launched last" in text
    # said of the step's first all-reduce, against the others' first
    assert f"its first all-reduce of a step {delay:.1f} ms after the others' first" in text
    fig = make_timeline_figure(run)
    marks = next(d for d in fig.data if d.name.startswith("launched last"))
    assert len(marks.x) == len(compute_launch_spread(run))
    # the run's one number per quantity (What-if, Compare) is the late rank's, whom every step waited
    # for: pooled with rank 0's, whose exposed time holds its 60 ms wait, the median fell between them
    ranks = json.loads(summary.stdout)["ranks"]
    assert ranks["0"]["exposed_ms"] > ranks["1"]["exposed_ms"] + 30
    # Per step, the rank waited for; on a loaded machine rank 0 may be it in a step or two, so the
    # one number is the median of each step's waited-for row, not rank 1's own median
    waited_for = compute_waited_steps(run)
    assert (waited_for["rank"] == 1).mean() >= 0.75, waited_for["rank"].tolist()
    check = json.loads(run_cli("whatif", "--json", str(out)).stdout)["replay_check"]
    compared = compute_run_comparison({"late": run}).iloc[0]
    for k in ("exposed_ms", "comm_ms", "backward_ms"):
        assert check[k]["measured"] == pytest.approx(waited_for[k].median(), rel=1e-9), k
        assert compared[k] == pytest.approx(waited_for[k].median(), rel=1e-9), k
    # far from the pooled median, which rank 0's 60 ms waits pull up
    breakdown = compute_step_breakdown(run)
    pooled = breakdown.query("step in @waited_for.step")["exposed_ms"].median()
    assert check["exposed_ms"]["measured"] < pooled - 10
    # the step: its ranks' mean (they meet at every all-reduce)
    job_step = breakdown.groupby("step")["step_ms"].mean().median()
    assert check["step_ms"]["measured"] == pytest.approx(job_step) and compared["step_ms"] == pytest.approx(job_step)
