"""Runs side by side over all their steps: medians with bootstrap intervals (viz/ddp/compare.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ddpscope.viz.ddp.compare import (
    compute_run_comparison,
    compute_waited_steps,
    difference_interval,
    differences_text,
    median_interval,
    median_step,
    within_noise,
)
from ddpscope.viz.ddp.overlap import compute_step_breakdown
from ddpscope.viz.trace import load_run
from tests.conftest import SAMPLES
from tests.viz.test_trace import _meta, _step_events, write_run


def _breakdown(per_step: list[list[float]], column: str = "step_ms") -> pd.DataFrame:
    """A breakdown table: rows (rank, step) with ``column``, one list of rank values a step."""
    return pd.DataFrame([{"rank": r, "step": s, column: v} for s, vals in enumerate(per_step)
                         for r, v in enumerate(vals)])


def test_the_median_is_over_every_step_and_rank_and_its_interval_holds_it():
    rng = np.random.default_rng(1)
    b = _breakdown([[100 + rng.normal(0, 5), 100 + rng.normal(0, 5)] for _ in range(30)])
    med, lo, hi = median_interval(b)
    assert med == pytest.approx(float(np.median(b["step_ms"])))  # the plain median of all values
    assert lo < med < hi and hi - lo < 10
    one = median_interval(_breakdown([[100.0, 101.0]]))
    assert one[0] == 100.5 and np.isnan(one[1]) and np.isnan(one[2])  # one step: no interval


def test_a_shift_larger_than_the_noise_is_a_difference_and_none_is_noise():
    rng = np.random.default_rng(2)
    a = _breakdown([[100 + rng.normal(0, 3)] * 2 for _ in range(25)])
    slower = _breakdown([[110 + rng.normal(0, 3)] * 2 for _ in range(25)])
    same = _breakdown([[100 + rng.normal(0, 3)] * 2 for _ in range(25)])
    d, lo, hi = difference_interval(a, slower)
    assert 6 < lo <= d <= hi < 14 and within_noise(lo, hi) is False
    d, lo, hi = difference_interval(a, same)
    assert within_noise(lo, hi) is True and abs(d) < 3
    assert within_noise(np.nan, 1.0) is None


def test_a_rank_missing_a_step_leaves_its_other_values_in():
    b = _breakdown([[10.0, 12.0], [11.0, 13.0], [12.0, 14.0]])
    b = b[~((b["rank"] == 1) & (b["step"] == 2))]
    med, lo, hi = median_interval(b)
    assert med == float(np.median([10, 12, 11, 13, 12])) and lo <= med <= hi


def test_samples_of_one_job_compared_with_intervals_layouts_and_noise_said():
    a, b, other = (load_run(SAMPLES / n) for n in ("gpt-2rank-cap1mb", "gpt-2rank-cap25mb", "mlp-2rank-cap1mb"))
    table = compute_run_comparison({"A": a, "B": b, "C": other})
    ba, bb = compute_step_breakdown(a), compute_step_breakdown(b)
    # a step counts once, as long as its ranks' mean, with its waited-for rank's exposed time
    assert table["step_ms"].tolist()[:2] == pytest.approx([x.groupby("step")["step_ms"].mean().median()
                                                            for x in (ba, bb)])
    assert table["exposed_ms"].tolist()[:2] == pytest.approx([x.groupby("step")["exposed_ms"].min().median()
                                                               for x in (ba, bb)])
    assert table["steps"].tolist()[:2] == [ba["step"].nunique(), bb["step"].nunique()]
    assert table["same_job"].tolist() == [True, True, False]
    assert table["layout"].iloc[0] != table["layout"].iloc[1]
    said = differences_text(table)
    assert any(s.startswith("C is not the same job as A") for s in said)
    assert any(s.startswith("B's buckets differ from A's: 20 buckets") for s in said)
    row = table.iloc[1]
    assert row["step_ms_vs_first"] == pytest.approx(row["step_ms"] - table["step_ms"].iloc[0])
    assert row["step_ms_vs_first_lo"] <= row["step_ms_vs_first"] <= row["step_ms_vs_first_hi"]


def test_a_run_at_other_settings_than_the_cap_says_which_before_its_numbers():
    """B, the same job at its own cap but with find_unused_parameters on (as Hugging Face
    Trainer has it), a setting its layout text cannot show (two such runs at one cap list the
    same buckets): said before the numbers; at the same settings nothing is said."""
    a, b = (load_run(SAMPLES / n) for n in ("gpt-2rank-cap1mb", "gpt-2rank-cap1mb"))
    assert not [s for s in differences_text(compute_run_comparison({"A": a, "B": b})) if "other settings" in s]
    b.run["find_unused_parameters"] = True
    table = compute_run_comparison({"A": a, "B": b})
    assert table["settings"].tolist() == ["", "find_unused_parameters=True"] and table["layout"].nunique() == 1
    assert "B ran other settings than A besides the bucket cap: find_unused_parameters=True" in differences_text(table)


def test_the_median_step_is_the_one_whose_slowest_rank_is_the_median():
    t = load_run(SAMPLES / "gpt-2rank-cap1mb")
    b = compute_step_breakdown(t)
    per_step = b.groupby("step")["step_ms"].max()
    k = median_step(t)
    assert k in per_step.index and not t.steps.set_index(["rank", "step"]).loc[(0, k), "warmup"]
    assert (per_step < per_step[k]).sum() == (len(per_step) - 1) // 2


def test_runs_under_other_conditions_say_so_and_runs_without_them_say_nothing():
    a, b = (load_run(SAMPLES / n) for n in ("gpt-2rank-cap1mb", "gpt-2rank-cap25mb"))
    a.run["conditions"] = {"torch_threads": 1, "cores_allowed": 2, "nice": 0}
    b.run["conditions"] = {"torch_threads": 2, "cores_allowed": 2, "nice": 0}
    table = compute_run_comparison({"A": a, "B": b})
    assert table["conditions"].tolist() == ["1 torch thread a rank, 2 cores allowed, nice 0",
                                            "2 torch threads a rank, 2 cores allowed, nice 0"]
    said = [s for s in differences_text(table) if "other conditions" in s]
    assert said == ["B ran under other conditions than A: 1 torch thread a rank, 2 cores allowed, nice 0 → "
                    "2 torch threads a rank, 2 cores allowed, nice 0; part of its difference is theirs, not the "
                    "setting's"]
    b.run["conditions"] = dict(a.run["conditions"])
    assert not [s for s in differences_text(compute_run_comparison({"A": a, "B": b})) if "conditions" in s]
    for unknown in ({"torch_threads": "x"}, None):  # a hand-edited run.json, a run predating them: nothing said
        b.run["conditions"] = unknown
        assert not [s for s in differences_text(compute_run_comparison({"A": a, "B": b})) if "conditions" in s]


def test_each_step_is_the_rank_it_waited_for(tmp_path):
    """Beside each step's bucket at [45, 75] µs, a second one: step 1, rank 0's runs 25 µs
    past its backward (to 90), rank 1's inside the first: 10 µs exposed, the step waited
    for rank 1. Step 2: both alike (15 µs), the lowest rank kept. Medians over these rows
    are a run's one number (no value between ranks)."""
    def events(rank: int, ends: dict[int, float]) -> list[dict]:
        out = _step_events(rank, 0, 0.0)
        for step, end in ends.items():
            t0 = 1000.0 * step
            out += _step_events(rank, step, t0)
            out.append({"ph": "X", "cat": "allreduce", "name": "bucket 0", "pid": rank, "tid": 101, "ts": t0 + 45.0,
                        "dur": end - 45.0, "args": {"step": step, "bucket": 0, "bytes": 8, "params": ["w"]}})
        return out

    runs = {0: (_meta(0, world=2), events(0, {1: 90.0, 2: 80.0})),
            1: (_meta(1, world=2), events(1, {1: 70.0, 2: 80.0}))}
    t = load_run(write_run(tmp_path / "r", runs))
    w = compute_waited_steps(t)
    assert w["step"].tolist() == [1, 2] and w["rank"].tolist() == [1, 0]
    b = compute_step_breakdown(t).set_index(["rank", "step"])
    assert w["exposed_ms"].tolist() == pytest.approx([b.loc[(1, 1), "exposed_ms"], b.loc[(0, 2), "exposed_ms"]])
    assert w["exposed_ms"].tolist() == pytest.approx([0.010, 0.015])  # backward ends at 65 µs
