"""What ``run.json`` records of a traced DDP model: the bucket sizes DDP really uses, its
settings, the script's communication hook, whether the ranks were bound to cores, and the
conditions a rank ran under (threads, cores, priority), and its ZeRO stage."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer.capture.ddp.comm_hook import STATE_ATTR
from ddpscope.tracer.capture.ddp.reducer import frozen_params, reducer_params


def ddp_facts(ddp: DDP) -> dict:
    """The model's facts for run.json (JSON-able)."""
    return {
        **bucket_caps(ddp),
        "model_class": type(ddp.module).__name__,
        "model_params": sum(p.numel() for p in reducer_params(ddp)[1]),  # those DDP reduces
        "frozen_params": sum(p.numel() for p in frozen_params(ddp)),  # held, never reduced
        "comm_hook": _comm_hook_name(ddp),
        "gradient_as_bucket_view": bool(ddp.gradient_as_bucket_view),
        "static_graph": bool(ddp.static_graph),
        "find_unused_parameters": bool(ddp.find_unused_parameters),
        "torch_compile": torch_compile_facts(ddp),
        # a calibration binds its ranks to cores as the run's were (contention differs)
        "ranks_bound_to_cores": _bound_to_cores(),
        "conditions": rank_conditions(),
    }


#: torch.compile's DDPOptimizer (``torch._dynamo.backends.distributed``) splits the compiled
#: graph at DDP's bucket boundaries and refuses a bucket_bytes_cap under its first bucket,
#: DDP's default 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``): an AssertionError at the first
#: forward. DDP's bucket_bytes_cap is bucket_cap_mb, or the largest of bucket_cap_mb_list.
DDP_OPTIMIZER_MIN_CAP_BYTES = 2**20


def compiled_inside(ddp_module: torch.nn.Module) -> bool:
    """The module, or one of its submodules, is ``torch.compile``'d (an ``OptimizedModule``):
    compiled frames run inside DDP's forward, where DDPOptimizer splits them."""
    dynamo = sys.modules.get("torch._dynamo")
    optimized = getattr(getattr(dynamo, "eval_frame", None), "OptimizedModule", None)
    return optimized is not None and any(isinstance(m, optimized) for m in ddp_module.modules())


def ddp_optimizer_mode() -> str | None:
    """How torch.compile treats DDP models here (``torch._dynamo.config.optimize_ddp``:
    "ddp_optimizer", torch's default, splits graphs at buckets), or None when torch.compile
    was never imported (nothing of it runs)."""
    dynamo = sys.modules.get("torch._dynamo")
    try:
        return None if dynamo is None else str(dynamo.utils.get_optimize_ddp_mode())
    except (AttributeError, RuntimeError):
        return None


def torch_compile_facts(ddp: DDP) -> dict | None:
    """Whether torch.compile runs in this process: ``{"graphs", "inside", "optimize_ddp"}``
    (graphs compiled so far, in the whole process; the DDP module holds a compiled module;
    ``ddp_optimizer_mode``), or None when neither (read at the start of tracing and again at
    its end, so ``torch.compile(DDP(model))``, compiled at its first forward, is seen too)."""
    mode = ddp_optimizer_mode()
    if mode is None:
        return None
    try:
        from torch._dynamo.utils import counters

        graphs = int(counters["stats"]["unique_graphs"])
    except (ImportError, KeyError, TypeError, ValueError):
        graphs = 0
    inside = compiled_inside(ddp.module)
    return {"graphs": graphs, "inside": inside, "optimize_ddp": mode} if graphs or inside else None


def rank_conditions() -> dict:
    """How this rank was set to run (rank 0's; every rank is launched alike): torch's
    intra-op threads, the cores it may run on, its nice value. They move step times as
    much as any setting: two runs compared under different conditions say so. (Inter-op
    threads are not read: reading them starts torch's pool, after which the script could
    no longer set them.)"""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 0
    return {"torch_threads": int(torch.get_num_threads()), "cores_allowed": int(cores),
            "nice": int(os.getpriority(os.PRIO_PROCESS, 0))}


def _bound_to_cores() -> bool:
    """Whether this process may run on fewer cores than the machine has."""
    try:
        return len(os.sched_getaffinity(0)) < (os.cpu_count() or 0)
    except (AttributeError, OSError):
        return False


def bucket_caps(ddp: DDP) -> dict:
    """The bucket sizes DDP really uses (bytes; MiB = 2^20 bytes). DDP treats "no
    bucket_cap_mb given" apart from an explicit 25: both cap buckets at 25 MiB, but only
    the default makes the first bucket (the last gradients) 1 MiB
    (``dist._DEFAULT_FIRST_BUCKET_BYTES``)."""
    cap = int(ddp.bucket_bytes_cap)
    config = getattr(ddp, "_bucket_config", None)
    if config is not None:
        first = int(config.first_bucket_bytes_cap)
    else:  # older DDP: the flag alone says whether the default first bucket applies
        first = int(dist._DEFAULT_FIRST_BUCKET_BYTES) if getattr(ddp, "bucket_bytes_cap_default", False) else cap
    per_bucket = [int(b) for b in getattr(ddp, "bucket_bytes_cap_list", []) or []]
    return {"bucket_cap_bytes": cap, "bucket_cap_mb": cap / 2**20, "first_bucket_cap_bytes": first,
            "bucket_cap_default": first < cap and not per_bucket, "bucket_cap_bytes_list": per_bucket or None}


def _comm_hook_name(ddp: DDP) -> str | None:
    """The script's own communication hook (wrapped by ddpscope's), if any."""
    state = getattr(ddp, STATE_ATTR, None)
    if state is not None and state.builtin is not None:
        return f"{state.builtin} (DDP's built-in C++ hook)"
    if state is None or state.inner is None:
        return None
    return getattr(state.inner[0], "__qualname__", repr(state.inner[0]))


def zero_stage(optimizer) -> dict:
    """DDP's ZeRO stage: 1 when the optimizer is a ``ZeroRedundancyOptimizer`` (its state
    partitioned; parameters broadcast from their owner after each step), else 0; and the
    optimizer that keeps the state (ZeRO-1's inner one), for the ZeRO model's K."""
    zero1 = type(optimizer).__name__ == "ZeroRedundancyOptimizer"
    inner = getattr(optimizer, "optim", None) if zero1 else optimizer
    facts = {}
    if inner is not None:
        groups = getattr(inner, "param_groups", None) or [{}]
        facts = {"optimizer": type(inner).__name__, "momentum": bool(groups[0].get("momentum") or 0)}
    if zero1:
        return {"framework": "zero1", "stage": 1, "stage_reason": "DDP with ZeroRedundancyOptimizer: optimizer state "
                "partitioned, gradients all-reduced, parameters broadcast from their owner after the step", **facts}
    return {"framework": "ddp", "stage": 0, "stage_reason": "DDP: every rank holds every parameter, gradient and "
            "optimizer state", **facts}
