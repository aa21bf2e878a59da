"""ZeRO stages on real PyTorch, and what each one holds and sends, measured.

Stage 0: DDP + Adam (every rank holds everything). Stage 1: DDP +
``ZeroRedundancyOptimizer`` (optimizer state partitioned). Stage 2: FSDP
(``fully_shard``) with ``reshard_after_forward=False`` (parameters stay unsharded from
forward to backward; gradients and optimizer state sharded). Stage 3: FSDP full
sharding. Every module with parameters of its own is its own FSDP unit, so the root
holds none (FSDP keeps a root's parameters unsharded after forward).

Measurements, per rank:

- model states by tensor accounting of what the rank holds (distinct memory regions;
  DTensor shards by their local tensor): parameters (the largest of after forward,
  after backward and after the optimizer step: stage 2's unsharded copy shows after
  forward), gradients after backward, optimizer state after the step;
- tensor memory over a step from ``torch.profiler``'s memory events (every allocation
  and free of PyTorch's allocator while the stage ran, model construction included):
  the running total at the step's start and its peak within the step;
- collectives from the profiler: the ``c10d::`` operators the stage called, and the
  backend's events (``gloo:*`` / ``nccl:*``, with the tensors' shapes): calls, message
  bytes and bytes each rank sends with ring algorithms, per collective. Gloo has no
  reduce-scatter: PyTorch runs ``_reduce_scatter_base`` on gloo as an all-reduce of the
  whole tensor, and that is what is counted, because that is what was sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from ddpscope.tracer.capture.memory import distinct_bytes, optimizer_state_tensors

STAGES = {0: "DDP + Adam", 1: "DDP + ZeroRedundancyOptimizer", 2: "FSDP, reshard_after_forward=False",
          3: "FSDP, full sharding"}
STEP_MARK = "ddpscope::step"
_TYPE_BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4,
               "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


def build_stage(model: nn.Module, stage: int, device: torch.device, lr: float = 1e-3
                ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Wrap ``model`` (fresh, on ``device``) for ZeRO ``stage``; (module to train, optimizer)."""
    if stage in (0, 1):
        from torch.nn.parallel import DistributedDataParallel as DDP

        # Gradients are views into DDP's buckets: no second copy of them.
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  gradient_as_bucket_view=True)
        if stage == 0:
            return ddp, torch.optim.Adam(ddp.parameters(), lr=lr)
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    if stage in (2, 3):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        reshard = stage == 3
        units = [m for m in model.modules() if m is not model and any(True for _ in m.parameters(recurse=False))]
        for m in reversed(units):  # children before parents
            fully_shard(m, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        return model, torch.optim.Adam(model.parameters(), lr=lr)
    raise ValueError(f"--stages takes 0, 1, 2 and 3, got {stage}")


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    inner = getattr(opt, "optim", opt)
    return [p for g in inner.param_groups for p in g["params"]]


@dataclass
class ModelStates:
    """Bytes this rank holds, sampled at the points of a step (largest seen)."""

    params_bytes: int = 0
    grads_bytes: int = 0
    optimizer_state_bytes: int = 0

    def sample(self, module: nn.Module, opt: torch.optim.Optimizer) -> None:
        params = list(module.parameters()) + optimizer_params(opt)  # unsharded copies and shards
        self.params_bytes = max(self.params_bytes, distinct_bytes(params))
        self.grads_bytes = max(self.grads_bytes, distinct_bytes(p.grad for p in params))
        self.optimizer_state_bytes = max(self.optimizer_state_bytes, distinct_bytes(optimizer_state_tensors(opt)))


@dataclass
class CommCount:
    calls: int = 0
    message_bytes: int = 0  # the collective's full tensor: all-reduce/broadcast size, gathered/scattered size
    volume_bytes: float = 0.0  # bytes each rank sends with a ring (or pipelined) algorithm


@dataclass
class StepProfile:
    """What the profiler saw in one step: tensor memory (bytes) and collectives."""

    start_bytes: int = 0
    peak_bytes: int = 0
    end_bytes: int = 0
    comm: dict[str, CommCount] = field(default_factory=dict)  # by collective the backend ran
    issued: dict[str, int] = field(default_factory=dict)  # c10d operator calls (what the stage asked for)


def _tensor_bytes(dims, dtype: str, default_item: int) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n * _TYPE_BYTES.get(dtype, default_item)


def _collective(name: str, shapes: list, dtypes: list, world: int, default_item: int
                ) -> tuple[str, int, float] | None:
    """(collective, message bytes, bytes each rank sends by ring) of a backend event
    (``gloo:all_reduce``, ``nccl:_all_gather_base``, ...), whose first input is the tensor
    sent (all-gather: this rank's shard)."""
    op = name.split(":", 1)[1].lower()
    if "barrier" in op or not shapes or not isinstance(shapes[0], list):
        return None
    first = _tensor_bytes(shapes[0], dtypes[0] if dtypes else "", default_item)
    frac = (world - 1) / world
    if "all_gather" in op or "allgather" in op:
        return "all_gather", first * world, frac * first * world
    if "reduce_scatter" in op:
        return "reduce_scatter", first, frac * first
    if "all_reduce" in op or "allreduce" in op:
        return "all_reduce", first, 2 * frac * first
    if "broadcast" in op:
        return "broadcast", first, frac * first
    return op, first, 0.0


def analyze_profile(events, world: int, default_item: int = 4) -> list[StepProfile]:
    """One ``StepProfile`` per ``ddpscope::step`` range in ``prof.profiler.kineto_results.events()``."""
    steps = sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == STEP_MARK)
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    out = [StepProfile() for _ in steps]
    total, i = 0, 0
    for k, (t0, t1) in enumerate(steps):
        while i < len(mem) and mem[i][0] < t0:
            total += mem[i][1]
            i += 1
        prof = out[k]
        prof.start_bytes = prof.peak_bytes = total
        while i < len(mem) and mem[i][0] <= t1:
            total += mem[i][1]
            prof.peak_bytes = max(prof.peak_bytes, total)
            i += 1
        prof.end_bytes = total
    for e in events:
        name = e.name()
        backend = name.startswith(("gloo:", "nccl:"))
        if not backend and not name.startswith("c10d::"):
            continue
        t = e.start_ns()
        k = next((k for k, (t0, t1) in enumerate(steps) if t0 <= t <= t1), None)
        if k is None:
            continue
        if not backend:  # what the stage issued; the backend events below are what ran
            op = name.split("::", 1)[1].strip("_")
            out[k].issued[op] = out[k].issued.get(op, 0) + 1
            continue
        found = _collective(name, e.shapes(), e.dtypes(), world, default_item)
        if found is not None:
            c = out[k].comm.setdefault(found[0], CommCount())
            c.calls += 1
            c.message_bytes += found[1]
            c.volume_bytes += found[2]
    return out
