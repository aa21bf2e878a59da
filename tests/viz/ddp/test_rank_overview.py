"""The overview of every rank (viz/ddp/rank_overview.py, and the Timeline's section above the
Gantt), on a real 8-rank DDP run in which one rank is slow (its forward sleeps 150 ms)."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from ddpscope.viz.ddp.rank_overview import (
    compute_rank_overview,
    compute_slow_ranks,
    make_rank_heatmap_figure,
    make_step_spread_figure,
    slow_rank_line,
)
from ddpscope.viz.trace import load_run
from tests.conftest import ROOT, run_cli
from tests.tracer.capture.autotrace.test_autotrace import USER, trace_script

# a real 8-rank job (~22 s): the default suite names the slow rank on 12 synthesised ranks
# (tests/tracer/test_step_summary.py) and on a real delayed rank (tests/viz/ddp/test_stragglers.py)
pytestmark = pytest.mark.breadth

# 150 ms, not 40: 8 ranks share 2 cores, and beside another suite (.ci/run's lanes) their
# scheduling noise once passed 40 ms (the slow rank late in 6 of 7 steps, not 7)
SLOW, SLOW_MS, RANKS, STEPS = 5, 150, 8, 8


@pytest.fixture(scope="module")
def eight_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eight")
    proc, out, report = trace_script(tmp / "runs", USER, "--width", "64", "--depth", "3", "--steps", str(STEPS),
                                     "--slow-rank", str(SLOW), "--slow-ms", str(SLOW_MS),
                                     ddpscope=("--nproc", str(RANKS)), name="eight")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, out, report


@pytest.mark.ddp
def test_the_slow_rank_is_found_and_ranked_first_with_its_figures(eight_ranks):
    _, out, report = eight_ranks
    trace = load_run(out)
    overview = compute_rank_overview(trace)
    assert sorted(overview["rank"].unique()) == list(range(RANKS))
    assert overview.groupby("rank").size().eq(STEPS - 1).all()  # warm-up (step 0) left out
    slow = compute_slow_ranks(overview)
    assert int(slow["rank"].iloc[0]) == SLOW and slow["late_steps_pct"].iloc[0] == 100
    # the script's own clock: how much longer rank 5's forward took than the median rank's
    own = {r: json.loads((report / f"check-rank{r}.json").read_text()) for r in range(RANKS)}
    fwd = {r: statistics.median(x["forward_ms"] for x in own[r]["own"][1:]) for r in range(RANKS)}
    lag = fwd[SLOW] - statistics.median(fwd.values())
    assert lag >= SLOW_MS * 0.9
    # launch_delay_ms counts from the step's first rank to launch, the script's lag from its median
    # rank: the slow rank's delay beyond the others' median is its forward's lag (CI once drew a
    # first rank 13 ms ahead of the median one, 8 ranks sharing 2 cores)
    beyond = slow["launch_delay_ms"].iloc[0] - slow["launch_delay_ms"].iloc[1:].median()
    assert beyond == pytest.approx(lag, abs=10.0)
    # the others' delays are scheduling noise (8 ranks share 2 cores here): well under the injected one
    assert (slow["launch_delay_ms"].iloc[1:] < SLOW_MS / 2).all()
    exposed = overview.groupby("rank")["exposed_ms"].median()
    assert exposed.idxmin() == SLOW  # the others wait for it: it waits least
    assert "slowest rank: 5" in slow_rank_line(slow)
    # the straggler line, printed beside it, says the same rank's lateness with the same number
    from ddpscope.viz.ddp.stragglers import compute_straggler_summary

    late = compute_straggler_summary(trace).set_index("rank")["launch_delay_ms"]
    assert late.loc[SLOW] == pytest.approx(slow.set_index("rank").loc[SLOW, "launch_delay_ms"], abs=1e-6)


@pytest.mark.ddp
def test_the_overview_figures_hold_every_rank_and_step(eight_ranks):
    _, out, _ = eight_ranks
    overview = compute_rank_overview(load_run(out))
    heat = make_rank_heatmap_figure(overview, "launch_delay_ms")
    z = np.asarray(heat.data[0].z)
    assert z.shape == (RANKS, STEPS - 1) and list(heat.data[0].y) == list(range(RANKS))
    assert np.nanargmax(np.nanmedian(z, axis=1)) == SLOW
    spread = make_step_spread_figure(overview, "step_ms")
    assert [t.name for t in spread.data if t.name] == ["min-max", "25-75 %", "median"]
    with pytest.raises(ValueError, match="metric must be one of"):
        make_rank_heatmap_figure(overview, "bogus")


@pytest.mark.ddp
def test_summary_and_the_timeline_name_the_slow_rank(eight_ranks, monkeypatch):
    tmp, out, _ = eight_ranks
    proc = run_cli("summary", str(out))
    assert proc.returncode == 0 and "slowest rank: 5" in proc.stdout
    data = json.loads(run_cli("summary", "--json", str(out)).stdout)
    assert data["slow_ranks"][0]["rank"] == SLOW
    monkeypatch.setenv("DDPSCOPE_RUNS_DIR", str(tmp / "runs"))
    st_config.set_option("server.address", "127.0.0.1")
    at = AppTest.from_file(str(ROOT / "app.py"), default_timeout=90).run()
    assert not at.exception and at.sidebar.selectbox(key="trace").value == "run: eight"
    assert any("Slowest rank: 5" in w.value for w in at.warning)
    heat = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert heat["data"][0]["type"] == "heatmap"
    at.radio(key="overview_metric").set_value("exposed_ms").run()
    assert not at.exception and "exposed communication" in json.dumps(json.loads(
        at.get("plotly_chart")[0].proto.spec)["layout"]["title"])
    assert at.multiselect(key="ranks").value == list(range(RANKS))  # 8 ranks: all in the Gantt
