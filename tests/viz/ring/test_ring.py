"""viz ring modules: trace model, chunk-state replay, animation, step figure, cost model.

Figures and states are built from the bundled ring sample, a real 4-rank trace made by
``ddpscope ring``; the chunk states it replays are checked against the ring
algorithm's closed form (``expected_chunk_states``), which is derived independently."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest

from ddpscope.tracer.workloads.ring import ring_schedule
from ddpscope.viz.ring.animation import FULL, OWN, make_ring_animation_figure, make_ring_step_figure
from ddpscope.viz.ring.cost import RingCostModel, compute_ring_whatif, fit_ring_cost, make_ring_whatif_figure
from ddpscope.viz.ring.metrics import (
    compute_ring_rounds,
    compute_ring_step_times,
    compute_ring_summary,
    default_round,
    expected_chunk_states,
    replay_chunk_states,
    ring_factor,
    step_durations_ms,
)
from ddpscope.viz.ring.trace import RingTrace, load_ring
from ddpscope.viz.trace import TraceError, load_run
from tests.conftest import SAMPLES

RING = SAMPLES / "ring-4rank-4mb"


@pytest.fixture(scope="module")
def ring():
    return load_ring(RING)


def _schedule_frame(n: int) -> pd.DataFrame:
    return pd.DataFrame([{"rank": r, **vars(s)} for r in range(n) for s in ring_schedule(r, n)])


@pytest.mark.parametrize("n", [2, 3, 4, 5, 8, 64])
def test_closed_form_states_have_the_ring_invariants(n):
    s = expected_chunk_states(n)
    assert s.shape == (2 * n - 1, n, n)
    assert (s[0] == 1).all()  # everyone starts with its own data only
    after_rs = s[n - 1]
    for r in range(n):  # after reduce-scatter each rank holds exactly one chunk, (r+1) mod N, fully reduced
        assert list(np.flatnonzero(after_rs[r] == n)) == [(r + 1) % n]
    assert (s[-1] == n).all()  # after all-gather every chunk is reduced everywhere
    assert (np.diff(s, axis=0) >= 0).all()


@pytest.mark.parametrize("n", [2, 3, 4, 7, 16, 64])
def test_replaying_the_schedule_gives_the_closed_form(n):
    assert (replay_chunk_states(_schedule_frame(n), n) == expected_chunk_states(n)).all()


def test_replaying_the_real_trace_gives_the_algorithm(ring):
    n = ring.world_size
    for rnd in sorted(ring.steps["round"].unique()):
        st = compute_ring_step_times(ring, int(rnd))
        assert (replay_chunk_states(st, n) == expected_chunk_states(n)).all(), rnd


def test_replay_refuses_a_trace_that_double_counts_or_misses_a_step():
    n = 4
    bad = _schedule_frame(n)
    bad.loc[(bad["rank"] == 2) & (bad["step"] == 1), "recv_from"] = 2  # "receives" its own data
    with pytest.raises(ValueError, match="twice"):
        replay_chunk_states(bad, n)
    with pytest.raises(ValueError, match="step 3 is not recorded"):
        replay_chunk_states(_schedule_frame(n).query("not (step == 3 and rank == 0)"), n)


def test_animation_has_a_frame_per_step_plus_the_start(ring):
    n = ring.world_size
    rnd = default_round(ring)
    assert rnd in ring.main_rounds()
    fig = make_ring_animation_figure(ring, rnd)
    assert len(fig.frames) == 2 * (n - 1) + 1
    assert len(fig.layout.sliders[0].steps) == len(fig.frames)
    assert [s.label for s in fig.layout.sliders[0].steps] == ["start", "RS 1", "RS 2", "RS 3", "AG 1", "AG 2", "AG 3"]
    arrows = [sum(1 for m in (f.data[1].marker.symbol or []) if m == "arrow") for f in fig.frames]
    assert arrows == [0] + [n] * (2 * (n - 1))  # every rank sends one chunk per step
    colors = [np.array(f.data[0].marker.color).reshape(n, n) for f in fig.frames]
    assert (colors[0] == OWN).all()
    assert ((colors[n - 1] == FULL).sum(axis=1) == 1).all()  # after reduce-scatter: one reduced chunk per rank
    assert (colors[-1] == FULL).all()
    # the chunk labels on the arrows are the chunks the trace says were sent
    st = compute_ring_step_times(ring, rnd)
    for k in range(1, len(fig.frames)):
        sent = sorted(f"c{c}" for c in st[st["step"] == k - 1]["send_chunk"])
        assert sorted(fig.frames[k].data[2].text) == sent


def test_frame_durations_are_proportional_to_measured_step_times(ring):
    rnd = default_round(ring)
    fig = make_ring_animation_figure(ring, rnd)
    step_ms = step_durations_ms(compute_ring_step_times(ring, rnd))
    frame_ms = np.array(fig.layout.meta["frame_ms"][1:])
    assert np.allclose(frame_ms / frame_ms.sum(), step_ms / step_ms.sum())
    play = fig.layout.updatemenus[0].buttons[0].args
    assert list(play[0]) == [f.name for f in fig.frames]
    assert [f["duration"] for f in play[1]["frame"]] == fig.layout.meta["frame_ms"]


def test_step_figure_shows_each_rank_and_step(ring):
    st = compute_ring_step_times(ring, default_round(ring))
    fig = make_ring_step_figure(st)
    assert len(fig.data) == ring.world_size
    for tr in fig.data:
        rank = int(tr.name.split()[-1])
        assert list(tr.y) == pytest.approx(list(st[st["rank"] == rank]["dur_ms"]))
        assert len(tr.x) == 2 * (ring.world_size - 1)


def test_summary_bandwidths_follow_nccl_tests(ring):
    s = compute_ring_summary(ring)
    assert list(s["bytes"]) == [4096, 2**18, 2**22] and (s["rounds"] == 5).all()
    assert np.allclose(s["ring_busbw_GBps"], s["ring_algbw_GBps"] * 2 * 3 / 4)
    assert np.allclose(s["ring_algbw_GBps"], s["bytes"] / (s["ring_ms"] * 1e-3) / 1e9)
    r = compute_ring_rounds(ring)
    assert (r["ring_ms"] > 0).all() and (r["ref_ms"] > 0).all()


def _synthetic(n: int, alpha_us: float, gbps: float, sizes=(4096, 2**16, 2**20)) -> RingTrace:
    model = RingCostModel(alpha_us=alpha_us, bandwidth_GBps=gbps)
    rounds = []
    for i, m in enumerate(sizes):
        t = float(model.time_us(n, m))
        rounds += [{"rank": r, "round": i, "repeat": 0, "bytes": m, "calibration": False, "warmup": False,
                    "start_us": 0.0, "end_us": t, "max_abs_diff": 0.0} for r in range(n)]
    rounds = pd.DataFrame(rounds)
    return RingTrace(path=RING, run={"world_size": n, "bytes": sizes[-1]}, ranks={}, rounds=rounds,
                     steps=pd.DataFrame(), refs=rounds[["rank", "round", "start_us", "end_us"]])


def test_cost_model_fit_recovers_latency_and_bandwidth():
    m = fit_ring_cost(_synthetic(4, alpha_us=50.0, gbps=2.5))
    assert m.latency_fitted and m.sizes == 3
    assert m.alpha_us == pytest.approx(50.0, rel=1e-6) and m.bandwidth_GBps == pytest.approx(2.5, rel=1e-6)
    one = fit_ring_cost(_synthetic(4, alpha_us=0.0, gbps=1.0, sizes=(2**20,)))
    assert not one.latency_fitted and one.bandwidth_GBps == pytest.approx(1.0)


def test_cost_model_fits_the_real_ring(ring):
    m = fit_ring_cost(ring)
    assert m.sizes == 3 and m.bandwidth_GBps > 0 and m.alpha_us >= 0
    measured = compute_ring_summary(ring).set_index("bytes")["ring_ms"]
    for size, ms in measured.items():  # the fit follows its own data (CPU timings are noisy)
        assert 0.5 < float(m.time_us(ring.world_size, size)) / 1e3 / ms < 2.0


def test_whatif_volume_approaches_2m_and_time_follows_the_formula():
    m = RingCostModel(alpha_us=10.0, bandwidth_GBps=5.0)
    w = compute_ring_whatif(m, 2**26, n_max=64)
    assert list(w["n"]) == list(range(2, 65))
    assert np.allclose(w["volume_over_M"], [ring_factor(n) for n in range(2, 65)])
    assert w["volume_over_M"].iloc[0] == 1.0 and w["volume_over_M"].iloc[-1] == pytest.approx(2 * 63 / 64)
    assert w["volume_over_M"].is_monotonic_increasing and (w["volume_over_M"] < 2).all()
    n = w["n"].to_numpy()
    assert np.allclose(w["total_ms"], (2 * (n - 1) * 10.0 + 2 * (n - 1) / n * 2**26 / 5e3) / 1e3)
    assert np.allclose(w["latency_ms"] + w["bandwidth_ms"], w["total_ms"])
    with pytest.raises(ValueError, match="bandwidth"):
        RingCostModel(alpha_us=1.0, bandwidth_GBps=0.0)
    with pytest.raises(ValueError, match="n_max"):
        compute_ring_whatif(m, 2**20, n_max=1)


def test_whatif_figure_shows_prediction_measurement_and_limit():
    m = RingCostModel(alpha_us=10.0, bandwidth_GBps=5.0)
    w = compute_ring_whatif(m, 2**20)
    fig = make_ring_whatif_figure(w, 2**20, measured=[(4, 1.5)])
    names = [t.name for t in fig.data]
    assert "measured (median)" in names and "2M (limit)" in names
    limit = fig.data[names.index("2M (limit)")]
    assert list(limit.y) == [2.0, 2.0]  # MiB: 2 x 1 MiB
    sent = fig.data[names.index("sent per rank (MiB)")]
    assert list(sent.y) == pytest.approx(list(w["volume_bytes"] / 2**20))


def test_ring_and_ddp_folders_are_told_apart(ring):
    with pytest.raises(TraceError, match="ring all-reduce run"):
        load_run(RING)
    with pytest.raises(TraceError, match="DDP training run"):
        load_ring(SAMPLES / "mlp-2rank-cap1mb")


def test_bad_ring_folders_give_one_line_errors(tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(RING, bad)
    (bad / "rank-2.json").write_bytes((bad / "rank-2.json").read_bytes()[:5000])
    with pytest.raises(TraceError, match="not valid JSON") as e:
        load_ring(bad)
    assert "\n" not in str(e.value)
    (bad / "rank-2.json").unlink()
    with pytest.raises(TraceError, match="rank 2 of 4 are missing"):
        load_ring(bad)
    shutil.rmtree(bad)
    shutil.copytree(RING, bad)
    run = json.loads((bad / "run.json").read_text())
    run.pop("bytes")
    (bad / "run.json").write_text(json.dumps(run))
    with pytest.raises(TraceError, match="no tensor size"):
        load_ring(bad)


def test_a_round_missing_on_one_rank_is_left_out(tmp_path):
    """A run that died mid-round: rank 3 never wrote the last round; the others did."""
    bad = tmp_path / "partial"
    shutil.copytree(RING, bad)
    last = max(load_ring(RING).main_rounds())
    doc = json.loads((bad / "rank-3.json").read_text())
    doc["traceEvents"] = [e for e in doc["traceEvents"] if (e.get("args") or {}).get("round") != last]
    (bad / "rank-3.json").write_text(json.dumps(doc))
    ring = load_ring(bad)
    assert last not in ring.main_rounds() and last not in ring.complete_rounds()
    assert default_round(ring) in ring.main_rounds()
    for rnd in ring.main_rounds():
        make_ring_animation_figure(ring, rnd)  # every offered round animates
