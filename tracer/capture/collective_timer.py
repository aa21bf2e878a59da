"""The collectives no traced unit or bucket issues, timed: what the script issues itself (a
loss averaged for logging, a metric gathered), what DDP issues outside its reducer (the
all-reduce of ``delay_all_reduce_named_params``, join's gradient-sync flag) and DTensor's
(``clip_grad_norm_`` over an FSDP2 model's gradients all-reduces their norm) while a step
is open. Each is recorded as one of the step's own collectives, named for who issued it:
on a DDP trace on its own lane (``format.CAT_DDP_OWN``, never a bucket, never fed to the
what-if's cost fit), on a sharded trace as a collective of no unit.

Two families are replaced on their modules while a tracer is attached (one timer at a
time: the job's first traced model's), with their signatures, arguments and returns:

- ``torch.distributed``'s collective functions (``TIMED``);
- the functional collectives DTensor and some scripts call
  (``torch.distributed._functional_collectives``, ``FUNCTIONAL``; when the script has
  imported them by the time tracing starts, as FSDP2 and DTensor do): they return at once, an
  ``AsyncCollectiveTensor`` that waits (``wait_tensor``, replaced too) when first used, so
  one ends when the wait for its last tensor returns, and the wait is time the training
  thread spent in it.

``remove`` gives them back unless someone replaced them since. A script that bound a
function before the tracer attached (``from torch.distributed import all_reduce``) keeps
the untimed one. Inside ``torch.compile``'s tracing each wrapper is the original (its
collectives are the compiled graph's).

Recorded only on the training thread (the thread that attached: a comm hook's completion
callbacks, PowerSGD's second all-reduce among them, run on the backend's threads and are
the bucket's), never inside a bucket's hook or FSDP's own collectives (``quiet``), never on
ddpscope's own groups, and only inside a step (the recorder decides). An ``async_op=True``
call ends when its future completes on a host clock; on a device clock (CUDA) the wait is
the caller's and its stream's, so only the launch is stamped (``launch_only``).

The recorder's side (``ddp/recorder.py``, ``sharded/own_collectives.py``):
``on_own_start(name, nbytes, op=, message_bytes=) -> rec | None`` as the call begins (None:
not recorded); ``on_own_return(rec, done, launch_only=False, message_bytes=None)`` as it
returns (``done``: the collective is over); ``on_own_end(rec)`` when one that was not done
on return is (its future, or the wait for its last tensor); ``on_own_wait(rec, entering)``
around that wait. ``nbytes`` is the tensor the call was given (its first tensor argument);
``message_bytes`` the collective's message (the larger of its input and output: an
all-gather's output, a reduce-scatter's input).

A DeepSpeed trace gets it too (``deepspeed/tracer.py``): ZeRO's collectives pass DeepSpeed's
backend and its tap (``passed_over``), so what it records there is what reached
``torch.distributed`` some other way: the script's own call, a library's.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
import threading
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ddpscope.tracer.capture.hook_guard import HookGuard

#: the functions timed, and the arguments that hold the tensor(s) they move (the first: the
#: bytes a DDP trace records, "the script's own count")
TIMED = {"all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",),
         "all_gather": ("tensor", "tensor_list"), "all_gather_into_tensor": ("input_tensor", "output_tensor"),
         "all_gather_single": ("input_tensor", "output_tensor"), "reduce_scatter_tensor": ("input", "output"),
         "reduce_scatter_single": ("input", "output"), "all_to_all_single": ("input", "output"),
         "barrier": ()}
#: the functional collectives timed (their tensor argument is ``self``, the first)
FUNCTIONAL = ("all_reduce", "all_reduce_coalesced", "all_gather_single", "all_gather_tensor",
              "all_gather_into_tensor_coalesced", "reduce_scatter_single", "reduce_scatter_tensor",
              "reduce_scatter_tensor_coalesced", "broadcast", "all_to_all_single")
#: torch's own calls that are DDP's or Join's, by (module, function) of the caller
TORCH_CALLS = {
    ("torch.nn.parallel.distributed", "_delayed_all_reduce_hook"):
        "delayed parameters' all-reduce (DDP, delay_all_reduce_named_params)",
    ("torch.nn.parallel.distributed", "_check_global_requires_backward_grad_sync"): "join's gradient-sync flag (DDP)",
    ("torch.distributed.algorithms.join", "notify_join_context"): "join's notification (Join: this rank has inputs)",
}
_FUNCOL = "torch.distributed._functional_collectives"
# frames passed over to name who issued a functional collective: DTensor's dispatch and
# redistribution, torch's internals between them and the caller
_INSIDE = ("torch.distributed", "torch._", "torch.utils._", "torch.autograd", "ddpscope.")

_local = threading.local()
_active: "CollectiveTimer | None" = None  # the one attached: a second model's tracer adds none


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Collectives issued inside are timed as something else already: a bucket's (a comm
    hook's), ZeRO-1's parameter broadcasts, an FSDP unit's, a functional collective's
    own inner calls."""
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


def functional_caller_name(fn: str, frame) -> str:
    """Who issued functional collective ``fn``: the first caller outside torch's
    distributed internals (``clip_grad_norm_``'s all-reduce of DTensor norms reads
    ``all_reduce (torch.nn.utils.clip_grad._get_total_norm)``, in torchtitan's too), named
    as ``caller_name`` does."""
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_INSIDE):
        frame = frame.f_back
    return caller_name(fn, frame)


class CollectiveTimer:
    """Times the collectives into ``recorder`` (the protocol in the module's docstring)
    under ``guard``, leaving out those on ``own_groups`` (ddpscope's) and those called
    straight from a module named in ``passed_over`` or inside one (DeepSpeed's communication
    backend, ``deepspeed.comm``, whose every collective its tap times already; checked
    first, one frame read: such a call costs ~1.7 µs more than untraced, measured around a
    no-op collective). ``remove()`` undoes it (idempotent).
    Does nothing where another timer is attached."""

    def __init__(self, recorder, guard: HookGuard, own_groups: tuple = (), host_clock: bool = True,
                 passed_over: tuple[str, ...] = ()) -> None:
        global _active
        self.originals: dict[tuple[Any, str], Any] = {}
        self._thread = threading.get_ident()
        self._recorder, self._guard, self._host_clock = recorder, guard, host_clock
        self._own_groups = tuple(g for g in own_groups if g is not None)
        self._passed_over = tuple(passed_over)
        self._inside_passed = tuple(f"{m}." for m in passed_over)  # their submodules
        # a functional collective's output tensor (id) -> (a reference to it, its record, tensors still to wait)
        self._pending: dict[int, tuple[weakref.ref, Any, list[int]]] = {}
        if _active is not None:
            return
        _active = self
        for fn, args in TIMED.items():
            self._replace(dist, fn, lambda original, fn=fn, args=args: self._wrap(fn, args, original))
        # the functional collectives only where the script has them already (DTensor, FSDP2 and
        # torchtitan import them): importing them registers autograd formulas and DeviceMesh in
        # a job that had neither
        funcol = sys.modules.get(_FUNCOL)
        if funcol is None:
            return
        for fn in FUNCTIONAL:
            self._replace(funcol, fn, lambda original, fn=fn: self._wrap_functional(fn, original))
        self._replace(funcol, "wait_tensor", self._wrap_wait)

    def _replace(self, module, fn: str, make) -> None:
        original = getattr(module, fn, None)
        if original is None:
            return
        self.originals[(module, fn)] = original
        timed = make(original)
        timed._ddpscope_timer = self
        setattr(module, fn, timed)

    def _recording(self) -> bool:
        return (self._guard.broken is None and threading.get_ident() == self._thread
                and not getattr(_local, "quiet", 0))

    def _passed(self, frame) -> bool:
        """The call comes straight from a module whose collectives are timed elsewhere
        (asked only where ``passed_over`` names one: no frame read otherwise)."""
        name = frame.f_globals.get("__name__", "")
        return name in self._passed_over or name.startswith(self._inside_passed)

    def _start(self, name: str, nbytes: int, op: str, message: int):
        try:
            return self._recorder.on_own_start(name, nbytes, op=op, message_bytes=message)
        except Exception as e:  # noqa: BLE001 - the collective goes on; this rank stops tracing
            self._guard.fail(e)
            return None

    def _call(self, fn: str, *args, **kwargs) -> None:
        """Call the recorder's ``fn``; an error of ours stops tracing on this rank, not the job."""
        try:
            getattr(self._recorder, fn)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self._guard.fail(e)

    def _wrap(self, fn: str, arg_names: tuple[str, ...], original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            if (torch.compiler.is_compiling() or not self._recording()
                    or (self._passed_over and self._passed(sys._getframe(1)))):
                return original(*args, **kwargs)
            try:
                given = signature.bind_partial(*args, **kwargs).arguments
            except TypeError:  # arguments the function refuses: its own error, as the script would have it
                return original(*args, **kwargs)
            rec = None
            try:
                if given.get("group") not in self._own_groups:
                    tensors = [given.get(a) for a in arg_names]
                    rec = self._start(caller_name(fn, sys._getframe(1)), _nbytes(tensors[0]) if tensors else 0, fn,
                                      max((_nbytes(t) for t in tensors), default=0))
            except Exception as e:  # noqa: BLE001 - the collective goes on; this rank stops tracing
                self._guard.fail(e)
            if rec is None:
                return original(*args, **kwargs)
            try:
                result = original(*args, **kwargs)
            except BaseException:
                self._call("on_own_return", rec, True)
                raise
            if result is None or not self._host_clock:  # done on return (or, on a device clock, launched)
                self._call("on_own_return", rec, True, launch_only=result is not None)
                return result
            self._call("on_own_return", rec, False)
            try:  # an async_op's Work: done when its future completes
                result.get_future().then(lambda f: self._call("on_own_end", rec))
            except Exception:  # noqa: BLE001 - no future: the launch is what is known
                self._call("on_own_end", rec)
            return result

        return timed

    def _wrap_functional(self, fn: str, original):
        @functools.wraps(original)
        def timed(*args, **kwargs):
            if (torch.compiler.is_compiling() or not self._recording()
                    or (self._passed_over and self._passed(sys._getframe(1)))):
                return original(*args, **kwargs)
            try:
                tensor = kwargs.get("self", args[0] if args else None)
                size = _nbytes(tensor)
                rec = self._start(functional_caller_name(fn, sys._getframe(1)), size, fn, size)
            except Exception as e:  # noqa: BLE001
                self._guard.fail(e)
                rec = None
            if rec is None:
                return original(*args, **kwargs)
            try:
                with quiet():  # all_gather_tensor calls all_gather_single: one collective
                    result = original(*args, **kwargs)
            except BaseException:
                self._call("on_own_return", rec, True)
                raise
            outputs = result if isinstance(result, (list, tuple)) else [result]
            waiting = [o.elem for o in outputs if getattr(o, "completed", True) is False and hasattr(o, "elem")]
            message = max(size, _nbytes(list(outputs)))
            if not waiting:  # it waited itself (a gather along another dim concatenates): over
                self._call("on_own_return", rec, True, message_bytes=message)
                return result
            self._call("on_own_return", rec, False, message_bytes=message)
            ids = [id(t) for t in waiting]
            for t in waiting:
                self._pending[id(t)] = (weakref.ref(t), rec, ids)
            if len(self._pending) > 4096:  # outputs dropped unwaited: forget the dead
                self._pending = {k: v for k, v in self._pending.items() if v[0]() is not None}
            return result

        return timed

    def _wrap_wait(self, original):
        @functools.wraps(original)
        def wait_tensor(tensor, *args, **kwargs):
            entry = self._pending.get(id(tensor)) if self._pending else None
            if entry is None or entry[0]() is not tensor or threading.get_ident() != self._thread:
                return original(tensor, *args, **kwargs)
            del self._pending[id(tensor)]
            _, rec, ids = entry
            self._call("on_own_wait", rec, True)
            try:
                return original(tensor, *args, **kwargs)
            finally:
                ids.remove(id(tensor))
                if not ids:  # its last tensor waited for: the collective is over
                    self._call("on_own_end", rec)
                self._call("on_own_wait", rec, False)

        return wait_tensor

    def remove(self) -> None:
        global _active
        for (module, fn), original in self.originals.items():
            if getattr(getattr(module, fn, None), "_ddpscope_timer", None) is self:  # nobody replaced it since
                setattr(module, fn, original)
        self.originals = {}
        self._pending = {}
        if _active is self:
            _active = None
