"""The reading commands (``ddpscope summary``; ``python -m ddpscope.viz`` is an alias of the command)."""

import json
import subprocess
import sys

from ddpscope.viz.ddp.buckets import compute_bucket_table
from ddpscope.viz.ddp.overlap import compute_rank_medians
from ddpscope.viz.trace import load_run
from tests.conftest import ROOT, SAMPLES


def _viz(*args):
    return subprocess.run([sys.executable, "-m", "ddpscope.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_summary_json_matches_the_metrics():
    path = SAMPLES / "gpt-2rank-cap1mb"
    proc = _viz("summary", str(path), "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    med = compute_rank_medians(load_run(path)).set_index("rank")
    assert set(data["ranks"]) == {"0", "1"}
    for r, row in data["ranks"].items():
        assert row["step_ms"] == med.loc[int(r), "step_ms"] and row["steps"] == 11
        assert 0 <= row["overlap_pct"] <= 100
    # each bucket's all-reduce, as the Timeline page's bucket table has it
    table = compute_bucket_table(load_run(path))
    assert [b["bucket"] for b in data["buckets"]] == list(table["bucket"]) and len(table) == 20
    for b, (_, row) in zip(data["buckets"], table.iterrows()):
        assert b["duration_ms"] == row["duration_ms"] and b["num_params"] == row["num_params"] and b["params"]
    text = _viz("summary", str(path)).stdout
    assert "buckets (medians over every rank and non-warm-up steps" in text
    rows = text.split("buckets (medians", 1)[1].splitlines()[2:2 + len(table)]
    assert [int(line.split()[0]) for line in rows] == list(table["bucket"])


def test_summary_table_and_bad_input(tmp_path):
    proc = _viz("summary", str(SAMPLES / "mlp-2rank-cap1mb"))
    assert proc.returncode == 0 and "overlap_pct" in proc.stdout
    (tmp_path / "rank-0.json").write_text("{not json")
    for args in (["summary", str(tmp_path)], ["summary", str(tmp_path / "missing")], ["summarise"]):
        proc = _viz(*args)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_summary_of_ring_and_zero_runs():
    proc = _viz("summary", str(SAMPLES / "ring-4rank-4mb"))
    assert proc.returncode == 0 and "ring_busbw_GBps" in proc.stdout and "4194304" in proc.stdout
    proc = _viz("summary", str(SAMPLES / "zero-gpt-2rank"), "--json")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    assert len(rows) == 8 and all(abs(r["measured/predicted"] - 1) < 0.05 for r in rows)
