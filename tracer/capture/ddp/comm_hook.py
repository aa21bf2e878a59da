"""DDP's communication hook, timed: each bucket's all-reduce from launch to completion.

The communication hook keeps DDP's semantics exactly. Without a hook of the user's, it
does what DDP's default (and ``default_hooks.allreduce_hook``) does: divide the bucket
by the group size and sum it with one all-reduce; its completion callback only takes a
timestamp. It works with ``gradient_as_bucket_view`` either way, because it reduces
``bucket.buffer()`` in place and hands that same tensor back. When the script registers
its own hook afterwards (``bf16_compress_hook``, PowerSGD, a framework's), ours calls it
unchanged and times the future it returns: launch when DDP hands the bucket over,
completion when that future completes.

DDP's ``register_comm_hook`` and ``_register_builtin_comm_hook`` are replaced on the
class, with their signatures, and hand every model ddpscope does not trace to DDP's own.
The hook runs under the tracer's ``HookGuard``: an error of ddpscope's stops tracing on
that rank, never the bucket's reduction.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer.capture.collective_timer import quiet
from ddpscope.tracer.capture.hook_guard import HookGuard

STATE_ATTR = "_ddpscope_comm_state"  # the traced model's CommHookState, on the DDP instance


class CommHookState:
    """What DDP passes to the hook. ``recorder`` is None while no tracer is attached
    (DDP cannot unregister a hook; detached, it is a plain averaging all-reduce, or the
    user's hook). ``inner``: the user's ``(hook, state)``, registered after ours."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.recorder = None
        self.keep_work = False
        self.inner: tuple[Callable, Any] | None = None
        self.user_hook = False  # the script registered a hook (DDP takes one)
        self.registered = False  # ours is DDP's hook (the compiled capture registers none)
        self.before_register: Callable[[], None] | None = None  # the compiled capture steps aside
        # the compiled capture: registers one of DDP's built-in C++ hooks as it is (True), or not
        self.builtin_direct: Callable[[Any], bool] | None = None
        self.builtin: str | None = None  # the built-in hook registered so (its name)
        self.guard = HookGuard()  # the tracer's, while one is attached


def _first_tensor(value: Any) -> torch.Tensor:
    # A hook's future holds the bucket's new value: a tensor, or a one-tensor list when
    # the hook returned a Work's future as it is.
    return value[0] if isinstance(value, (list, tuple)) else value


def traced_allreduce_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    recorder = state.recorder
    rec = None
    if recorder is not None and state.guard.broken is None:
        try:
            rec = recorder.on_bucket_launch(bucket.index(), bucket.buffer(), bucket)
            clock = recorder.clock
        except Exception as e:  # noqa: BLE001 - the bucket is reduced all the same
            state.guard.fail(e)
            rec = None
    work = None
    with quiet():  # the bucket's collectives, not the step's own
        if state.inner is not None:
            hook, hook_state = state.inner
            fut = hook(hook_state, bucket)
        else:
            buffer = bucket.buffer()
            buffer.div_(dist.get_world_size(state.group))  # average, as DDP's default does
            work = dist.all_reduce(buffer, group=state.group, async_op=True)
            fut = work.get_future()
    if rec is None:
        return fut.then(lambda f: _first_tensor(f.value()))
    if state.keep_work and work is not None:
        rec.work = work

    def _done(f: torch.futures.Future) -> torch.Tensor:
        try:
            rec.done = clock.stamp()  # the only thing the callback does besides passing through
        except Exception:  # noqa: BLE001 - a failed stamp leaves the bucket untimed, never failed
            pass
        return _first_tensor(f.value())

    return fut.then(_done)


# DDP checks these annotations by identity; under postponed evaluation they are strings.
traced_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def _register(ddp: DDP, state: CommHookState) -> None:
    if not state.registered:
        if state.before_register is not None:
            state.before_register()
        ddp_register_comm_hook(ddp, state, traced_allreduce_hook)  # DDP's own
        state.registered = True


class CommHookTaken(RuntimeError):
    """The model's communication hook was registered before ddpscope could wrap it."""


def attach_comm_hook(ddp: DDP, register: bool = True) -> CommHookState:
    """Register the traced hook on ``ddp`` once; later tracers reuse its state. A hook the
    script registers afterwards (``register_comm_hook`` or a built-in one) is wrapped:
    ours calls it and times its future. ``register=False`` (the compiled capture times
    the all-reduces itself): ours is registered only when the script registers one, its
    hook's collectives may bypass the reducer's process group."""
    state = getattr(ddp, STATE_ATTR, None)
    if state is not None:
        if register:
            _register(ddp, state)
        return state
    if getattr(ddp, "_comm_hooks", None):
        hook = ddp._comm_hooks[0][0]
        raise CommHookTaken(
            f"this DDP model already has a communication hook ({getattr(hook, '__qualname__', hook)}), "
            "registered before the tracer: DDP takes one hook only. Start DDPTracer before register_comm_hook "
            "(ddpscope then wraps and times your hook), or run the script under `ddpscope run`"
        )
    _shadow_hook_registration()
    state = CommHookState(ddp.process_group)
    if register:
        _register(ddp, state)
    setattr(ddp, STATE_ATTR, state)
    return state


def _claim(state: CommHookState) -> None:
    if state.user_hook:  # DDP's own rule and message
        raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
    state.user_hook = True


def _wrap_user_hook(ddp: DDP, comm: CommHookState, state: object, hook: Callable) -> None:
    """The script's hook, for a model ddpscope traces: it runs inside ddpscope's, which
    times the future it returns (DDP's checks, logging and bookkeeping as DDP does them)."""
    ddp._check_comm_hook(hook)  # DDP's errors reach the script as they are
    _claim(comm)
    try:
        _register(ddp, comm)
    except Exception as e:  # noqa: BLE001 - ddpscope's failure: tracing stops, the hook is DDP's
        comm.guard.fail(e)
        if not comm.registered:  # ours never reached the reducer: the script's goes there as it is
            ddp_register_comm_hook(ddp, state, hook)
            return
    if ddp.logger is not None:
        ddp.logger._set_comm_hook_name(hook.__qualname__)
    ddp._comm_hooks.append((hook, state))
    comm.inner = (hook, state)


def _wrap_builtin_hook(ddp: DDP, comm: CommHookState, comm_hook_type) -> None:
    """The built-in C++ hooks: as they are where the compiled capture times the reducer's
    group (their all-reduces go there), else as their Python twins (same arithmetic,
    same order)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS and not comm.user_hook and comm.builtin_direct:
        try:
            direct = comm.builtin_direct(comm_hook_type)
        except Exception as e:  # noqa: BLE001 - ddpscope's failure: its Python twin below
            comm.guard.fail(e)
            direct = False
        if direct:
            comm.user_hook, comm.builtin = True, comm_hook_type.name
            return
    if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
        _wrap_user_hook(ddp, comm, ddp.process_group, default_hooks.fp16_compress_hook)
    elif comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
        _claim(comm)  # DDP's own averaging all-reduce, which ours already is
    else:
        raise ValueError(f"ddpscope cannot trace DDP's built-in hook {comm_hook_type}")


def _unshadowed(method: Callable) -> Callable:
    return method.__wrapped__ if getattr(method, "_ddpscope", False) else method


# DDP's own methods (ddpscope's shadows on the class hand every model it does not trace here)
ddp_register_comm_hook = _unshadowed(DDP.register_comm_hook)
ddp_register_builtin_comm_hook = _unshadowed(DDP._register_builtin_comm_hook)


def _shadow_hook_registration() -> None:
    """Replace DDP's two hook-registering methods on the class, once, by ones with the same
    signatures that send a traced model's hook to ddpscope (which wraps and times it) and
    any other model's to DDP's own. On the class, not the instance: frameworks call
    ``model.register_comm_hook(state=..., hook=...)`` and scripts may call
    ``DistributedDataParallel.register_comm_hook(model, ...)``; every form binds as DDP's."""
    if getattr(DDP.register_comm_hook, "_ddpscope", False):
        return

    @functools.wraps(ddp_register_comm_hook)
    def register_comm_hook(self, state: object, hook: Callable) -> None:
        comm = getattr(self, STATE_ATTR, None)
        if comm is None:
            return ddp_register_comm_hook(self, state, hook)
        return _wrap_user_hook(self, comm, state, hook)

    @functools.wraps(ddp_register_builtin_comm_hook)
    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        comm = getattr(self, STATE_ATTR, None)
        if comm is None:
            return ddp_register_builtin_comm_hook(self, comm_hook_type)
        return _wrap_builtin_hook(self, comm, comm_hook_type)

    register_comm_hook._ddpscope = _register_builtin_comm_hook._ddpscope = True
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook
