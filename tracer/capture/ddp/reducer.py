"""What ddpscope reads of DDP's reducer without touching it: its parameters in its own
order (so our parameter indices are DDP's), and whether it rebuilds its buckets after
the first step."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as DDP


def reducer_params(ddp: DDP) -> tuple[list[str], list[torch.nn.Parameter]]:
    """DDP's reducer parameters with their names, in the reducer's own order, so that
    our parameter indices equal DDP's (e.g. in ``rebuilt_per_bucket_param_indices``).
    Mirrors ``DistributedDataParallel._build_params_for_reducer``."""
    ignore = getattr(ddp, "parameters_to_ignore", set())
    names: list[str] = []
    params: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for module_name, module in ddp.module.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if not p.requires_grad or full in ignore or id(p) in seen:
                continue
            seen.add(id(p))
            names.append(full)
            params.append(p)
    return names, params


def frozen_params(ddp: DDP) -> list[torch.nn.Parameter]:
    """The model's parameters that do not train (``requires_grad=False``: a LoRA base
    model's): held on every rank as the others are, outside DDP's buckets, with no
    gradient or optimizer state. Each once, in ``parameters()`` order."""
    seen: set[int] = set()
    out = []
    for p in ddp.module.parameters():
        if not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def will_rebuild_buckets(ddp: DDP) -> bool:
    # Mirrors Reducer::should_rebuild_buckets: DDP rebuilds its buckets once, after the
    # first iteration, unless it looks for unused parameters on a dynamic graph.
    return bool(getattr(ddp, "static_graph", False) or not getattr(ddp, "find_unused_parameters", False))
