"""The bundled samples are real, complete, small traces."""

import json

import pytest

from ddpscope.viz.ring.metrics import compute_ring_traffic
from ddpscope.viz.ring.trace import load_ring
from ddpscope.viz.run_files import run_kind
from ddpscope.viz.trace import load_run
from ddpscope.viz.zero.trace import compute_zero_comparison, load_zero
from tests.chrome_trace import check_chrome_trace
from tests.conftest import SAMPLES

NAMES = sorted(p.name for p in SAMPLES.iterdir() if run_kind(p) == "ddp")
RINGS = sorted(p.name for p in SAMPLES.iterdir() if run_kind(p) == "ring")
ZEROS = sorted(p.name for p in SAMPLES.iterdir() if run_kind(p) == "zero")


def test_there_are_samples_at_two_bucket_caps():
    caps = {json.loads((SAMPLES / n / "run.json").read_text())["bucket_cap_mb"] for n in NAMES}
    assert {1.0, 25.0} <= caps


@pytest.mark.parametrize("name", NAMES)
def test_sample_is_complete_small_and_well_formed(name):
    folder = SAMPLES / name
    assert sum(p.stat().st_size for p in folder.iterdir()) < 2 * 2**20
    t = load_run(folder)
    assert t.status == "complete" and t.world_size >= 2
    assert t.run["steps"] >= 10 and not t.steps.incomplete.any()
    for r in range(t.world_size):
        assert check_chrome_trace(json.loads((folder / f"rank-{r}.json").read_text())) == []
        assert t.ranks[r]["bucket_layouts"][-1]["buckets"] == t.run["bucket_layout"]


@pytest.mark.parametrize("name", RINGS)
def test_ring_sample_is_complete_and_well_formed(name):
    folder = SAMPLES / name
    assert sum(p.stat().st_size for p in folder.iterdir()) < 2 * 2**20
    t = load_ring(folder)
    assert t.run["status"] == "complete" and t.world_size >= 3 and len(t.main_rounds()) >= 3
    traffic = compute_ring_traffic(t)
    assert (traffic["steps"] == 2 * (t.world_size - 1)).all()
    for r in range(t.world_size):
        assert check_chrome_trace(json.loads((folder / f"rank-{r}.json").read_text())) == []


def test_there_is_a_ring_sample():
    assert RINGS


@pytest.mark.parametrize("name", ZEROS)
def test_zero_sample_is_complete_and_matches_the_model(name):
    folder = SAMPLES / name
    t = load_zero(folder)
    assert t.run["status"] == "complete" and sorted(t.stages["stage"].unique()) == [0, 1, 2, 3]
    cmp = compute_zero_comparison(t)
    assert ((cmp["measured/predicted"] - 1).abs() < 0.05).all()
    for r in range(t.world_size):
        assert check_chrome_trace(json.loads((folder / f"rank-{r}.json").read_text())) == []


def test_there_is_a_zero_sample():
    assert ZEROS


def test_the_gpt_samples_predict_each_other_and_the_advice_does_not_flip():
    """The GPT samples were recorded together (one session, one right after the other) and
    ship one calibration of this machine (samples/README.md): each predicts the other's
    measured median step within 10 %, and the advice does not flip with the trace it
    starts from: each trace's model cannot tell the other's recommendation from its own
    (their predicted steps within its noise), or both keep their setting."""
    from ddpscope.viz.ddp.overlap import compute_step_breakdown
    from ddpscope.viz.whatif.advisor import advise, gain_noise_ms
    from ddpscope.viz.whatif.simulate import predict_run, traced_cap

    a, b = load_run(SAMPLES / "gpt-2rank-cap1mb"), load_run(SAMPLES / "gpt-2rank-cap25mb")
    assert (SAMPLES / "gpt-2rank-cap1mb" / "calibration.json").read_bytes() == \
        (SAMPLES / "gpt-2rank-cap25mb" / "calibration.json").read_bytes()

    def median(t):
        return float(compute_step_breakdown(t)["step_ms"].median())

    for src, dst in ((a, b), (b, a)):
        predicted = median(predict_run(src, traced_cap(dst)))
        assert abs(predicted / median(dst) - 1) <= 0.10, (src.path.name, predicted, median(dst))
    advice = {a.path.name: advise(a), b.path.name: advise(b)}
    if not any(x.change for x in advice.values()):
        return  # both: "no change is worth it"
    for x, y in ((a, b), (b, a)):
        mine, theirs = advice[x.path.name].setting, advice[y.path.name].setting
        gap = median(predict_run(x, theirs)) - median(predict_run(x, mine))
        assert gap <= gain_noise_ms(x), (x.path.name, mine, theirs, gap)
