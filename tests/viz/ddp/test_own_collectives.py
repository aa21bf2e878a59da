"""The step's collectives that are not buckets (viz/ddp/own_collectives.py), on a real
2-rank gloo job that has all three kinds: DDP's unused-parameter map
(``find_unused_parameters`` with a head the loss never uses), its buffer broadcast
(BatchNorm) and the script's own all-reduce of its loss. Checked against the rank
files' events (not the summary's fold) and printed by ``ddpscope summary``."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from ddpscope.tracer import format as fmt
from ddpscope.viz.ddp.gantt import make_timeline_figure
from ddpscope.viz.ddp.own_collectives import compute_own_collectives, own_collectives_lines
from ddpscope.viz.run_files import read_rank_file
from ddpscope.viz.trace import load_run
from tests.conftest import run_cli
from tests.tracer.capture.autotrace.test_autotrace import USER, trace_script

pytestmark = pytest.mark.ddp
STEPS = 5


def test_each_kind_outside_the_buckets_is_one_row_as_its_events_say(tmp_path):
    proc, out, _ = trace_script(tmp_path, USER, "--steps", str(STEPS), "--depth", "3", "--find-unused",
                                "--batchnorm", "--loss-allreduce", ddpscope=("--capture", "compiled"))
    assert proc.returncode == 0, proc.stderr
    trace = load_run(out)
    table = compute_own_collectives(trace).set_index("kind")
    assert sorted(table.index) == ["buffer_broadcast", "other", "unused_map"]
    warm = set(trace.steps.loc[trace.steps["warmup"].astype(bool), "step"])
    spans: dict[str, list[float]] = {k: [] for k in table.index}
    beside: dict[str, list[float]] = {k: [] for k in table.index}
    nbytes: dict[str, set] = {k: set() for k in table.index}
    for r in (0, 1):
        _, events = read_rank_file(out / fmt.rank_file(r))
        by_step: dict[tuple[str, int], list[dict]] = {}
        buckets: dict[int, list[dict]] = {}
        for e in events:
            if e.get("cat") == fmt.CAT_DDP_OWN and e["args"]["step"] not in warm:
                kind = {fmt.UNUSED_MAP: "unused_map", fmt.BUFFER_BROADCAST: "buffer_broadcast"}.get(e["name"], "other")
                by_step.setdefault((kind, e["args"]["step"]), []).append(e)
            elif e.get("cat") == fmt.CAT_ALLREDUCE and e.get("ph") == "X":
                buckets.setdefault(e["args"]["step"], []).append(e)
        for (kind, step), es in by_step.items():
            lo, hi = min(e["ts"] for e in es), max(e["ts"] + e["dur"] for e in es)
            spans[kind].append((hi - lo) / 1e3)
            nbytes[kind].add(sum(e["args"]["bytes"] for e in es))
            b = buckets.get(step, [])  # the buckets' window: first launch to last end
            first, last = (min(e["ts"] for e in b), max(e["ts"] + e["dur"] for e in b)) if b else (0, 0)
            beside[kind].append(max(0.0, min(hi, last) - max(lo, first)) / 1e3)
    for kind in table.index:
        assert table.at[kind, "ms"] == pytest.approx(float(np.median(spans[kind])), abs=0.01)
        assert table.at[kind, "beside_buckets_ms"] == pytest.approx(float(np.median(beside[kind])), abs=0.01)
        assert len(nbytes[kind]) == 1 and table.at[kind, "bytes"] == nbytes[kind].pop()
        assert table.at[kind, "steps"] == len(spans[kind])
    assert table.at["other", "per_step"] == 1 and table.at["other", "bytes"] == 4  # the loss, float32
    assert 0 < table.at["buffer_broadcast", "pct_of_step"] < 100
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0, summary.stderr
    assert "collectives outside the buckets:" in summary.stdout
    assert "other collectives (the script's own, DDP's outside its buckets): 1 a step" in summary.stdout
    # the broadcast runs before the forward, with no bucket in flight; the map after the last
    # bucket's launch, on their process group: where most of it ran beside them, the line says so
    assert table.at["buffer_broadcast", "beside_buckets_ms"] == 0
    unused = next(line for line in summary.stdout.splitlines() if "DDP's unused-parameter map" in line)
    mostly = table.at["unused_map", "beside_buckets_ms"] >= 0.5 * table.at["unused_map", "ms"]
    assert ("inside the buckets' all-reduces" in unused) == mostly, (unused, table.loc["unused_map"].to_dict())
    as_json = json.loads(run_cli("summary", str(out), "--json").stdout)
    assert {row["kind"] for row in as_json["not_buckets"]} == set(table.index)
    # on the Gantt they share the buckets' lane, drawn over them: narrower, so that the buckets
    # they ran beside (the map, queued behind them, spans most of their time) stay in sight
    fig = make_timeline_figure(trace)
    bars = {t.name: t for t in fig.data if t.type == "bar"}
    over = ["DDP's unused-parameter map", "DDP's buffer broadcast", "other collectives (not buckets)"]
    assert set(over) <= set(bars) and "bucket all-reduce" in bars
    for name in over:
        assert bars[name].width < bars["bucket all-reduce"].width / 2, name
        assert set(np.asarray(bars[name].y)) <= set(np.asarray(bars["bucket all-reduce"].y)), name  # the same lanes


@pytest.mark.parametrize("beside, said", [(3.0, True), (2.0, True), (1.99, False), (0.0, False),
                                          (float("nan"), False)])
def test_the_line_says_how_much_ran_beside_the_buckets_only_from_half_of_the_span(beside, said):
    """The rule on its own (the job above cannot choose which side of it a run falls on): a
    4 ms span with ``beside`` ms of it between the first bucket launch and the last end."""
    table = pd.DataFrame([{"kind": "unused_map", "what": "DDP's unused-parameter map", "steps": 4,
                           "per_step": 1.0, "ms": 4.0, "bytes": 296.0, "pct_of_step": 3.5,
                           "beside_buckets_ms": beside}])
    (line,) = own_collectives_lines(table)
    assert line.startswith("DDP's unused-parameter map: 1 a step, 4.00 ms (3.5 % of the step), 296 bytes")
    assert (f"; {beside:.2f} ms of it inside the buckets' all-reduces" in line) == said, line
