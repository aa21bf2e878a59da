"""What-if: DDP's layout for another cap, the simulator on traces with known answers,
replay of a real run, the sweep, the projection, calibrate and whatif on the CLI."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from ddpscope.viz.ddp.compare import compute_waited_steps
from ddpscope.viz.ddp.overlap import compute_step_breakdown
from ddpscope.viz.trace import RunTrace, TraceError, load_run
from ddpscope.viz.whatif.advisor import step_noise_ms
from ddpscope.viz.whatif.cost import AllReduceCost, Calibration, fit_line, read_calibration
from ddpscope.viz.whatif.layout import assign_buckets, assign_buckets_python, bucket_limits, cap_limits
from ddpscope.viz.whatif.model import UNFITTED_LATENCY, WhatIfModel, check_predictable, fit_model
from ddpscope.viz.whatif.projection import LINK_PRESETS, Link, project_model, ring_cost
from ddpscope.viz.whatif.report import regime
from ddpscope.viz.whatif.simulate import predict_layout, predict_run, traced_cap
from ddpscope.viz.whatif.sweep import compute_cap_sweep, recommend_cap
from tests.conftest import ROOT, SAMPLES, run_cli

MIB = 2**20


# -- the layout DDP builds -------------------------------------------------------------------

@pytest.mark.ddp
def test_predicted_layout_is_the_one_ddp_rebuilt(tmp_path):
    """Real DDP (gloo, two ranks) at several caps, a model with float32 and float64
    parameters: the layout predicted from the gradients' ready order equals DDP's own
    rebuilt layout (its runtime logging), bucket by bucket, sizes included; per-bucket
    limits (``bucket_cap_mb_list``) too."""
    caps = ["default", "0.25", "1", "4", "25", "0.25/1/4", "4/0.5"]
    from ddpscope.tracer.launch.torchrun import free_port

    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--log-dir", str(tmp_path / "torchrun"), "--master-port", str(free_port()),
                           str(ROOT / "tests/workers/layout_check.py"),
                           ",".join(caps)], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["cap"] for r in results] == caps
    seen_layouts = set()
    for r in results:
        real = [[int(i) for i in b.split()] for b in r["rebuilt_indices"].split(",")] if isinstance(
            r["rebuilt_indices"], str) else r["rebuilt_indices"]
        sizes = [int(s) for s in str(r["rebuilt_sizes"]).replace(",", " ").split()]
        cap = None if r["cap"] == "default" else tuple(map(float, r["cap"].split("/"))) if "/" in r["cap"] \
            else float(r["cap"])
        predicted = assign_buckets(r["param_bytes"], r["param_dtypes"], r["order"], bucket_limits(cap))
        assert predicted == real, r["cap"]
        assert [sum(r["param_bytes"][i] for i in b) for b in predicted] == sizes
        # the port without torch agrees up to the order of the buckets left open at the end
        port = assign_buckets_python(r["param_bytes"], r["param_dtypes"], r["order"], bucket_limits(cap))
        assert sorted(map(tuple, port)) == sorted(map(tuple, predicted))
        assert len({r["param_dtypes"][i] for b in predicted for i in b[:1]}) == 2  # per-dtype buckets
        seen_layouts.add(len(predicted))
    assert len(seen_layouts) >= 4  # the caps really made different layouts


def test_ddps_function_and_the_port_agree_on_random_models():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 40))
        sizes = [int(x) * 4 for x in rng.integers(1, 2**19, n)]
        dtypes = ["float32"] * n
        order = [int(i) for i in rng.permutation(n)]
        limits = [int(rng.integers(1, 4 * MIB))] * 2
        assert assign_buckets(sizes, dtypes, order, limits) == assign_buckets_python(sizes, dtypes, order, limits)


def test_cap_limits_follow_ddp():
    assert cap_limits(None) == (MIB, 25 * MIB)  # the default keeps a 1 MiB first bucket
    assert cap_limits(4) == (4 * MIB, 4 * MIB)  # an explicit cap is every bucket's cap
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        cap_limits(0)


def test_a_bad_ready_order_is_refused():
    with pytest.raises(ValueError, match="every parameter once"):
        assign_buckets([4, 4], ["float32"] * 2, [0, 0], [8, 8])


# -- the simulator on traces with known answers ----------------------------------------------

def synthetic(ready_ms=(10, 20, 30, 40), bucket_of=None, comm_ms=5.0, steps=3, finalize_ms=1.0,
              skew_ms=0.0) -> RunTrace:
    """Two ranks; four 1 MiB float32 parameters ready at ``ready_ms`` after backward start
    (backward ends at the last); traced buckets ``bucket_of`` (param -> bucket; default one
    per parameter), each all-reduce ``comm_ms`` from its last gradient; step = 10 ms head,
    backward, wait, ``finalize_ms``, 5 ms tail; rank 1 ``skew_ms`` behind rank 0. Step 0
    is DDP's warm-up."""
    n = len(ready_ms)
    bucket_of = bucket_of or list(range(n))
    names = [f"layers.{i}.weight" for i in range(n)]
    layout = [[p for p in range(n) if bucket_of[p] == b] for b in sorted(set(bucket_of))]
    rows = {k: [] for k in ("steps", "passes", "buckets", "grads")}
    for rank in (0, 1):
        for step in range(steps + 1):
            t0 = 1e6 * step + skew_ms * 1e3 * rank
            b0 = t0 + 10e3
            ready = [b0 + r * 1e3 for r in ready_ms]
            b1 = max(ready)
            done = [max(ready[p] for p in b) + comm_ms * 1e3 for b in layout]
            sync_end = max(b1, max(done)) + finalize_ms * 1e3
            rows["steps"].append(dict(rank=rank, step=step, warmup=step == 0, incomplete=False, start_us=t0,
                                      end_us=sync_end + 5e3, micro_batches=1, forward_us=5e3,
                                      backward_us=b1 - b0, forward_start_us=t0 + 2e3, forward_end_us=t0 + 7e3,
                                      backward_start_us=b0, backward_end_us=b1, sync_start_us=b1,
                                      sync_end_us=sync_end, optimizer_start_us=sync_end + 1e3,
                                      optimizer_end_us=sync_end + 4e3))
            rows["passes"].append(dict(rank=rank, step=step, micro=0, sync=True, forward_start_us=t0 + 2e3,
                                       forward_end_us=t0 + 7e3, backward_start_us=b0, backward_end_us=b1,
                                       sync_start_us=b1, sync_end_us=sync_end))
            for j, b in enumerate(layout):
                rows["buckets"].append(dict(rank=rank, step=step, bucket=j, bytes=MIB * len(b), num_params=len(b),
                                            params=[names[p] for p in b], launch_us=max(ready[p] for p in b),
                                            done_us=done[j], incomplete=False))
            for p in range(n):
                rows["grads"].append(dict(rank=rank, step=step, micro=0, param=p, name=names[p], ready_us=ready[p]))
    run = {"kind": "ddp", "world_size": 2, "backend": "gloo", "param_names": names, "param_bytes": [MIB] * n,
           "param_dtypes": ["float32"] * n, "bucket_cap_mb": 1.0, "bucket_layout": layout}
    frames = {k: pd.DataFrame(v) for k, v in rows.items()}
    return RunTrace(path=Path("/synthetic"), run=run, ranks={0: {}, 1: {}}, steps=frames["steps"],
                    buckets=frames["buckets"], grads=frames["grads"], memory=pd.DataFrame(), passes=frames["passes"])


def model(latency_us=0.0, us_per_byte=1e-12, **kw) -> WhatIfModel:
    return WhatIfModel(cost=AllReduceCost(latency_us=latency_us, us_per_byte=us_per_byte), **kw)


def medians(t: RunTrace) -> pd.Series:
    return compute_step_breakdown(t)[["step_ms", "backward_ms", "comm_ms", "exposed_ms", "overlap_pct"]].median()


def test_no_communication_step_is_compute():
    t = synthetic()
    for cap in (0.5, 1, 4, 100):
        m = medians(predict_run(t, cap, model()))
        # head 10 + backward 40 + finalize 1 + tail 5: the measured 5 ms of exposed all-reduce is gone
        assert m["exposed_ms"] == pytest.approx(0, abs=1e-3)
        assert m["step_ms"] == pytest.approx(10 + 40 + 1 + 5, abs=1e-3)
        assert m["backward_ms"] == pytest.approx(40, abs=1e-3)


def test_one_bucket_puts_all_communication_after_backward():
    t = synthetic()
    pred = predict_run(t, 100, model(us_per_byte=2e-3))  # 4 MiB at 2 ns/byte: 8.39 ms
    assert pred.run["bucket_layout"] == [[0, 1, 2, 3]]  # in ready order
    m = medians(pred)
    assert m["overlap_pct"] == pytest.approx(0, abs=1e-6)
    assert m["exposed_ms"] == pytest.approx(4 * MIB * 2e-3 / 1e3, rel=1e-6)
    assert m["step_ms"] == pytest.approx(10 + 40 + 4 * MIB * 2e-3 / 1e3 + 1 + 5, rel=1e-6)


@pytest.mark.parametrize("lanes, exposed_ms", [(1, 4 * 3.0), (2, 2 * 3.0)])
def test_infinite_bandwidth_leaves_latencies_queued_in_bucket_order(lanes, exposed_ms):
    """Every gradient ready at the end of backward: four 3 ms all-reduces queue behind
    each other, ``lanes`` at a time."""
    t = synthetic(ready_ms=(40, 40, 40, 40))
    pred = predict_run(t, 1, model(latency_us=3e3, lanes=lanes))
    assert medians(pred)["exposed_ms"] == pytest.approx(exposed_ms, abs=1e-3)
    b = pred.buckets[(pred.buckets["rank"] == 0) & (pred.buckets["step"] == 1)]
    assert (np.diff(b["done_us"].to_numpy()) >= -1e-6).all()  # done in bucket order


def test_all_reduces_across_nodes_share_the_link():
    """Four 3 ms all-reduces at the end of backward, two lanes: on one machine they run two
    at a time (6 ms exposed); across nodes the two in flight split the link, so the four
    take their sum, 12 ms. A run of emulated nodes (or nnodes > 1) is fitted that way."""
    t = synthetic(ready_ms=(40, 40, 40, 40))
    pred = predict_run(t, 1, model(latency_us=3e3, lanes=2, shared_link=True))
    assert medians(pred)["exposed_ms"] == pytest.approx(12.0, abs=1e-3)
    assert "one machine (loopback)" in regime(t)
    t.run["emulation"] = {"nodes": 2, "link": "1gbit"}
    assert fit_model(t).shared_link and not fit_model(synthetic()).shared_link
    assert "2 emulated nodes, each over a 1gbit link" in regime(t) and "share the CPU cores" in regime(t)


def test_all_reduces_beside_backward_take_compute():
    """Steal: each all-reduce beside compute costs backward 2 ms (+ 1 ms per MiB). Traced
    as one bucket after backward (nothing to remove); predicted at 1 MiB, the three
    all-reduces that run while backward computes make it 9 ms longer (the fourth starts
    when backward ends)."""
    t = synthetic(bucket_of=[0, 0, 0, 0])
    m = model(latency_us=4e3, steal_us_per_allreduce=2e3, steal_us_per_mib=1e3)
    pred = predict_run(t, 1, m)
    assert medians(pred)["backward_ms"] == pytest.approx(40 + 3 * 3.0, abs=1e-3)


def test_an_all_reduce_waits_for_the_last_rank_to_launch_it():
    """Rank 1 runs 2 ms behind: every all-reduce ends at one time on both ranks, 2 ms
    after rank 0 launched it, so rank 0 sees 2 ms more of it exposed."""
    pred = predict_run(synthetic(skew_ms=2.0), 1, model(latency_us=3e3))
    b = pred.buckets[pred.buckets["step"] == 1].pivot(index="bucket", columns="rank", values="done_us")
    assert (b[0] == b[1]).all()
    per_rank = compute_step_breakdown(pred).groupby("rank")["exposed_ms"].median()
    assert per_rank[0] == pytest.approx(3.0 + 2.0, abs=1e-3) and per_rank[1] == pytest.approx(3.0, abs=1e-3)
    # each step waited for rank 1: the sweep's exposed is its 3 ms, not 4 (the median of both ranks' pooled)
    assert (compute_waited_steps(pred)["rank"] == 1).all()
    sweep = compute_cap_sweep(synthetic(skew_ms=2.0), [1.0], model(latency_us=3e3))
    assert sweep.set_index("bucket_cap_mb").loc[1.0, "exposed_ms"] == pytest.approx(3.0, abs=1e-3)


def test_a_prediction_is_drawn_by_every_figure_like_a_trace():
    from ddpscope.viz.ddp.buckets import compute_bucket_table
    from ddpscope.viz.ddp.gantt import make_timeline_figure

    pred = predict_run(synthetic(), 2, model(latency_us=1e3))
    assert pred.status == "predicted" and pred.run["bucket_cap_mb"] == 2.0
    assert len(compute_bucket_table(pred)) == 2
    fig = make_timeline_figure(pred, steps=[1])
    assert {"bucket all-reduce"} <= {t.name for t in fig.data}


def test_sweep_recommends_the_fastest_cap_and_keeps_the_traced_one_on_a_tie():
    t = synthetic(bucket_of=[0, 0, 0, 0])
    t.run["bucket_cap_mb"] = 100.0  # traced as one bucket
    sweep = compute_cap_sweep(t, [0.5, 1, 2, 4], model(latency_us=1e3, us_per_byte=2e-3))
    assert sweep["traced"].sum() == 1 and set(sweep["bucket_cap_mb"]) == {0.5, 1, 2, 4, 100}
    best = recommend_cap(sweep)
    assert best["bucket_cap_mb"] == sweep.loc[sweep["step_ms"].idxmin(), "bucket_cap_mb"] < 4
    traced = sweep.loc[sweep["traced"], "step_ms"].iloc[0]
    assert best["gain_ms"] == pytest.approx(traced - sweep["step_ms"].min()) and best["gain_ms"] > 1
    flat = compute_cap_sweep(t, [1, 4], model())  # no communication: every cap ties
    assert recommend_cap(flat)["gain_ms"] == 0 and recommend_cap(flat)["bucket_cap_mb"] == 100.0  # the traced


# -- real runs ----------------------------------------------------------------------------------

@pytest.mark.ddp
def test_replay_of_the_traced_cap_reproduces_a_real_run(mlp_run):
    """The traced cap replayed on a real 2-rank run: same layout as DDP's; buckets launched
    and done when they were, to within the measured flight times' own step-to-step spread
    (their interquartile range; 2-3 ms at least). One cost per size cannot follow a
    machine that varies more than that, and a gradient's ready time gets back the compute
    the *simulated* all-reduces take, so it moves with them. Step time within 10 %, or
    within this run's own step noise where that is wider: the half-width of its median's
    95 % interval (``step_noise_ms``, what the what-if calls within the noise). A 6-step
    run on a loaded machine knows its own median no better than that (CI drew one whose
    steps ran 110-274 ms: noise 41 ms, a replay 16 ms (10.1 %) off)."""
    t = load_run(mlp_run[0])
    pred = predict_run(t, traced_cap(t))
    assert pred.run["bucket_layout"] == t.run["bucket_layout"]
    both = t.buckets.merge(pred.buckets, on=["rank", "step", "bucket"], suffixes=("", "_pred"))
    assert len(both) == len(pred.buckets) > 0
    flight = both["done_us"] - both["launch_us"]
    spread = float(flight.quantile(0.75) - flight.quantile(0.25))
    assert (both["launch_us_pred"] - both["launch_us"]).abs().median() <= max(2e3, spread)
    assert (both["done_us_pred"] - both["done_us"]).abs().median() <= max(3e3, spread)
    measured = medians(t)["step_ms"]
    assert abs(medians(pred)["step_ms"] - measured) <= max(0.10 * measured, step_noise_ms(t))


@pytest.mark.ddp
@pytest.mark.breadth  # a calibration sweep (~13 s); the calibration's reading stays in the default suite
def test_calibrate_stores_a_sweep_with_the_run_and_whatif_uses_it(mlp_run, tmp_path):
    run = tmp_path / "mlp"
    shutil.copytree(mlp_run[0], run)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    proc = run_cli("calibrate", str(run), "--max-mb", "1")
    assert proc.returncode == 0, proc.stderr
    cal = read_calibration(run)
    assert cal.sizes == (4096.0, 16384.0, 65536.0, 262144.0, 1048576.0) and all(u > 0 for u in cal.us)
    assert cal.world_size == 2 and cal.backend == "gloo" and cal.steal() is not None
    assert [c["ranks"] for c in cal.meta["contention"]["sizes"]] == [2, 2]  # every rank's repeats, not rank 0's
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name in before} == before
    proc = run_cli("whatif", str(run), "--caps", "1,64", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [c["bucket_cap_mb"] for c in out["caps"]] == [1.0, 64.0] and out["caps"][0]["traced"]
    assert any("calibration" in n for n in out["model_notes"])
    rec = out["recommended"]  # a uniform cap among those asked for, or a list the advisor found
    assert rec["bucket_cap_mb"] in (1.0, 64.0) if "bucket_cap_mb" in rec else \
        all(c > 0 for c in rec["bucket_cap_mb_list"])


# -- bad input ---------------------------------------------------------------------------------

def test_whatif_refuses_what_it_cannot_predict(tmp_path):
    for path, message in [(SAMPLES / "ring-4rank-4mb", "ring run"), (SAMPLES / "zero-gpt-2rank", "zero run"),
                          (tmp_path / "none", "not a folder")]:
        proc = run_cli("whatif", str(path))
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, \
            proc.stderr
    for caps in ("0", "-1,4", "x", "1e9"):
        proc = run_cli("whatif", str(SAMPLES / "gpt-2rank-cap1mb"), "--caps", caps)
        assert proc.returncode == 2 and "--caps" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_a_trace_with_no_step_after_the_rebuild_is_refused():
    t = synthetic(steps=0)
    with pytest.raises(TraceError, match="no finished step after DDP's bucket rebuild"):
        check_predictable(t)
    with pytest.raises(ValueError, match="> 0"):
        predict_run(synthetic(), 0, model())


def test_a_malformed_calibration_is_one_line(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", run)
    (run / "calibration.json").write_text(json.dumps({"format": "ddpscope-calibration", "sizes": [{"bytes": "x"}]}))
    proc = run_cli("whatif", str(run))
    assert proc.returncode == 2 and "calibration.json" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("target, facts, args, message", [
    ("ring", {}, [], "not a DDP or DeepSpeed training run"),
    ("gpt", {"kind": "sharded", "sharding": {"framework": "fsdp2"}}, [], "not a DDP or DeepSpeed training run"),
    ("none", {}, [], "not a run folder"),
    ("gpt", {"nnodes": 2}, [], "ran on 2 nodes: calibrate with --nnodes 2 --node-rank K --rdzv-endpoint HOST:PORT"),
    ("gpt", {"nnodes": 2}, ["--nnodes", "2"], "--rdzv-endpoint HOST:PORT is required"),
    ("gpt", {"nnodes": 3}, [], "world size 2 is not 3 node(s)"),
    ("gpt", {}, ["--nnodes", "2", "--rdzv-endpoint", "h:1"], "ran on 1 node: calibrate with --nnodes 1"),
    ("gpt", {"nnodes": 2, "emulation": {"nodes": 2, "link": "fast"}}, [], "emulation has no usable link"),
    # a sweep on another device or backend than the run's says nothing of it (and the what-if leaves it unused)
    ("gpt", {"device": "xpu:0", "backend": "xccl"}, [], "calibrate sweeps gloo on CPU, and NCCL or gloo on CUDA, only"),
    ("gpt", {"device": "cpu", "backend": "ccl"}, [], "ran on cpu with ccl: calibrate sweeps gloo on CPU"),
    # on this machine (no GPU: CI's; or one GPU for NCCL's two ranks), torch really asked how many GPUs it has
    pytest.param("gpt", {"device": "cuda:1", "backend": "nccl"}, [], "calibrate it where it ran",
                 marks=pytest.mark.skipif(_gpus() >= 2, reason="two GPUs here: the run could calibrate")),
    pytest.param("gpt", {"device": "cuda:0", "backend": "cpu:gloo,cuda:nccl"}, [], "ran on CUDA (nccl), and this",
                 marks=pytest.mark.skipif(_gpus() >= 2, reason="two GPUs here: the run could calibrate")),
    pytest.param("gpt", {"device": "cuda:0", "backend": "gloo"}, [], "ran on CUDA (gloo), and this machine has no CUDA",
                 marks=pytest.mark.skipif(_gpus() >= 1, reason="a GPU here: the run could calibrate")),
])
def test_calibrate_refuses_other_runs_with_one_line(tmp_path, target, facts, args, message):
    path = tmp_path / target
    if target != "none":
        shutil.copytree(SAMPLES / {"ring": "ring-4rank-4mb", "gpt": "gpt-2rank-cap1mb"}[target], path)
        (path / "calibration.json").unlink(missing_ok=True)  # the GPT sample ships one: none may be written
        run = json.loads((path / "run.json").read_text())
        (path / "run.json").write_text(json.dumps({**run, **facts}))
    proc = run_cli("calibrate", str(path), *args)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (path / "calibration.json").exists()


@pytest.mark.parametrize("facts, flags", [
    ({"device": "cpu", "backend": "gloo"}, ["--device", "cpu", "--backend", "gloo"]),
    # init_process_group()'s default on a GPU machine; the run's tensors were on CPU: gloo's
    ({"device": "cpu", "backend": "cpu:gloo,cuda:nccl"}, ["--device", "cpu", "--backend", "gloo"]),
    ({"device": None, "backend": None}, []),  # run.json does not say: this machine's choice, as before
])
def test_calibrate_runs_on_the_runs_own_device_and_backend(tmp_path, facts, flags):
    """A run of gloo on CPU is calibrated on gloo on CPU even where GPUs are (NCCL's sweep
    would be another link, which the what-if leaves unused): the job is told so."""
    from ddpscope.tracer.launch.calibrate import CalibrateConfig

    path = tmp_path / "run"
    shutil.copytree(SAMPLES / "gpt-2rank-cap1mb", path)
    run = json.loads((path / "run.json").read_text())
    (path / "run.json").write_text(json.dumps({**run, **facts}))
    args = CalibrateConfig(run=path).launch_config().args
    got = [a for i, a in enumerate(args) if a in ("--device", "--backend") or args[i - 1] in ("--device", "--backend")]
    assert got == flags


def test_a_calibration_from_another_link_is_not_used():
    """A calibration is the link it ran over: one from loopback says nothing of an emulated
    1 Gbit/s link, nor one from 200 Mbit/s links of a 1 Gbit/s run."""
    cal = Calibration(sizes=(4096.0, 2**20), us=(50.0, 500.0), world_size=2, backend="gloo",
                      meta={"emulation": {"nodes": 2, "link": "200mbit", "link_bps": 2e8}})
    assert cal.unlike({"emulation": {"nodes": 2, "link": "200mbit", "link_bps": 2e8}}, 2) is None
    assert cal.unlike({"emulation": {"nodes": 2, "link": "1gbit", "link_bps": 1e9}}, 2) == \
        "the calibration ran on 2 emulated nodes over 200 Mbit/s links, the run on 2 emulated nodes over 1000 Mbit/s links"
    assert cal.unlike({}, 2) == "the calibration ran on 2 emulated nodes over 200 Mbit/s links, the run on no emulated link"
    assert "ran on 2 ranks, the run on 4" in cal.unlike({}, 4)
    t = synthetic()
    t.run["emulation"] = {"nodes": 2, "link": "1gbit", "link_bps": 1e9}
    m = fit_model(t, cal)
    assert "not used" in " ".join(m.notes) and "calibration" not in m.cost.source and not m.cost.points


def test_across_nodes_a_run_slower_than_its_calibration_keeps_the_links_cost():
    """The last 1 MiB bucket runs alone after backward for 5 ms where the calibration says
    2 ms: on one machine that is a fixed cost per all-reduce of the training step (3 ms);
    across nodes the calibration ran over the same link, which sets the time, and stays
    as measured (the lab's ``wide`` script: 25.6 ms a bucket added put its step 6.0 % too
    slow, as measured 0.7 %; benchmarks/whatif.py --link 1gbit)."""
    lab = {"emulation": {"nodes": 2, "link": "1gbit", "link_bps": 1e9}}
    t = synthetic()
    loop = fit_model(t, Calibration(sizes=(4096.0, 2**20), us=(50.0, 2000.0), world_size=2, backend="gloo"))
    assert loop.cost.overhead_us == pytest.approx(3000.0) and loop.cost.time_us(2**20) == pytest.approx(5000.0)
    t.run.update(lab)
    cal = Calibration(sizes=(4096.0, 2**20), us=(50.0, 2000.0), world_size=2, backend="gloo", meta=lab)
    m = fit_model(t, cal)
    assert m.shared_link and m.cost.overhead_us == 0.0 and m.cost.scale == 1.0
    assert m.cost.time_us(2**20) == pytest.approx(2000.0)


# -- cost and projection ------------------------------------------------------------------------

def test_cost_line_and_calibration_points():
    line = fit_line([1e6, 2e6, 4e6], [1100, 2100, 4100], "test")
    assert line.latency_us == pytest.approx(100) and line.us_per_byte == pytest.approx(1e-3)
    one = fit_line([1e6, 1e6], [1000, 1000], "test")
    assert one.latency_us == 0 and "one size" in one.source
    neg = fit_line([1e6, 2e6], [1000, 3000], "test")  # two sizes whose line says -1000 µs of latency
    assert neg.latency_us == 0 and "negative latency" in neg.source and "one size" not in neg.source
    assert line.latency_fitted and not neg.latency_fitted and not one.latency_fitted
    # a 1 MiB cap's buckets (1.002 and 1.006 MiB): one size to a line, whatever least squares says of them
    near = fit_line([1050624, 1054720, 1050624], [2900, 2800, 2950], "test")
    assert near.latency_us == 0 and not near.latency_fitted and "one size (1 to 1.01 MiB)" in near.source
    assert not fit_line([1e6, 4e6], [1000, 3000], "test", through_origin=True).latency_fitted
    pts = AllReduceCost(latency_us=0, us_per_byte=1e-3, points=((1e3, 50.0), (1e6, 500.0)))
    assert pts.time_us(5.005e5) == pytest.approx(275.0) and pts.time_us(2e6) == pytest.approx(2000.0)
    with pytest.raises(ValueError):
        fit_line([0], [1], "test")
    slower = pts.with_overhead(300.0, "test")  # a fixed cost per all-reduce: the same for every size
    assert slower.time_us([5.005e5, 2e6]) == pytest.approx([575.0, 2300.0]) and slower.points == pts.points
    assert pts.with_scale(0.5, "test").time_us(2e6) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="overhead"):
        pts.with_overhead(-1.0, "test")


def test_a_trace_of_one_bucket_size_says_its_cost_has_no_fixed_part():
    """The MLP's 1 MiB cap makes 15 buckets of 1.00-1.01 MiB: the line through them has no
    fixed cost per all-reduce, and the model says what that does to its predictions
    (benchmarks/whatif.py measures it against reruns). The GPT's 1 MiB cap leaves buckets of
    5 sizes, over 2x apart: its own line has a fixed cost, with or without its calibration."""
    alone = fit_model(load_run(SAMPLES / "mlp-2rank-cap1mb"))
    assert not alone.cost.latency_fitted and "one size (1 to 1.01 MiB)" in alone.cost.source
    assert any(UNFITTED_LATENCY in n for n in alone.notes)
    gpt = load_run(SAMPLES / "gpt-2rank-cap1mb")
    for model in (fit_model(gpt), fit_model(gpt, calibration=None)):
        assert model.cost.latency_fitted and not any(UNFITTED_LATENCY in n for n in model.notes)
    assert fit_model(gpt, calibration=None).cost.latency_us > 0


def test_a_calibration_of_another_backend_or_device_is_not_used():
    cal = Calibration(sizes=(4096.0, 2**20), us=(100.0, 900.0), world_size=2, backend="gloo",
                      meta={"device": "cpu"})
    assert cal.unlike({"backend": "gloo", "device": "cpu"}, 2) is None
    assert cal.unlike({"backend": "cpu:gloo,cuda:nccl", "device": "cpu"}, 2) is None  # the group holds gloo
    assert cal.unlike({"backend": "nccl", "device": "cuda:0"}, 2) == \
        "the calibration ran on backend gloo, the run on nccl"
    assert cal.unlike({"backend": "gloo", "device": "cuda:1"}, 2) == \
        "the calibration ran on device cpu, the run on cuda:1"
    on_gpu = Calibration(sizes=(4096.0, 2**20), us=(10.0, 90.0), world_size=2, backend="nccl", meta={"device": "cuda"})
    assert on_gpu.unlike({"backend": "nccl", "device": "cuda:1"}, 2) is None  # cuda:1 is cuda


def test_a_run_slower_than_its_calibration_pays_a_fixed_cost_per_all_reduce_not_a_factor():
    """The sample's buckets that ran alone took longer than the calibration's all-reduces of
    their size: the model adds that as a fixed cost per all-reduce (a factor read off the
    1 MiB cap's small buckets put a 25 MiB bucket at twice its measured time), and the
    compute an all-reduce takes from backward stays the calibration's (scaled up, it left a
    1 MiB cap's backward 14 ms of work where the 25 MiB cap's trace measured 29)."""
    t = load_run(SAMPLES / "gpt-2rank-cap1mb")
    m = fit_model(t)
    cal = read_calibration(t.path)
    assert m.cost.scale == 1.0 and m.cost.overhead_us > 0, m.notes
    assert (m.steal_us_per_allreduce, m.steal_us_per_mib) == pytest.approx(cal.steal())
    assert f"calibration + {m.cost.overhead_us:.0f} µs an all-reduce" in m.notes[1]
    big = 25 * MIB  # the 25 MiB cap's bucket: the calibration's time plus the same fixed cost
    assert m.cost.time_us(big) == pytest.approx(cal.cost().time_us(big) + m.cost.overhead_us)


def test_a_steal_not_measured_on_cpu_is_zero_with_a_bound_and_measured_has_none():
    """No calibration, and gradients of only one kind (the fit cannot tell the slowdown):
    the steal is taken as 0, and on CPU it is bounded by the run's time in flight during
    backward per MiB (three 5 ms all-reduces of 1 MiB inside backward: 5000 µs a MiB),
    said in the note. On a GPU there is no bound (NCCL runs on its own stream); with a
    calibration the steal is measured."""
    t = synthetic()
    m = fit_model(t, calibration=None)
    assert (m.steal_us_per_allreduce, m.steal_us_per_mib) == (0.0, 0.0)
    assert m.steal_max_us_per_mib == pytest.approx(5000.0)
    assert "at most 5000 µs per MiB" in m.notes[0] and "ddpscope calibrate" in m.notes[0]
    worst = m.at_most_steal()
    assert worst.steal_us_per_mib == pytest.approx(5000.0) and worst.steal_max_us_per_mib is None
    t.run["device"] = "cuda:0"
    assert fit_model(t, calibration=None).steal_max_us_per_mib is None
    sample = fit_model(load_run(SAMPLES / "gpt-2rank-cap1mb"))  # its calibration measures the steal
    assert sample.steal_max_us_per_mib is None
    with pytest.raises(ValueError, match="measured"):
        sample.at_most_steal()


def test_ring_projection_follows_the_formula_and_keeps_compute():
    link = LINK_PRESETS["InfiniBand NDR 400 Gb/s"]
    cost = ring_cost(64, link)
    m = 100 * MIB
    assert cost.time_us(m) == pytest.approx(2 * 63 * link.latency_us + 2 * 63 / 64 * m / (link.bandwidth_gbps * 1e3))
    t = synthetic()
    fast = project_model(model(), 64, Link(bandwidth_gbps=1e9, latency_us=0.0))
    assert medians(predict_run(t, 1, fast, model()))["step_ms"] == pytest.approx(56, abs=1e-3)
    slow = project_model(model(), 1024, Link(bandwidth_gbps=1.0, latency_us=50.0))
    sweep = compute_cap_sweep(t, [1, 4], slow, model())
    assert (sweep["exposed_ms"] > 0).all() and "projection" in slow.notes[0]
    with pytest.raises(ValueError, match="world size"):
        ring_cost(1, link)
    with pytest.raises(ValueError, match="bandwidth"):
        Link(bandwidth_gbps=0, latency_us=1)


def test_fit_on_a_sample_names_its_sources():
    m = fit_model(load_run(SAMPLES / "gpt-2rank-cap1mb"))
    assert m.lanes == 2 and m.cost.us_per_byte > 0 and len(m.notes) == 2
    assert predict_layout(load_run(SAMPLES / "gpt-2rank-cap1mb"), 1.0) == \
        load_run(SAMPLES / "gpt-2rank-cap1mb").run["bucket_layout"]


def test_runs_of_the_same_job_are_recognised():
    from ddpscope.viz.ddp.compare import same_job

    t = load_run(SAMPLES / "gpt-2rank-cap1mb")
    other = load_run(SAMPLES / "gpt-2rank-cap25mb")
    assert same_job(t, other)  # the demo at another cap
    rerun = dataclass_replace_run(other, demo="gpt", script={"path": "/x/tracer/workloads/demo/train.py"})
    assert same_job(t, rerun)  # a demo run made by `ddpscope run --demo` names its script too
    assert not same_job(t, load_run(SAMPLES / "mlp-2rank-cap1mb"))
    script_a = dataclass_replace_run(t, model="train", script={"path": "/p/train.py"})
    assert same_job(script_a, dataclass_replace_run(other, model="train", script={"path": "/p/train.py"}))
    assert not same_job(script_a, dataclass_replace_run(other, model="train", script={"path": "/q/train.py"}))
    assert not same_job(t, dataclass_replace_run(other, world_size=4))


def test_runs_of_the_same_job_at_other_settings_than_the_cap_are_told_apart():
    from ddpscope.viz.ddp.compare import same_job, settings_apart

    t = load_run(SAMPLES / "gpt-2rank-cap1mb")
    other = load_run(SAMPLES / "gpt-2rank-cap25mb")
    assert settings_apart(t, other) == ""  # another cap only
    fup = dataclass_replace_run(other, find_unused_parameters=not t.run["find_unused_parameters"])
    assert same_job(t, fup)  # the same job, but not another cap of this run
    assert settings_apart(t, fup) == f"find_unused_parameters={fup.run['find_unused_parameters']}"
    hooked = dataclass_replace_run(fup, gradient_as_bucket_view=True, static_graph=True)
    assert settings_apart(t, hooked) == "find_unused_parameters=True, static_graph=True, gradient_as_bucket_view=True"
    hooked = dataclass_replace_run(hooked, comm_hook="fp16_compress_hook")
    assert settings_apart(dataclass_replace_run(t, comm_hook=None), hooked).endswith(", comm_hook=fp16_compress_hook")
    older = dataclasses.replace(other, run={k: v for k, v in fup.run.items() if k != "find_unused_parameters"})
    assert settings_apart(t, older) == ""  # a setting a trace did not record is not told apart


def dataclass_replace_run(t: RunTrace, **run) -> RunTrace:
    import dataclasses

    return dataclasses.replace(t, run={**t.run, **run})


def test_ddps_default_cap_is_replayed_as_it_ran_beside_an_explicit_25():
    """DDP's default (25 MiB, first bucket 1 MiB) is not bucket_cap_mb=25 (every bucket
    25 MiB): the traced default is its own row, with the trace's layout."""
    t = synthetic(bucket_of=[0, 1, 1, 1])  # as DDP's default builds 1 MiB parameters: 1 MiB first, then the rest
    t.run.update(bucket_cap_mb=25.0, bucket_cap_default=True)
    assert traced_cap(t) is None and predict_layout(t, None) == [[0], [1, 2, 3]] == t.run["bucket_layout"]
    sweep = compute_cap_sweep(t, [1, 25], model(latency_us=1e3))
    assert sweep[["bucket_cap_mb", "first_bucket_mb", "buckets", "traced"]].values.tolist() == [
        [1.0, 1.0, 4, False], [25.0, 1.0, 2, True], [25.0, 25.0, 1, False]]


def test_output_cut_short_by_a_pipe_is_not_an_error():
    """``ddpscope whatif RUN | true``: the reader leaves before a line is written; no
    traceback, exit 0 (``PIPESTATUS``)."""
    proc = subprocess.run(f"{sys.executable} -m ddpscope.cli whatif {SAMPLES / 'gpt-2rank-cap1mb'} | true; "
                          "echo rc=${PIPESTATUS[0]} >&2", shell=True, executable="/bin/bash",
                          capture_output=True, text=True, timeout=120, cwd="/",
                          env={"PATH": "/usr/bin:/bin"})
    assert "rc=0" in proc.stderr and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


@pytest.mark.ddp
@pytest.mark.breadth  # the Trainer's runs (frameworks) check these layouts against DDP's too
def test_the_layout_follows_ddps_rebuild_policy_under_find_unused_parameters(tmp_path):
    """``find_unused_parameters=True`` (Hugging Face Trainer's default): DDP never rebuilds
    its buckets, so they stay in registration order, cut from the first registered
    parameter and reversed. From one trace (at 0.25 MiB) the what-if lays out what DDP
    itself built in real runs at its default (1 MiB first bucket), at 0.25 MiB and at a
    ``bucket_cap_mb_list``; with ``static_graph=True`` DDP rebuilds in gradient-ready
    order, and the what-if follows that too. The advisor searches only uniform caps where
    lists cannot mean what they say, and says why."""
    from ddpscope.viz.whatif.advisor import advise
    from tests.tracer.capture.autotrace.test_autotrace import USER, trace_script

    script = (USER, "--steps", "3", "--find-unused", "--depth", "6", "--width", "256")
    runs = {}
    for name, flags, more in [("cap", (), ("--bucket-cap-mb", "0.25")), ("default", (), ()),
                              ("list", ("--bucket-cap-mb-list", "0.75,0.25"), ()),
                              ("static", (), ("--bucket-cap-mb", "0.25", "--static-graph"))]:
        proc, out, _ = trace_script(tmp_path, *script, *more, ddpscope=flags, name=name)
        assert proc.returncode == 0, proc.stderr
        runs[name] = load_run(out)
    built = {k: sorted(map(sorted, t.run["bucket_layout"])) for k, t in runs.items()}  # DDP's own buckets
    assert len({str(v) for v in built.values()}) == 4 and all(len(v) >= 2 for v in built.values())
    one = runs["cap"]
    for name, cap in [("cap", 0.25), ("default", None), ("list", (0.75, 0.25))]:
        assert sorted(map(sorted, predict_layout(one, cap))) == built[name], name
    assert predict_layout(one, 0.25)[0] == max(predict_layout(one, 0.25), key=max)  # bucket 0: the last registered
    static = runs["static"]
    assert sorted(map(sorted, predict_layout(static, 0.25))) == built["static"]
    advice = advise(one, local_budget=20)
    assert advice.searched["growing list"] == advice.searched["per-bucket list"] == 0 and advice.searched["uniform"]
    assert "find_unused_parameters=True" in advice.note and not isinstance(advice.setting, tuple)
    assert advise(static, local_budget=0).note is None
    default = advise(runs["default"], local_budget=0)  # DDP's default among floats: kept as None, not NaN
    assert default.traced is None and (default.change or default.setting is None) and default.note


@pytest.mark.breadth
@pytest.mark.parametrize("flag", ["--static-graph", "--grad-as-bucket-view", "--find-unused-flag-only"])
def test_each_ddp_flag_lays_out_as_ddp_builds_at_a_cap_and_a_list(tmp_path, flag):
    """``static_graph=True``, ``gradient_as_bucket_view=True`` and ``find_unused_parameters``
    on a model that uses every parameter: from one trace (at 0.25 MiB) the what-if lays out
    what DDP itself built in real runs with the same flag at 1 MiB and at a
    ``bucket_cap_mb_list``."""
    from tests.tracer.capture.autotrace.test_autotrace import USER, trace_script

    script = (USER, "--steps", "3", "--depth", "6", "--width", "256", flag)
    runs = {}
    for name, flags, more in [("cap", (), ("--bucket-cap-mb", "0.25")), ("one", (), ("--bucket-cap-mb", "1")),
                              ("list", ("--bucket-cap-mb-list", "0.75,0.25"), ())]:
        proc, out, _ = trace_script(tmp_path, *script, *more, ddpscope=flags, name=name)
        assert proc.returncode == 0, proc.stderr
        runs[name] = load_run(out)
    built = {k: sorted(map(sorted, t.run["bucket_layout"])) for k, t in runs.items()}  # DDP's own buckets
    assert len({str(v) for v in built.values()}) == 3, built
    for name, cap in [("cap", 0.25), ("one", 1.0), ("list", (0.75, 0.25))]:
        assert sorted(map(sorted, predict_layout(runs["cap"], cap))) == built[name], name


def test_a_step_with_no_gradient_of_its_reduction_on_one_rank_is_left_out_of_the_replay():
    """A rank whose gradients of a step are not those of the micro-batch that reduced (an
    edited or torn trace) had ``step_inputs`` take ``max()`` of nothing: the step is left out."""
    from dataclasses import replace

    from ddpscope.viz.whatif.model import step_inputs

    trace = load_run(SAMPLES / "mlp-2rank-cap1mb")
    model = fit_model(trace)
    steps = [i.step for i in step_inputs(trace, model)]
    k = steps[1]
    grads = trace.grads.copy()
    grads.loc[(grads["rank"] == 1) & (grads["step"] == k), "micro"] = 7
    assert [i.step for i in step_inputs(replace(trace, grads=grads), model)] == [s for s in steps if s != k]


def test_a_backward_span_run_on_past_its_last_gradient_is_waiting_not_work():
    """Backward compute ends at the last gradient (``compute_end_us``): a span that ran on
    20 ms past it (waiting inside DDP's finalize) adds no work to the replay, and that
    waiting is not carried as finalize either (the replay makes it from its all-reduces)."""
    from dataclasses import replace

    from ddpscope.viz.whatif.model import step_inputs

    t = load_run(SAMPLES / "gpt-2rank-cap1mb")
    model = fit_model(t)
    before = {s.step: s.ranks[0] for s in step_inputs(t, model)}
    steps = t.steps.copy()
    steps["compute_end_us"] = steps["backward_end_us"]
    k = next(iter(before))
    row = (steps["rank"] == 0) & (steps["step"] == k)
    steps.loc[row, "backward_end_us"] += 20_000.0
    after = {s.step: s.ranks[0] for s in step_inputs(replace(t, steps=steps), model)}[k]
    assert after.work_end == pytest.approx(before[k].work_end)
    assert after.finalize == pytest.approx(before[k].finalize)


def test_whatif_sets_its_replay_of_the_traced_setting_beside_the_run():
    """``whatif`` on the GPT sample (1 MiB): its ``replay_check`` holds the traced row's
    replayed numbers and the run's own, read here straight off the trace's step spans and
    communication columns (non-warm-up, finished steps, each step the rank with the least
    exposed communication: the one it waited for; the step its ranks' mean),
    and the miss between them; the text line says the same numbers."""
    path = SAMPLES / "gpt-2rank-cap1mb"
    proc = run_cli("whatif", str(path), "--caps", "1,64", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    check = out["replay_check"]
    traced = next(c for c in out["caps"] if c["traced"])
    s = load_run(path).steps
    s = s[~s["warmup"] & ~s["incomplete"]]
    job = ((s["end_us"] - s["start_us"]) / 1e3).groupby(s["step"]).mean()  # the step: its ranks' mean
    s = s.assign(exposed=s["comm_us"] - s["overlapped_us"]).sort_values(["step", "exposed", "rank"])
    s = s.drop_duplicates("step")
    measured = {"step_ms": float(job.median()),
                "exposed_ms": float(((s["comm_us"] - s["overlapped_us"]) / 1e3).median()),
                "comm_ms": float((s["comm_us"] / 1e3).median())}
    for k, v in measured.items():
        assert check[k]["replayed"] == pytest.approx(traced[k], rel=1e-9)
        assert check[k]["measured"] == pytest.approx(v, rel=1e-6)
        assert check[k]["miss"] == pytest.approx(traced[k] - v, rel=1e-6, abs=1e-9)
    assert check["step_ms"]["measured"] == pytest.approx(out["recommended"]["measured_step_ms"], rel=1e-9)
    text = run_cli("whatif", str(path), "--caps", "1,64").stdout
    line = next(x for x in text.splitlines() if x.strip().startswith("measured: at its own setting"))
    assert (f"reads {check['step_ms']['replayed']:.1f} ms a step and {check['exposed_ms']['replayed']:.1f} ms exposed "
            f"where this run measured {check['step_ms']['measured']:.1f} and {check['exposed_ms']['measured']:.1f} ms"
            ) in line
