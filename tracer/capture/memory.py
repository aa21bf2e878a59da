"""Memory a rank holds, by real tensor accounting (and the allocator's view on CUDA).

Bytes are counted once per distinct memory region (data pointer), so gradients that
are views into DDP's bucket buffers (``gradient_as_bucket_view=True``) are not counted
twice, and a bucket buffer is reported separately only when it is *extra* memory.

``MemoryMeter`` measures one model every step for the tracer, on the training thread
between steps, so it does only what can have changed: the parameters' bytes once, the
optimizer state's again only when its shape changed (an optimizer updates its state in
place), the gradients' in C++ where the compiled capture is loaded, the RSS by one
``pread`` of an open file.
"""

from __future__ import annotations

import os
from typing import Callable, Iterable

import torch

from ddpscope.tracer.capture.clock import period_of

# Steps whose memory every tracer (DDP's, FSDP2's, DeepSpeed's) always measures; later ones
# once an interval (``MeasuredSteps``).
FIRST_MEASURED_STEPS = 3


class MeasuredSteps:
    """Which steps memory is measured in (called with each step's number as it begins): the
    first ``FIRST_MEASURED_STEPS``, then the first step begun in each ``interval_s`` of rank
    0's clock (``clock.period_of``: the same step on every rank), every step where it is 0."""

    def __init__(self, clock, interval_s: float, offset_us: float = 0.0) -> None:
        self.clock = clock
        self.interval_us = interval_s * 1e6
        self.offset_us = offset_us  # add it to this rank's host clock (µs) for rank 0's
        self._period: int | None = None  # of the last measured step

    def __call__(self, step: int) -> bool:
        if self.interval_us <= 0:
            return True
        period = period_of(self.clock.host_us(), self.offset_us, self.interval_us)
        if step >= FIRST_MEASURED_STEPS and period == self._period:
            return False
        self._period = period
        return True


def allocator_counters(device: torch.device) -> dict[str, int]:
    """The CUDA caching allocator's current allocated and reserved bytes and its peak of
    allocated bytes (since the process began or the script last reset it), for
    ``device``: host-side counters, no CPU-GPU sync.

    One read of the nested statistics: ``torch.cuda.memory_allocated`` and its siblings each
    build, flatten and sort every statistic the allocator keeps, and a measured step read
    four of them (on an H200 host: 64-111 µs a call, against 12-23 µs for this one read;
    ``benchmarks/cuda_overhead.py``)."""
    stats = torch.cuda.memory_stats_as_nested_dict(device)  # {} before CUDA is initialised
    allocated, reserved = stats.get("allocated_bytes", {}).get("all", {}), stats.get("reserved_bytes", {}).get("all", {})
    return {"allocated_bytes": int(allocated.get("current", 0)), "reserved_bytes": int(reserved.get("current", 0)),
            "peak_allocated_bytes": int(allocated.get("peak", 0))}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's own data of ``t``: a DTensor's local shard (FSDP), else ``t``."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def distinct_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct regions (data pointer, size) that ``tensors`` occupy on this
    rank; a DTensor counts its local shard."""
    regions = {(t.data_ptr(), t.nbytes) for t in (local_tensor(x) for x in tensors if x is not None) if t.nbytes}
    return sum(n for _, n in regions)


# Where wrappers keep the optimizer they step: ZeroRedundancyOptimizer's local one (``optim``),
# Accelerate's and Lightning's wrappers (``optimizer``, ``_optimizer``), and containers of
# several (torchtitan's OptimizersContainer, itself an Optimizer with an empty ``state``).
_INNER = ("optim", "optimizer", "_optimizer")
_CONTAINED = ("optimizers",)


def _is_optimizer(obj) -> bool:
    return isinstance(getattr(obj, "state", None), dict) and isinstance(getattr(obj, "param_groups", None), list)


def state_holders(optimizer) -> list:
    """The optimizers that really hold state under ``optimizer``: wrappers and containers
    unwrapped (see ``_INNER``, ``_CONTAINED``), each state dict once (a wrapper may show
    its inner one's), never the empty shell of a container."""
    out, seen, todo, visited = [], set(), [optimizer], set()
    while todo:
        o = todo.pop(0)
        if o is None or id(o) in visited:
            continue
        visited.add(id(o))
        inner = [getattr(o, a, None) for a in _INNER]
        for a in _CONTAINED:
            group = getattr(o, a, None)
            inner += list(group) if isinstance(group, (list, tuple)) else []
        inner = [i for i in inner if i is not o and _is_optimizer(i)]
        if _is_optimizer(o) and id(o.state) not in seen and (o.state or not inner):
            seen.add(id(o.state))
            out.append(o)
        todo += inner
    return [o for o in out if o.state or len(out) == 1]


def optimizer_state_tensors(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """State tensors the optimizer holds on this rank (``ZeroRedundancyOptimizer``: its
    shard; a wrapper or a container: the optimizers inside, ``state_holders``)."""
    return [] if optimizer is None else _state_tensors(state_holders(optimizer))


def _state_tensors(holders: list) -> list[torch.Tensor]:
    return [v for h in holders for state in h.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class _OptimizerStateBytes:
    """``distinct_bytes`` of an optimizer's state tensors, counted again only when the
    state's shape changes: another state dict (``load_state_dict``), another optimizer,
    parameters gaining state or entries added (the first step). Optimizers update their
    state tensors in place, so in between the bytes stay; a state tensor swapped for one
    of another size with nothing else changing is not noticed."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._bytes = 0

    def __call__(self, optimizer: torch.optim.Optimizer | None) -> int:
        if optimizer is None:
            return 0
        holders = state_holders(optimizer)  # once a measured step: unwrapping is a few getattrs
        key = (id(optimizer), *((id(h.state), len(h.state), sum(map(len, h.state.values()))) for h in holders))
        if key != self._key:
            self._bytes = distinct_bytes(_state_tensors(holders))
            self._key = key
        return self._bytes


class MemoryMeter:
    """Bytes of one model's parameters, gradients, optimizer state and DDP's extra bucket
    buffers, measured each step; on CPU, the RSS. On CUDA, the caching allocator's
    ``allocated_bytes``, ``reserved_bytes`` and ``peak_allocated_bytes`` (its peak since the
    process began or the script last reset it: ddpscope never resets the script's peak),
    ``step_peak_bytes`` when that peak was set inside this step (else the step stayed below an
    earlier peak and its own is not known: absent), and the device's ``device_free_bytes`` /
    ``device_total_bytes`` (``cudaMemGetInfo``: every process on the GPU). Not seen by the
    allocator: the CUDA context, NCCL's own buffers, other libraries' allocations; what the
    device uses beyond ``reserved_bytes`` (``total - free - reserved``) holds them."""

    def __init__(self, params: list[torch.nn.Parameter], frozen: Iterable[torch.nn.Parameter] = ()) -> None:
        """``params``: the parameters that train (their gradients are counted); ``frozen``:
        those that do not (``requires_grad=False``), held all the same: in ``params_bytes``."""
        self.params = params
        # () -> the gradients' distinct bytes or -1 (the compiled capture's GradBytes); None: Python
        self.grad_bytes: Callable[[], int] | None = None
        self.device = params[0].device if params else torch.device("cpu")
        self.params_bytes = distinct_bytes([*params, *frozen])  # parameters do not change size
        self._peak_at_start: int | None = None  # CUDA: the allocator's peak when the measured step began
        self._state = _OptimizerStateBytes()
        self._statm = None  # /proc/self/statm, kept open (a file object: closed when collected too)
        self._page = os.sysconf("SC_PAGE_SIZE")
        if self.device.type != "cuda":
            try:
                self._statm = open("/proc/self/statm", "rb", buffering=0)
            except OSError:
                self._statm = None

    def __call__(self, optimizer: torch.optim.Optimizer | None,
                 bucket_buffers: Iterable[torch.Tensor] = ()) -> dict[str, int]:
        buffers = list(bucket_buffers)
        grads_bytes = -1 if buffers or self.grad_bytes is None else self.grad_bytes()
        if grads_bytes < 0:
            grads = [g for g in (p.grad for p in self.params) if g is not None]
            grads_bytes = distinct_bytes(grads)
            if buffers:  # the Python capture saw DDP's buckets: extra memory unless the grads view them
                grad_storages = {g.untyped_storage().data_ptr() for g in grads}
                buffers = [b for b in buffers if b.untyped_storage().data_ptr() not in grad_storages]
        out = {
            "params_bytes": self.params_bytes,
            "grads_bytes": grads_bytes,
            "optimizer_state_bytes": self._state(optimizer),
            "bucket_buffers_bytes": distinct_bytes(buffers),
        }
        if self.device.type == "cuda":
            out.update(self._cuda())
        elif (rss := self._rss()) is not None:
            out["rss_bytes"] = rss
        return out

    def start_step(self) -> None:
        """A measured step begins: remember the allocator's peak (CUDA), to tell whether the
        step sets a new one. Never resets it: the script may read its own peak."""
        if self.device.type == "cuda":
            self._peak_at_start = allocator_counters(self.device)["peak_allocated_bytes"]  # host-side

    def _cuda(self) -> dict[str, int]:
        # Allocator statistics are host-side counters; cudaMemGetInfo asks the driver: no
        # CPU-GPU sync (neither waits for a stream).
        dev = self.device
        out = allocator_counters(dev)
        if self._peak_at_start is not None and out["peak_allocated_bytes"] > self._peak_at_start:
            out["step_peak_bytes"] = out["peak_allocated_bytes"]
        self._peak_at_start = None
        try:
            free, total = torch.cuda.mem_get_info(dev)
            out["device_free_bytes"], out["device_total_bytes"] = int(free), int(total)
        except RuntimeError:  # a device the driver will not report on: the allocator's figures stand
            pass
        return out

    def _rss(self) -> int | None:
        if self._statm is None:
            return None
        try:
            return int(os.pread(self._statm.fileno(), 128, 0).split()[1]) * self._page
        except (OSError, ValueError, IndexError):
            return None

    def close(self) -> None:
        if self._statm is not None:
            self._statm.close()
            self._statm = None

