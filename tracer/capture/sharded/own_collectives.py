"""The collectives of a sharded step that no unit issued, recorded as the sharded recorder's
collectives of no unit (``unit`` -1, the dashboard's "(no unit)"): the all-reduce of the
gradient norm that ``clip_grad_norm_`` runs over an FSDP2 model's DTensor gradients, a
loss the script all-reduces in its step, a metric it gathers. ``collective_timer``
times them (its protocol: ``on_own_start`` ... ``on_own_wait``); FSDP's own all-gathers,
reduce-scatters and HSDP all-reduces run quiet, timed per unit (``fsdp_hooks.py``).

Each is a collective of its kind (``KINDS``: all-reduce, all-gather, reduce-scatter; a
broadcast, a barrier or an all-to-all has none and is not recorded) with ``op`` (the
function called) and ``by`` (who issued it) in its args. A synchronous call takes the
training thread off compute for its length (a cut, as an FSDP collective's); a
functional one runs beside compute from its launch until the wait for its output
returns, and that wait is off compute too; an ``async_op`` one ends when its future
completes (host clock) or, on a device clock, is its launch (``launch_only``). Only
inside a step: one between steps (a loss logged after ``optimizer.step()``) is not.
"""

from __future__ import annotations

from typing import Any

from ddpscope.tracer.capture.sharded.recorder import Coll, ShardedRecorder

#: the function a collective was issued with -> the sharded trace's kind
KINDS = {"all_reduce": "all_reduce", "reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
         "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
         "all_gather_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
         "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
         "reduce_scatter_tensor_coalesced": "reduce_scatter"}
NO_UNIT = -1


class OwnCollectives:
    """``collective_timer``'s recorder for a sharded step (``recorder``'s open step)."""

    def __init__(self, recorder: ShardedRecorder) -> None:
        self.rec = recorder

    def on_own_start(self, name: str, nbytes: int, *, op: str, message_bytes: int) -> Coll | None:
        rec, cur = self.rec, self.rec.current
        kind = KINDS.get(op)
        if cur is None or kind is None:
            return None
        now = rec.pause()
        c = Coll(kind=kind, unit=NO_UNIT, phase=rec.phase_of(cur), nbytes=message_bytes, start=now,
                 extra={"op": op, "by": name})
        cur.colls.append(c)
        rec.where = (NO_UNIT, c.phase, kind)
        return c

    def on_own_return(self, c: Coll, done: bool, launch_only: bool = False, message_bytes: int | None = None) -> None:
        now = self.rec.unpause()
        if message_bytes is not None:
            c.nbytes = message_bytes
        if done:
            c.end = now
            if launch_only:
                c.extra["launch_only"] = True

    def on_own_end(self, c: Coll) -> None:
        c.end = self.rec.clock.stamp()

    def on_own_wait(self, c: Coll, entering: bool) -> Any:
        if self.rec.current is not None:
            return self.rec.pause() if entering else self.rec.unpause()
        return None
