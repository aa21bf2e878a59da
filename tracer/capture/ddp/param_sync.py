"""ZeRO-1 on DDP: ``ZeroRedundancyOptimizer``'s parameter broadcasts after each step,
timed as the step's parameter sync (their own lane in the trace)."""

from __future__ import annotations

import functools
from typing import Any

from ddpscope.tracer.capture.collective_timer import quiet
from ddpscope.tracer.capture.hook_guard import HookGuard, HookHandles


class _InstanceAttribute:
    """A handle that deletes the instance attribute ``name`` of ``obj`` (shadowing its
    class's method) if it is still ``value``."""

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name, self.value = obj, name, value

    def remove(self) -> None:
        if self.obj is not None and self.obj.__dict__.get(self.name) is self.value:
            del self.obj.__dict__[self.name]
        self.obj = self.value = None  # the wrapper holds the optimizer: no cycle left behind


def attach_param_sync(opt, recorder, handles: HookHandles, guard: HookGuard) -> None:
    """ZeroRedundancyOptimizer (ZeRO-1): its ``_sync_params``, where every rank broadcasts
    the partition it updated, timed as the step's parameter sync. An instance attribute
    shadows the method (the same call, arguments and result); other optimizers, and
    ``overlap_with_ddp`` (its broadcasts run inside DDP's comm hook), are left alone."""
    if type(opt).__name__ != "ZeroRedundancyOptimizer" or getattr(opt, "_overlap_with_ddp", True) \
            or "_sync_params" in vars(opt) or not callable(getattr(type(opt), "_sync_params", None)):
        return
    original = type(opt)._sync_params

    @functools.wraps(original)
    def _sync_params(*args, **kwargs):
        rec = None
        if guard.broken is None:
            try:
                rec = recorder.on_param_sync_start(*_partition_bytes(opt))
            except Exception as e:  # noqa: BLE001 - the broadcasts run all the same
                guard.fail(e)
        try:
            with quiet():  # its broadcasts are this span's, not other collectives
                return original(opt, *args, **kwargs)
        finally:
            if rec is not None and guard.broken is None:
                try:
                    recorder.on_param_sync_end(rec)
                except Exception as e:  # noqa: BLE001
                    guard.fail(e)

    opt._sync_params = _sync_params
    handles.add(_InstanceAttribute(opt, "_sync_params", _sync_params))


def _partition_bytes(opt) -> tuple[int, int, int]:
    """(bytes of every rank's partition, this rank's, broadcasts issued) for one
    ``_sync_params`` of a ZeroRedundancyOptimizer: a bucket per device and rank when
    ``parameters_as_bucket_view``, else a broadcast per parameter."""
    world, rank = int(opt.world_size), int(opt.rank)
    if opt.parameters_as_bucket_view:
        per = [sum(b[r].numel() * b[r].element_size() for b in opt._buckets) for r in range(world)]
        count = len(opt._buckets) * world
    else:
        parts = opt._partition_parameters()
        per = [sum(p.numel() * p.element_size() for g in parts[r] for p in g["params"]) for r in range(world)]
        count = sum(len(g["params"]) for r in range(world) for g in parts[r])
    return sum(per), per[rank], count
