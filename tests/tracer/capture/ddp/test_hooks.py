"""What ddpscope puts into a rank never changes the script: patched entry points keep
their signatures, every hook returns what PyTorch expects, an error inside one of
ddpscope's hooks stops tracing but not training, and ordinary scripts that once died
under ``ddpscope run`` train bit for bit as they do untraced."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpscope.tracer.capture.autotrace.config import CaptureConfig
from ddpscope.tracer.launch.runner import capture_env
from ddpscope.viz.trace import load_run
from tests.conftest import ROOT
from tests.tracer.capture.autotrace.test_autotrace import checks, trace_script, untraced

SETUPS = str(ROOT / "tests" / "workers" / "setups_train.py")

SIGNATURES = """
import inspect, json
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import distributed_c10d as c10d
from torch.nn.parallel import DistributedDataParallel as DDP
from ddpscope.tracer.capture.ddp import comm_hook

comm_hook._shadow_hook_registration()  # what attaching a tracer does
patched = {"DDP.__init__": DDP.__init__, "dist.destroy_process_group": dist.destroy_process_group,
           "c10d.destroy_process_group": c10d.destroy_process_group, "DDP.register_comm_hook": DDP.register_comm_hook,
           "DDP._register_builtin_comm_hook": DDP._register_builtin_comm_hook}
def outcome(f, *args, **kwargs):  # what a call does (no process group here: each fails in torch)
    try:
        return repr(f(*args, **kwargs))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
calls = {  # positional and keyword forms, each on the patched and on the real function
    "DDP.__init__": [((nn.Linear(2, 2),), {}), ((nn.Linear(2, 2),), {"bucket_cap_mb": 1, "static_graph": True}),
                     ((), {"module": nn.Linear(2, 2)}), ((), {"no_such_argument": 1})],
    "dist.destroy_process_group": [((), {}), ((None,), {}), ((), {"group": None}), ((), {"groups": None})],
}
seen = {"patched": {k: getattr(f, "_ddpscope", False) for k, f in patched.items()},
        # the hook methods are defined with DDP's own parameters and annotations
        "own": {k: str(inspect.signature(f, follow_wrapped=False)) for k, f in patched.items()},
        "real": {k: str(inspect.signature(f.__wrapped__)) for k, f in patched.items()}, "calls": {}}
for name, forms in calls.items():
    for args, kwargs in forms:
        f = patched[name]
        if name == "DDP.__init__":
            ours = outcome(f, object.__new__(DDP), *args, **kwargs)
            real = outcome(f.__wrapped__, object.__new__(DDP), *args, **kwargs)
        else:
            ours, real = outcome(f, *args, **kwargs), outcome(f.__wrapped__, *args, **kwargs)
        seen["calls"][f"{name}{args}{sorted(kwargs)}"] = [ours, real]
print(json.dumps(seen))
"""


def test_patched_entry_points_keep_their_signatures(tmp_path):
    """In a traced rank every replaced entry point behaves as PyTorch's own: DDP's hook
    methods are defined with its parameters and annotations; ``DDP.__init__`` and
    ``destroy_process_group`` bind their arguments with the real signature, so every
    positional and keyword form does what it does untraced (here: the same error)."""
    env = {**capture_env(), **CaptureConfig(out=str(tmp_path / "out")).to_env(), "RANK": "0", "LOCAL_RANK": "0",
           "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", SIGNATURES], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(seen["patched"].values()), seen["patched"]
    for name in ("DDP.register_comm_hook", "DDP._register_builtin_comm_hook"):
        assert seen["own"][name] == seen["real"][name], name
    assert len(seen["calls"]) == 8
    for form, (ours, real) in seen["calls"].items():
        assert ours == real, form
    assert any("unexpected keyword argument 'no_such_argument'" in o for o, _ in seen["calls"].values())


def test_an_error_inside_a_hook_stops_tracing_and_not_training(tmp_path, capfd):
    """One gloo rank in this process, the Python capture. The recorder fails at the third
    step's first gradient (injected: there is no other way to make ddpscope's own code
    fail on demand): the step goes on, one line says so, tracing stops, and the weights
    equal an untraced run of the same loop."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpscope.tracer import DDPTracer
    from ddpscope.tracer.capture.ddp.recorder import StepRecorder
    from ddpscope.tracer.launch.torchrun import free_port

    def train(trace_dir=None) -> tuple[torch.Tensor, object]:
        torch.manual_seed(0)
        model = DDP(nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), bucket_cap_mb=0.001)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        tracer = DDPTracer(model, "auto", out_dir=trace_dir, capture="python") if trace_dir else None
        if tracer is not None:
            tracer.__enter__()
        for step in range(5):
            model(torch.full((8, 16), 0.1 * step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if tracer is not None:
            tracer.__exit__(None, None, None)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), tracer

    real = StepRecorder.on_grad_ready

    def failing(self, index):
        if self.current is not None and self.current.step == 2:
            raise ValueError("injected")
        return real(self, index)

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        plain, _ = train()
        StepRecorder.on_grad_ready = failing
        try:
            traced, tracer = train(tmp_path / "run")
        finally:
            StepRecorder.on_grad_ready = real
    finally:
        dist.destroy_process_group()
    assert torch.equal(plain, traced)
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("ddpscope: ")]
    assert said == ["ddpscope: rank 0: tracing stopped at step 2 (ValueError: injected); training goes on untraced"]
    assert not tracer.active
    trace = load_run(tmp_path / "run")
    assert trace.status == "failed" and "tracing stopped at step 2" in trace.unfinished
    assert sorted(trace.steps.step) == [0, 1]  # the steps closed before it, whole


@pytest.mark.ddp
@pytest.mark.breadth  # ZeroRedundancyOptimizer's own tests (test_zero1.py), the GAN's (test_session.py)
@pytest.mark.parametrize("case", ["gan", "zero"])
def test_scripts_that_once_died_train_bit_identical(tmp_path, case):
    """Under ``ddpscope run``: DDP's keyword and class-call forms of hook registration, two
    DDP models with an Adam each, an optimizer ddpscope does not trace, and
    ZeroRedundancyOptimizer (whose inner optimizer steps inside the traced outer step)."""
    proc, out, report = trace_script(tmp_path, SETUPS, case, "--steps", "5")
    assert proc.returncode == 0, proc.stderr
    plain = untraced(tmp_path, SETUPS, case, "--steps", "5")
    ours, theirs = checks(report), checks(plain)
    for r in (0, 1):
        assert ours[r]["params_sha256"] == theirs[r]["params_sha256"], f"rank {r} differs from the untraced run"
    trace = load_run(out)
    assert trace.status == "complete", trace.unfinished
    assert trace.steps.groupby("rank").size().to_dict() == {0: 5, 1: 5}
    assert trace.steps.optimizer_start_us.notna().all()  # the model's own optimizer, found and timed
    assert (trace.buckets.done_us > trace.buckets.launch_us).all() and len(trace.buckets) >= 2 * 5
    if case == "gan":
        assert trace.run["comm_hook"] == "fp16_compress_hook"
        assert any("DDP model 1 (" in n and "is traced too" in n for n in trace.run["notes"])
        assert trace.run["model_params"] == 3 * (32 * 32 + 32) + 32 * 32 + 32  # the generator's
    else:
        assert trace.run["comm_hook"] == "FP16_COMPRESS (DDP's built-in C++ hook)"
        # ZeroRedundancyOptimizer's step spans the inner Adam and the parameters' broadcast
        assert ours[0]["optimizer_state_keys"] and ours[0]["optimizer_state_keys"] == theirs[0]["optimizer_state_keys"]
    assert "Traceback" not in proc.stderr
