"""DDP's buffer broadcast, timed: before each syncing forward DDP broadcasts the module's
buffers (BatchNorm's running statistics) from rank 0 on its own process group
(``broadcast_buffers=True``, the default). That is no bucket and no all-reduce: it is
recorded as one of DDP's own collectives (``format.BUFFER_BROADCAST``: its lane, its
bytes), in both capture paths (the compiled one wraps only the reducer's group).

The wrapper replaces ``_distributed_broadcast_coalesced`` on the traced model's instance
(DDP calls it through ``self``), with its signature, arguments and return; the handle's
``remove`` gives the instance the class's method back. On CUDA the stamps are events on
the current stream, after the broadcast's work has been waited for there."""

from __future__ import annotations

import functools
from typing import Any

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.hook_guard import HookGuard


class BufferBroadcastTimer:
    """Times ``ddp``'s buffer broadcasts into ``recorder`` (``on_own_start``/``on_own_end``)
    under ``guard``; ``remove()`` undoes it (idempotent)."""

    def __init__(self, ddp, recorder, guard: HookGuard) -> None:
        self.ddp = ddp
        original = ddp._distributed_broadcast_coalesced  # the bound method DDP calls

        @functools.wraps(original)
        def broadcast(tensors, buffer_size, authoritative_rank=0):
            rec = self._start(recorder, guard, tensors)
            try:
                return original(tensors, buffer_size, authoritative_rank)
            finally:
                if rec is not None:
                    self._end(recorder, guard, rec)

        broadcast._ddpscope_timer = self
        ddp._distributed_broadcast_coalesced = broadcast

    @staticmethod
    def _start(recorder, guard: HookGuard, tensors) -> Any:
        if guard.broken is not None:
            return None
        try:
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            return recorder.on_own_start(fmt.BUFFER_BROADCAST, nbytes)
        except Exception as e:  # noqa: BLE001 - the broadcast goes on; this rank stops tracing
            guard.fail(e)
            return None

    @staticmethod
    def _end(recorder, guard: HookGuard, rec) -> None:
        try:
            recorder.on_own_end(rec)
        except Exception as e:  # noqa: BLE001
            guard.fail(e)

    def remove(self) -> None:
        fn = self.ddp.__dict__.get("_distributed_broadcast_coalesced")
        if getattr(fn, "_ddpscope_timer", None) is self:  # nobody replaced it since
            del self.ddp._distributed_broadcast_coalesced
