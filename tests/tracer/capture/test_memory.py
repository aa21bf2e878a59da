"""Memory accounting with real tensors and a real optimizer."""

import torch

from ddpscope.tracer.capture.memory import MemoryMeter, distinct_bytes


def test_views_of_one_region_count_once():
    flat = torch.zeros(1000)
    a, b = flat[:500], flat[500:]
    assert distinct_bytes([flat, flat]) == 4000
    assert distinct_bytes([a, b]) == 4000
    assert distinct_bytes([a, a.view(10, 50)]) == 2000


def test_params_grads_adam_state_and_aliased_bucket_buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
    params = list(model.parameters())
    n_bytes = sum(p.numel() * 4 for p in params)
    opt = torch.optim.Adam(params)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    # a DDP-like flat bucket that the gradients alias (gradient_as_bucket_view=True) ...
    bucket = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        view = bucket[offset: offset + p.numel()].view_as(p)
        view.copy_(p.grad)
        p.grad = view
        offset += p.numel()
    meter = MemoryMeter(params)
    m = meter(opt, [bucket])
    assert m["params_bytes"] == n_bytes and m["grads_bytes"] == n_bytes
    assert m["optimizer_state_bytes"] == 2 * n_bytes + 4 * len(params)  # exp_avg, exp_avg_sq, step
    assert m["bucket_buffers_bytes"] == 0  # aliased: no extra memory
    # ... and one that is a separate copy (gradient_as_bucket_view=False)
    assert meter(opt, [bucket.clone()])["bucket_buffers_bytes"] == n_bytes
    assert m["rss_bytes"] > n_bytes
    meter.close()


def test_the_meter_sees_new_optimizer_state_and_new_gradients():
    # it keeps the optimizer state's bytes while the state holds the same tensors: new
    # ones (another optimizer's, a loaded state dict) are counted again, as are new grads
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    params = list(model.parameters())
    n_bytes = sum(p.numel() * 4 for p in params)
    meter = MemoryMeter(params)
    opt = torch.optim.SGD(params, lr=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    first = meter(opt)
    assert first["optimizer_state_bytes"] == 0 and first["grads_bytes"] == n_bytes
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    opt.step()
    assert meter(opt)["optimizer_state_bytes"] == n_bytes  # a momentum buffer per parameter
    adam = torch.optim.Adam(params)
    adam.step()
    assert meter(adam)["optimizer_state_bytes"] == 2 * n_bytes + 4 * len(params)
    opt.load_state_dict(torch.optim.SGD(params, lr=0.1, momentum=0.9).state_dict())  # no state yet
    opt.zero_grad(set_to_none=True)
    after = meter(opt)
    assert after["grads_bytes"] == 0 and after["optimizer_state_bytes"] == 0
    before = after["rss_bytes"]
    hold = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched: resident
    assert meter(opt)["rss_bytes"] >= before + 60 * 2**20
    del hold
    meter.close()


def test_the_first_steps_then_one_a_interval_have_their_memory_measured():
    import time

    from ddpscope.tracer.capture.clock import CpuClock
    from ddpscope.tracer.capture.ddp.recorder import StepRecorder

    lin = torch.nn.Linear(8, 4)
    out: list[dict] = []
    rec = StepRecorder(clock=CpuClock(), rank=0, param_names=["w", "b"], params=list(lin.parameters()),
                       optimizer=None, step_boundary="explicit", memory_interval_s=0.3,
                       emit=lambda events, layouts: out.extend(e for e in events if isinstance(e, dict)))
    for pause in (0, 0, 0, 0, 0, 0.35, 0):
        time.sleep(pause)
        rec.on_forward_start()
        rec.on_forward_end(warmup=False)
        rec.mark_step()
    rec.finish(aborted=False)
    steps = [e for e in out if e["cat"] == "step"]
    counters = [e for e in out if e["ph"] == "C"]
    assert [s["args"]["step"] for s in steps if "memory" in s["args"]] == [0, 1, 2, 5]
    assert len(counters) == 4 and counters[-1]["args"]["params_bytes"] == (8 * 4 + 4) * 4


class _Container(torch.optim.Optimizer):
    """The shape of torchtitan's ``OptimizersContainer``: an Optimizer over every
    parameter, its own ``state`` empty, stepping one AdamW per model part."""

    def __init__(self, parts):
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-3) for p in parts]
        super().__init__([q for p in parts for q in p.parameters()], {"lr": 1e-3})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()


class _Wrapper:
    """The shape of Accelerate's ``AcceleratedOptimizer`` and Lightning's optimizer: the
    optimizer it steps in ``optimizer``, whose state and groups it shows as its own."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups


def test_optimizer_state_is_counted_where_it_is_held_once_never_in_an_empty_container():
    torch.manual_seed(0)
    parts = [torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)]
    params = [q for p in parts for q in p.parameters()]
    n_bytes = sum(p.numel() * 4 for p in params)
    meter = MemoryMeter(params)
    container = _Container(parts)
    assert meter(container)["optimizer_state_bytes"] == 0  # nothing stepped yet
    parts[1](parts[0](torch.randn(4, 64))).sum().backward()
    container.step()
    assert not container.state  # the shell holds nothing: its AdamWs do
    adamw = 2 * n_bytes + 4 * len(params)  # exp_avg, exp_avg_sq and a float32 step per parameter
    assert meter(container)["optimizer_state_bytes"] == adamw
    assert meter(_Wrapper(container))["optimizer_state_bytes"] == adamw  # a wrapper around it: the same, once
    inner = container.optimizers[0]
    wrapped = _Wrapper(inner)
    one = 2 * sum(p.numel() * 4 for p in parts[0].parameters()) + 4 * 2
    assert meter(wrapped)["optimizer_state_bytes"] == one == meter(inner)["optimizer_state_bytes"]
    meter.close()


def test_every_rank_measures_memory_in_the_same_step_whatever_its_clock():
    """Measured steps are the first in each memory_interval_s of rank 0's clock: two ranks
    stepping together, one's clock 7.1 s ahead and its offset saying so, measure the same
    steps; told no offset, it measures others (its periods end half a period apart). A rank
    measuring holds up the others at their next collective: misaligned, each pays all. The
    host clocks are driven by the test (50 ms a step), so no period ends between ranks."""
    from ddpscope.tracer.capture.clock import CpuClock
    from ddpscope.tracer.capture.ddp.recorder import StepRecorder

    now = [1000.0]  # µs, rank 0's host clock

    class Driven(CpuClock):
        def __init__(self, ahead_us: float) -> None:
            super().__init__()
            self.ahead_us = ahead_us

        def host_us(self) -> float:
            return now[0] + self.ahead_us

    lin = torch.nn.Linear(8, 4)
    measured: dict[str, list[int]] = {}
    recs = {}
    for name, clock, offset in (("rank 0", Driven(0.0), 0.0), ("rank 1", Driven(7.1e6), -7.1e6),
                                ("rank 1, no offset", Driven(7.1e6), 0.0)):
        out = measured.setdefault(name, [])
        recs[name] = StepRecorder(
            clock=clock, rank=0, param_names=["w", "b"], params=list(lin.parameters()), optimizer=None,
            step_boundary="explicit", memory_interval_s=0.2, offset_us=offset,
            emit=lambda events, layouts, out=out: out.extend(
                e["args"]["step"] for e in events if isinstance(e, dict) and e.get("cat") == "step"
                and "memory" in e["args"]))
    for _ in range(14):
        for rec in recs.values():
            rec.on_forward_start()
            rec.on_forward_end(warmup=False)
            rec.mark_step()
        now[0] += 50_000.0
    for rec in recs.values():
        rec.finish(aborted=False)
    assert measured["rank 0"] == [0, 1, 2, 4, 8, 12]  # the first 3, then one each 0.2 s
    assert measured["rank 1"] == measured["rank 0"]
    assert measured["rank 1, no offset"] == [0, 1, 2, 6, 10]
