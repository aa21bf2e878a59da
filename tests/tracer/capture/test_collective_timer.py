"""The collective timer (tracer/capture/collective_timer.py), in process on a one-rank gloo
group: what it tells a recorder about ``torch.distributed``'s collectives and the
functional ones DTensor calls, in order, and that each call still does what it did (same
results, same signatures, the originals back on ``remove``). The recorder here is a log of
the protocol's calls (ddpscope's own interface, not a framework's); the recorders that
keep them are tested on real jobs (tests/tracer/capture/ddp/test_collectives.py,
tests/tracer/capture/sharded/test_sharded.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ddpscope.tracer.capture.collective_timer import CollectiveTimer, quiet
from ddpscope.tracer.capture.hook_guard import HookGuard


class Log:
    """Each protocol call, in order: (what, name or None, details)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def on_own_start(self, name, nbytes, *, op, message_bytes):
        rec = {"name": name, "nbytes": nbytes, "op": op, "message": message_bytes}
        self.calls.append(("start", name))
        return rec

    def on_own_return(self, rec, done, launch_only=False, message_bytes=None):
        if message_bytes is not None:
            rec["message"] = message_bytes
        self.calls.append(("return", rec["name"], done))

    def on_own_end(self, rec):
        self.calls.append(("end", rec["name"]))

    def on_own_wait(self, rec, entering):
        self.calls.append(("wait", rec["name"], entering))

    def starts(self) -> list[str]:
        return [c[1] for c in self.calls if c[0] == "start"]


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.fixture
def timed(group):
    log = Log()
    before = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_into_tensor")} | \
        {n: getattr(funcol, n) for n in ("all_reduce", "all_gather_tensor", "wait_tensor")}
    timer = CollectiveTimer(log, HookGuard())
    try:
        yield log, timer
    finally:
        timer.remove()
    after = {n: getattr(dist, n) for n in ("all_reduce", "all_gather_into_tensor")} | \
        {n: getattr(funcol, n) for n in ("all_reduce", "all_gather_tensor", "wait_tensor")}
    assert after == before  # the originals back


def test_a_functional_all_reduce_runs_from_its_launch_to_the_wait_for_its_output(timed, group):
    log, _ = timed
    x = torch.arange(4.0)
    out = funcol.all_reduce(x, "sum", group)
    assert log.calls == [("start", log.starts()[0]), ("return", log.starts()[0], False)]
    assert log.starts()[0] == f"all_reduce ({__name__}.{test_a_functional_all_reduce_runs_from_its_launch_to_the_wait_for_its_output.__name__})"
    total = (out * 2).sum()  # the first use waits: the wait is recorded, then the end
    name = log.starts()[0]
    assert log.calls[2:] == [("wait", name, True), ("end", name), ("wait", name, False)]
    assert float(total) == 12.0
    out.wait()  # a second wait on it is not the collective's
    assert len(log.calls) == 5


def test_a_deprecated_functional_call_is_one_collective_and_an_all_gather_is_its_output(timed, group):
    log, _ = timed
    with pytest.warns(FutureWarning):
        out = funcol.all_gather_tensor(torch.ones(3), 0, group)  # calls all_gather_single inside
    assert len(log.starts()) == 1 and log.starts()[0].startswith("all_gather_tensor (")
    assert torch.equal(out.wait(), torch.ones(3))


def test_torch_distributed_calls_keep_their_results_and_signatures(timed, group):
    log, _ = timed
    t = torch.ones(2)
    assert dist.all_reduce(t) is None and torch.equal(t, torch.ones(2))
    out = torch.empty(2)
    dist.all_gather_into_tensor(out, torch.full((2,), 3.0))  # positional: the output first
    assert torch.equal(out, torch.full((2,), 3.0))
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    assert log.starts() == [f"all_reduce ({__name__}.test_torch_distributed_calls_keep_their_results_and_signatures)",
                            f"all_gather_into_tensor ({__name__}.test_torch_distributed_calls_keep_their_results_and_signatures)",
                            f"all_reduce ({__name__}.test_torch_distributed_calls_keep_their_results_and_signatures)"]
    assert [c for c in log.calls if c[0] == "return"][-1][2] is False  # async_op: over when its future completes
    for fn in (dist.all_reduce, dist.all_gather_into_tensor, funcol.all_reduce, funcol.wait_tensor):
        assert inspect.signature(fn) == inspect.signature(fn.__wrapped__)


def test_a_call_the_function_refuses_raises_its_own_error_and_tracing_goes_on(group):
    log, guard = Log(), HookGuard()
    timer = CollectiveTimer(log, guard)
    try:
        with pytest.raises(TypeError):
            dist.all_reduce(torch.ones(1), no_such_argument=1)
        assert guard.broken is None and log.calls == []
        dist.all_reduce(torch.ones(1))
        assert len(log.starts()) == 1
    finally:
        timer.remove()


def test_quiet_and_ddpscopes_own_groups_are_not_timed(group):
    log = Log()
    own = dist.new_group(backend="gloo")
    timer = CollectiveTimer(log, HookGuard(), own_groups=(own,))
    try:
        dist.all_reduce(torch.ones(1), group=own)
        dist.all_reduce(torch.ones(1), dist.ReduceOp.SUM, own)  # the group given positionally
        with quiet():
            dist.all_reduce(torch.ones(1))
            funcol.all_reduce(torch.ones(1), "sum", group).wait()
        assert log.calls == []
    finally:
        timer.remove()


def test_calls_straight_from_a_passed_over_module_are_not_timed_and_the_rest_are(group):
    """DeepSpeed's tracer passes over ``deepspeed.comm`` (its tap times what the backend
    runs): a call made from a module of that name is not timed, a call from anywhere else
    is, and a name that only starts alike (``deepspeed.community``) is not passed over.
    The modules are made here: deepspeed itself is the marked suite's (test_tracer.py)."""
    import types

    def module(name: str):
        m = types.ModuleType(name)
        exec("import torch.distributed as dist\n"
             "import torch.distributed._functional_collectives as funcol\n"
             "def reduce(t, group):\n"
             "    dist.all_reduce(t)\n"
             "    return funcol.all_reduce(t, 'sum', group).wait()\n", m.__dict__)
        return m

    log = Log()
    timer = CollectiveTimer(log, HookGuard(), passed_over=("deepspeed.comm",))
    try:
        assert module("deepspeed.comm.torch").reduce(torch.ones(2), group).tolist() == [1.0, 1.0]
        assert log.calls == []
        module("deepspeed.community").reduce(torch.ones(2), group)
        dist.all_reduce(torch.ones(1))
        assert log.starts() == ["all_reduce (deepspeed.community.reduce)", "all_reduce (deepspeed.community.reduce)",
                                f"all_reduce ({__name__}.test_calls_straight_from_a_passed_over_module_are_not_timed"
                                "_and_the_rest_are)"]
    finally:
        timer.remove()


def test_inside_torch_compile_the_functional_collective_is_the_original(timed, group):
    """Dynamo traces the wrapper's passthrough (no graph break: ``fullgraph``) and runs
    the compiled collective; none of it is recorded as the training thread's own call."""
    log, _ = timed

    @torch.compile(backend="eager", fullgraph=True)
    def f(x):
        return funcol.all_reduce(x, "sum", group) * 2

    assert torch.equal(f(torch.ones(3)), torch.full((3,), 2.0))
    assert log.starts() == []


def test_a_job_that_never_imported_the_functional_collectives_does_not_get_them(tmp_path):
    """Importing them registers autograd formulas and DeviceMesh: a DDP job that had neither
    keeps its modules as they were (a fresh interpreter: this one has imported them)."""
    import subprocess
    import sys

    code = f"""
import sys, torch, torch.distributed as dist
from ddpscope.tracer.capture.collective_timer import CollectiveTimer
from ddpscope.tracer.capture.hook_guard import HookGuard
dist.init_process_group("gloo", init_method="file://{tmp_path / 'store'}", rank=0, world_size=1)
timer = CollectiveTimer(None, HookGuard())
assert getattr(dist.all_reduce, "_ddpscope_timer", None) is timer
print("torch.distributed._functional_collectives" in sys.modules)
timer.remove()
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False"
