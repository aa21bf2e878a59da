"""viz/perfetto.py: every rank of a run in one Chrome trace, on rank 0's clock."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpscope.tracer import format as fmt
from ddpscope.viz.perfetto import merge_run
from ddpscope.viz.trace import TraceError, load_run
from tests.chrome_trace import check_chrome_trace
from tests.conftest import ROOT, SAMPLES


@pytest.mark.parametrize("name", ["gpt-2rank-cap1mb", "ring-4rank-4mb", "zero-gpt-2rank"])
def test_merged_trace_is_well_formed_and_holds_every_rank(name):
    doc = merge_run(SAMPLES / name)
    assert check_chrome_trace(doc) == []
    per_rank = [json.loads((SAMPLES / name / f"rank-{r}.json").read_text())["traceEvents"]
                for r in range(doc["otherData"]["ddpscope_merged"]["world_size"])]
    assert len(doc["traceEvents"]) == sum(len(e) for e in per_rank)
    assert {e["pid"] for e in doc["traceEvents"]} == set(range(len(per_rank)))


def test_merged_timestamps_are_on_rank_0s_clock():
    """The merged bucket spans are exactly the aligned times the dashboard uses."""
    path = SAMPLES / "gpt-2rank-cap1mb"
    trace = load_run(path)
    merged = [e for e in merge_run(path)["traceEvents"] if e.get("cat") == fmt.CAT_ALLREDUCE]
    got = sorted((e["pid"], e["args"]["step"], e["args"]["bucket"], e["ts"], e["ts"] + e["dur"]) for e in merged)
    want = sorted(zip(trace.buckets["rank"], trace.buckets["step"], trace.buckets["bucket"],
                      trace.buckets["launch_us"], trace.buckets["done_us"]))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g[:3] == tuple(w[:3]) and g[3] == pytest.approx(w[3], abs=1e-3) and g[4] == pytest.approx(w[4], abs=1e-3)


def test_cli_writes_once_and_refuses_bad_input(tmp_path):
    out = tmp_path / "merged.json"
    run = lambda *a: subprocess.run([sys.executable, "-m", "ddpscope.cli", "perfetto", *a], cwd=ROOT, capture_output=True,
                                    text=True, timeout=60)
    proc = run(str(SAMPLES / "mlp-2rank-cap1mb"), "--out", str(out))
    assert proc.returncode == 0 and "ui.perfetto.dev" in proc.stdout
    assert check_chrome_trace(json.loads(out.read_text())) == []
    again = run(str(SAMPLES / "mlp-2rank-cap1mb"), "--out", str(out))
    assert again.returncode == 2 and "exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run(str(empty), "--out", str(tmp_path / "x.json"))
    assert proc.returncode == 2 and "no readable ddpscope run" in proc.stderr
    with pytest.raises(TraceError):
        merge_run(tmp_path / "missing")
