"""ZeRO-1 traced: DDP stepped by ``ZeroRedundancyOptimizer`` under ``ddpscope run``, its
parameter broadcasts timed on their own lane, checked against torch.profiler on the same
run and the script's own count of its partition; the model states beside the ZeRO model."""

from __future__ import annotations

import gzip
import json
import math

import pytest

from ddpscope.viz.ddp.stages import compute_ddp_stage_comparison, compute_param_sync, ddp_comm_lines
from ddpscope.viz.trace import load_run
from tests.conftest import run_cli
from tests.tracer.capture.autotrace.test_autotrace import checks, trace_script, untraced
from tests.tracer.capture.ddp.test_hooks import SETUPS


def _profiled_broadcasts(path) -> dict[int, tuple[int, int, float]]:
    """Per ProfilerStep k: (float broadcasts, their bytes, first start to last end µs) as
    torch.profiler recorded them (``gloo:broadcast`` with its input's shape). Integer
    broadcasts are DDP's own (its bucket rebuild at step 1), not the optimizer's."""
    events = json.loads(gzip.open(path).read())["traceEvents"]
    broadcasts = [e for e in events if e.get("name") == "gloo:broadcast" and e["args"]["Input type"] == ["float"]]
    out = {}
    for s in (e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")):
        mine = [e for e in broadcasts if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        if mine:
            out[int(s["name"].split("#")[1])] = (
                len(mine), sum(math.prod(e["args"]["Input Dims"][0]) * 4 for e in mine),
                max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine))
    return out


@pytest.mark.ddp
def test_zero1_broadcasts_are_timed_counted_and_agree_with_the_profiler(tmp_path):
    proc, out, report = trace_script(tmp_path, SETUPS, "zero", "--no-hook", "--steps", "6", ddpscope=("--profile",))
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain = untraced(tmp_path, SETUPS, "zero", "--no-hook", "--steps", "6")
    ours, theirs = checks(report), checks(plain)
    for r in (0, 1):  # bit-identical, and the wrapper was in place while it trained
        assert ours[r]["params_sha256"] == theirs[r]["params_sha256"]
        assert ours[r]["sync_params_wrapped"] and not theirs[r]["sync_params_wrapped"]
    trace = load_run(out)
    assert trace.run["sharding"]["stage"] == 1 and trace.run["sharding"]["optimizer"] == "Adam"
    steps = trace.steps
    assert steps["param_sync_start_us"].notna().all() and len(steps) == 12
    assert steps["other_comm_count"].isna().all()  # its broadcasts are the parameter sync's, never other collectives
    # inside the optimizer step, after the local update began
    assert (steps.param_sync_start_us > steps.optimizer_start_us).all()
    assert (steps.param_sync_end_us <= steps.optimizer_end_us).all()
    for r in (0, 1):  # the script's own count: every parameter, and its inner optimizer's partition
        mine = steps[steps["rank"] == r]
        assert (mine.param_sync_bytes == ours[r]["params_bytes"]).all()
        assert (mine.param_sync_own_bytes == ours[r]["own_bytes"]).all()
    # torch.profiler on the same run: the same broadcasts, all within the span we timed
    profiled = _profiled_broadcasts(out / "profile" / "rank-0.pt.trace.json.gz")
    assert len(profiled) >= 3
    rank0 = steps[steps["rank"] == 0].set_index("step")
    for k, (count, nbytes, span_us) in profiled.items():
        assert nbytes == rank0.loc[k, "param_sync_bytes"]
        assert count == 10  # a broadcast per parameter tensor (5 layers: weight and bias)
        assert rank0.loc[k, "param_sync_end_us"] - rank0.loc[k, "param_sync_start_us"] >= 0.9 * span_us
    # memory beside the ZeRO model: Adam's state on 1/N of the parameters (K = 8)
    table = compute_ddp_stage_comparison(trace).set_index("row")
    assert table.loc["stage 1", "optimizer_state_bytes"] == pytest.approx(8 * trace.run["model_params"] / 2)
    for r in (0, 1):
        measured = table.loc[f"measured (rank {r})"]
        assert measured["optimizer_state_bytes"] == ours[r]["state_bytes"]  # the script's own sum
        assert measured["measured/predicted"] == pytest.approx(1.0, abs=0.03)
    sync = compute_param_sync(trace)
    assert (sync["sync_ms"] > 0).all() and (sync["pct_of_optimizer"] <= 100).all()
    lines = ddp_comm_lines(trace)
    assert "1.00 D" in lines[1] and "2(N-1)/N" in lines[1]  # the all-reduce: every gradient, fp32
    assert "1.50 D" in lines[2]  # 2(N-1)/N + (N-1)/N at N = 2: ZeRO-1 as ZeroRedundancyOptimizer runs it
    summary = run_cli("summary", str(out))
    assert summary.returncode == 0 and "ZeRO-1 (ZeroRedundancyOptimizer): parameter broadcast" in summary.stdout


@pytest.mark.ddp
def test_zero1_with_bucket_views_broadcasts_one_bucket_per_rank(tmp_path):
    proc, out, report = trace_script(tmp_path, SETUPS, "zero", "--bucket-view", "--steps", "3")
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = json.loads((out / "rank-1.json").read_text())
    syncs = [e for e in events if isinstance(e, dict) and e.get("cat") == "param_sync"]
    assert len(syncs) == 3 and all(e["args"]["broadcasts"] == 2 for e in syncs)  # one bucket from each rank
    assert all(e["args"]["bytes"] == checks(report)[1]["params_bytes"] for e in syncs)
    lanes = [e["args"]["name"] for e in events if isinstance(e, dict) and e.get("name") == "thread_name"]
    assert "parameter broadcast (ZeRO-1)" in lanes


def test_the_broadcast_wrapper_goes_when_tracing_ends(tmp_path):
    """One gloo rank in this process: while traced, ``_sync_params`` is shadowed on the
    instance; after the tracer exits it is ZeroRedundancyOptimizer's own again, and the
    weights equal an untraced run's."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpscope.tracer import DDPTracer
    from ddpscope.tracer.launch.torchrun import free_port

    def train(trace_dir=None):
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, lr=0.1, momentum=0.9)
        tracer = DDPTracer(model, "auto", out_dir=trace_dir, capture="python") if trace_dir else None
        if tracer is not None:
            tracer.__enter__()
        wrapped = []
        for step in range(3):
            model(torch.full((4, 8), 0.1 * step)).sum().backward()
            opt.step()
            opt.zero_grad()
            wrapped.append("_sync_params" in vars(opt))
        if tracer is not None:
            tracer.__exit__(None, None, None)
        assert "_sync_params" not in vars(opt)  # gone (or never there)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), wrapped

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        plain, unwrapped = train()
        traced, wrapped = train(tmp_path / "run")
    finally:
        dist.destroy_process_group()
    assert torch.equal(plain, traced) and not any(unwrapped) and all(wrapped)
    trace = load_run(tmp_path / "run")
    assert trace.run["sharding"] == {**trace.run["sharding"], "stage": 1, "optimizer": "SGD", "momentum": True}
    assert trace.steps["param_sync_bytes"].tolist() == [(8 * 8 + 8 + 8 * 2 + 2) * 4] * 3
