"""Memory a rank holds, by real tensor accounting (and the allocator's view on CUDA).

Bytes are counted once per distinct memory region (data pointer), so gradients that
are views into DDP's bucket buffers (``gradient_as_bucket_view=True``) are not counted
twice, and a bucket buffer is reported separately only when it is *extra* memory.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own data of ``t``: a DTensor's local shard (FSDP), else ``t``."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def distinct_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct regions (data pointer, size) that ``tensors`` occupy on this
    rank; a DTensor counts its local shard."""
    regions = {(t.data_ptr(), t.nbytes) for t in (local_tensor(x) for x in tensors if x is not None) if t.nbytes}
    return sum(n for _, n in regions)


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """State tensors the optimizer holds on this rank (``ZeroRedundancyOptimizer``: its shard)."""
    if optimizer is None:
        return []
    inner = getattr(optimizer, "optim", optimizer)
    return [v for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]


def rss_bytes() -> int | None:
    """Resident set size of this process (Linux ``/proc/self/statm``), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def measure_memory(
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    bucket_buffers: Iterable[torch.Tensor] = (),
    params_bytes: int | None = None,
) -> dict[str, int]:
    """Bytes of parameters, gradients, optimizer state and DDP's extra bucket buffers.

    ``params_bytes`` may be passed in when known (parameters do not change size).
    On CUDA, adds the caching allocator's ``allocated_bytes`` and ``max_allocated_bytes``
    (peak since the last ``reset_peak``); on CPU, the process RSS.
    """
    grads = [p.grad for p in params if p.grad is not None]
    buffers = list(bucket_buffers)
    grad_storages = {g.untyped_storage().data_ptr() for g in grads} if buffers else set()
    extra_buffers = [b for b in buffers if b.untyped_storage().data_ptr() not in grad_storages]
    out = {
        "params_bytes": distinct_bytes(params) if params_bytes is None else params_bytes,
        "grads_bytes": distinct_bytes(grads),
        "optimizer_state_bytes": distinct_bytes(optimizer_state_tensors(optimizer)),
        "bucket_buffers_bytes": distinct_bytes(extra_buffers),
    }
    device = params[0].device if params else torch.device("cpu")
    if device.type == "cuda":
        # Allocator statistics are host-side counters: no CPU-GPU sync.
        out["allocated_bytes"] = torch.cuda.memory_allocated(device)
        out["max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    else:
        rss = rss_bytes()
        if rss is not None:
            out["rss_bytes"] = rss
    return out


def reset_peak(device: torch.device) -> None:
    """Start a new peak window (CUDA only; CPU has no allocator peak to reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
