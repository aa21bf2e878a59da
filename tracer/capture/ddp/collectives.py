"""The collectives that are not buckets, timed: what the script issues itself (a loss
averaged for logging, a metric gathered) and what DDP issues outside its reducer (the
all-reduce of ``delay_all_reduce_named_params``, join's gradient-sync flag) while a step
is open. Each is recorded as one of the step's own collectives (``format.CAT_DDP_OWN``,
its lane, never a bucket, never fed to the what-if's cost fit), named for who issued it.

``torch.distributed``'s collective functions are replaced on the module while a tracer is
attached (one timer at a time: the job's first traced model's), with their signatures,
arguments and returns; ``remove`` gives them back unless someone replaced them since. A
script that bound a function before the tracer attached (``from torch.distributed import
all_reduce``) keeps the untimed one.

Recorded only on the training thread (the thread that attached: a comm hook's completion
callbacks, PowerSGD's second all-reduce among them, run on the backend's threads and are
the bucket's), never inside a bucket's hook (``quiet``), never on ddpscope's own groups,
and only inside a step. An ``async_op=True`` call ends when its future completes on a
host clock; on a device clock (CUDA) the wait is the caller's and its stream's, so only
the launch is stamped (``args.launch_only``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from typing import Any, Iterator

import torch.distributed as dist

from ddpscope.tracer.capture.hook_guard import HookGuard

#: the functions timed, and the argument that holds the tensor(s) they move
TIMED = {"all_reduce": "tensor", "broadcast": "tensor", "reduce": "tensor", "all_gather": "tensor",
         "all_gather_into_tensor": "input_tensor", "reduce_scatter_tensor": "input", "all_to_all_single": "input",
         "barrier": None}
#: torch's own calls that are DDP's or Join's, by (module, function) of the caller
TORCH_CALLS = {
    ("torch.nn.parallel.distributed", "_delayed_all_reduce_hook"):
        "delayed parameters' all-reduce (DDP, delay_all_reduce_named_params)",
    ("torch.nn.parallel.distributed", "_check_global_requires_backward_grad_sync"): "join's gradient-sync flag (DDP)",
    ("torch.distributed.algorithms.join", "notify_join_context"): "join's notification (Join: this rank has inputs)",
}

_local = threading.local()
_active: "CollectiveTimer | None" = None  # the one attached: a second model's tracer adds none


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Collectives issued inside are timed as something else already: a bucket's (a comm
    hook's), ZeRO-1's parameter broadcasts."""
    depth = getattr(_local, "quiet", 0)
    _local.quiet = depth + 1
    try:
        yield
    finally:
        _local.quiet = depth


def _nbytes(value: Any) -> int:
    if value is None:
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return int(value.numel() * value.element_size()) if hasattr(value, "numel") else 0


def caller_name(fn: str, frame) -> str:
    """Who issued ``fn``: DDP or Join (``TORCH_CALLS``), the script (its file and line)
    or another module (a framework's: its module and function)."""
    if frame is None:
        return f"{fn} (the script)"
    module = frame.f_globals.get("__name__", "")
    code = frame.f_code.co_name
    if (module, code) in TORCH_CALLS:
        return TORCH_CALLS[(module, code)]
    if module == "__main__":
        return f"{fn} (the script, {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno})"
    return f"{fn} ({module}.{code})"


class CollectiveTimer:
    """Times ``torch.distributed``'s collectives into ``recorder`` (``on_own_start`` /
    ``on_own_end``) under ``guard``, leaving out those on ``own_groups`` (ddpscope's).
    ``remove()`` undoes it (idempotent). Does nothing where another timer is attached."""

    def __init__(self, recorder, guard: HookGuard, own_groups: tuple = (), host_clock: bool = True) -> None:
        global _active
        self.originals: dict[str, Any] = {}
        self._thread = threading.get_ident()
        if _active is not None:
            return
        _active = self
        for fn, arg in TIMED.items():
            original = getattr(dist, fn, None)
            if original is None:
                continue
            self.originals[fn] = original
            setattr(dist, fn, self._wrap(fn, arg, original, recorder, guard, own_groups, host_clock))

    def _wrap(self, fn: str, arg: str | None, original, recorder, guard: HookGuard, own_groups: tuple,
              host_clock: bool):
        thread = self._thread

        @functools.wraps(original)
        def timed(*args, **kwargs):
            rec = None
            if (guard.broken is None and threading.get_ident() == thread and not getattr(_local, "quiet", 0)
                    and kwargs.get("group") not in own_groups):
                try:
                    tensor = kwargs.get(arg, args[0] if args else None) if arg else None
                    rec = recorder.on_own_start(caller_name(fn, sys._getframe(1)), _nbytes(tensor))
                except Exception as e:  # noqa: BLE001 - the collective goes on; this rank stops tracing
                    guard.fail(e)
                    rec = None
            if rec is None:
                return original(*args, **kwargs)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                _end(recorder, guard, rec)
                raise
            if result is None or not host_clock:  # done on return (or, on a device clock, launched)
                if result is not None:
                    rec.launch_only = True
                _end(recorder, guard, rec)
            else:
                try:  # an async_op's Work: done when its future completes
                    result.get_future().then(lambda f: _end(recorder, guard, rec))
                except Exception:  # noqa: BLE001 - no future: the launch is what is known
                    rec.launch_only = True
                    _end(recorder, guard, rec)
            return result

        timed._ddpscope_timer = self
        return timed

    def remove(self) -> None:
        global _active
        for fn, original in self.originals.items():
            if getattr(getattr(dist, fn, None), "_ddpscope_timer", None) is self:  # nobody replaced it since
                setattr(dist, fn, original)
        self.originals = {}
        if _active is self:
            _active = None


def _end(recorder, guard: HookGuard, rec) -> None:
    try:
        recorder.on_own_end(rec)
    except Exception as e:  # noqa: BLE001
        guard.fail(e)
