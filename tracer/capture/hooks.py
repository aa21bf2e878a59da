"""The hooks that feed the recorder: DDP communication hook, gradient-ready hooks,
forward hooks on the DDP module, and optimizer step hooks.

The communication hook keeps DDP's semantics exactly. Without a hook of the user's, it
does what DDP's default (and ``default_hooks.allreduce_hook``) does: divide the bucket
by the group size and sum it with one all-reduce; its completion callback only takes a
timestamp. It works with ``gradient_as_bucket_view`` either way, because it reduces
``bucket.buffer()`` in place and hands that same tensor back. When the script registers
its own hook afterwards (``bf16_compress_hook``, PowerSGD, a framework's), ours calls it
unchanged and times the future it returns: launch when DDP hands the bucket over,
completion when that future completes.

Every hook keeps what PyTorch expects of it (a forward hook, a tensor hook and an
optimizer step hook return None; the communication hook returns the bucket's future) and
runs under a ``HookGuard``: an error of ddpscope's inside one stops tracing on that rank,
never the training step. DDP's ``register_comm_hook`` and ``_register_builtin_comm_hook``
are replaced on the class, with their signatures, and hand every model ddpscope does not
trace to DDP's own.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

_STATE_ATTR = "_ddpscope_comm_state"


class HookGuard:
    """Keeps the tracer out of training's way: an exception inside one of ddpscope's hooks
    (a tracer bug, an odd model) is caught there, tracing stops (``on_error(reason)``,
    called once) and from then on every hook hands on as if it were not there. Only
    ``Exception`` is caught: the ``SystemExit`` of ``--steps`` is meant to unwind."""

    def __init__(self, on_error: Callable[[str], None] = lambda reason: None) -> None:
        self.broken: str | None = None
        self._on_error = on_error

    def fail(self, error: BaseException) -> None:
        if self.broken is not None:
            return
        self.broken = f"{type(error).__name__}: {str(error)[:300]}"
        try:
            self._on_error(self.broken)
        except Exception:  # noqa: BLE001 - the error report itself must not reach training
            pass


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
    state = getattr(ddp, _STATE_ATTR, None)
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
    setattr(ddp, _STATE_ATTR, state)
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
        comm = getattr(self, _STATE_ATTR, None)
        if comm is None:
            return ddp_register_comm_hook(self, state, hook)
        return _wrap_user_hook(self, comm, state, hook)

    @functools.wraps(ddp_register_builtin_comm_hook)
    def _register_builtin_comm_hook(self, comm_hook_type) -> None:
        comm = getattr(self, _STATE_ATTR, None)
        if comm is None:
            return ddp_register_builtin_comm_hook(self, comm_hook_type)
        return _wrap_builtin_hook(self, comm, comm_hook_type)

    register_comm_hook._ddpscope = _register_builtin_comm_hook._ddpscope = True
    DDP.register_comm_hook = register_comm_hook
    DDP._register_builtin_comm_hook = _register_builtin_comm_hook


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


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _will_rebuild_buckets(ddp: DDP) -> bool:
    # Mirrors Reducer::should_rebuild_buckets: DDP rebuilds its buckets once, after the
    # first iteration, unless it looks for unused parameters on a dynamic graph.
    return bool(getattr(ddp, "static_graph", False) or not getattr(ddp, "find_unused_parameters", False))


class HookHandles:
    def __init__(self) -> None:
        self._handles: list[Any] = []

    def add(self, handle: Any) -> None:
        self._handles.append(handle)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def attach_hooks(ddp: DDP, params: list[torch.nn.Parameter], optimizer, recorder, handles: HookHandles,
                 guard: HookGuard, grad_hooks: bool = True) -> None:
    """Forward, output-gradient, gradient-ready and optimizer hooks, all into ``recorder``.
    ``optimizer``: the model's optimizer, None (steps end at the next forward), or
    ``"auto"``: found at its first step (the optimizer that updates these parameters).
    ``grad_hooks=False``: the compiled capture stamps gradient-ready times in C++.
    Every hook returns None (what PyTorch expects of each) and runs under ``guard``."""
    will_rebuild = _will_rebuild_buckets(ddp)

    def pre_forward(module, args) -> None:
        if guard.broken is None and torch.is_grad_enabled():  # evaluation forwards are not training steps
            try:  # under no_sync() DDP does not reduce this pass's gradients (accumulation)
                recorder.on_forward_start(sync=bool(getattr(module, "require_backward_grad_sync", True)))
            except Exception as e:  # noqa: BLE001
                guard.fail(e)

    def post_forward(module, args, output) -> None:
        if guard.broken is not None or not torch.is_grad_enabled() or recorder.current is None:
            return
        try:
            warmup = will_rebuild and not getattr(module, "_has_rebuilt_buckets", True)
            recorder.on_forward_end(warmup)
            step, k = recorder.current, len(recorder.current.passes) - 1
            hook = _output_grad_hook(recorder, step, k, guard)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(hook)
        except Exception as e:  # noqa: BLE001
            guard.fail(e)

    handles.add(ddp.register_forward_pre_hook(pre_forward))
    handles.add(ddp.register_forward_hook(post_forward))
    if grad_hooks:
        attach_grad_hooks(params, recorder, handles, guard)
    if optimizer == "auto":
        _attach_optimizer_finder(params, recorder, handles, guard)
    elif optimizer is not None:
        handles.add(optimizer.register_step_pre_hook(_guarded(guard, lambda opt: recorder.on_optimizer_start())))
        handles.add(optimizer.register_step_post_hook(_guarded(guard, lambda opt: recorder.on_optimizer_end())))
        attach_param_sync(optimizer, recorder, handles, guard)


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


def _guarded(guard: HookGuard, body: Callable[[Any], Any]) -> Callable:
    """An optimizer step hook ``(optimizer, args, kwargs) -> None`` running ``body(optimizer)``
    under ``guard``. A pre hook must return None or ``(args, kwargs)``: this one never
    returns anything else, whatever ``body`` returns."""
    def hook(opt, args, kwargs) -> None:
        if guard.broken is None:
            try:
                body(opt)
            except Exception as e:  # noqa: BLE001
                guard.fail(e)

    return hook


def attach_grad_hooks(params: list[torch.nn.Parameter], recorder, handles: HookHandles, guard: HookGuard) -> None:
    """A Python hook per parameter, run when its gradient is accumulated."""
    for i, p in enumerate(params):
        handles.add(p.register_post_accumulate_grad_hook(_grad_hook(recorder, i, guard)))


def _attach_optimizer_finder(params: list[torch.nn.Parameter], recorder, handles: HookHandles,
                             guard: HookGuard) -> None:
    """Global optimizer step hooks that pick the optimizer updating ``params`` (the first
    one whose parameter groups hold any of them to step) and feed its steps to
    ``recorder``. Every other optimizer (a second model's, a ZeroRedundancyOptimizer's
    inner one, stepped inside the outer step) is left alone."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    mine = {id(p) for p in params}
    verdict: dict[int, bool] = {}  # id(optimizer) -> updates our parameters

    def ours(opt) -> bool:
        key = id(opt)
        if key not in verdict:
            hit = any(id(p) in mine for g in opt.param_groups for p in g["params"])
            verdict[key] = hit and recorder.optimizer in (None, opt)
            if verdict[key] and recorder.optimizer is None:
                recorder.optimizer = opt  # memory accounting counts its state from now on
                if hasattr(recorder, "on_param_sync_start"):  # a DDP recorder: ZeRO-1 broadcasts
                    attach_param_sync(opt, recorder, handles, guard)
        return verdict[key]

    def start(opt) -> None:
        if ours(opt):
            recorder.on_optimizer_start()

    def end(opt) -> None:
        if ours(opt):
            recorder.on_optimizer_end()

    handles.add(register_optimizer_step_pre_hook(_guarded(guard, start)))
    handles.add(register_optimizer_step_post_hook(_guarded(guard, end)))


def _output_grad_hook(recorder, step, k: int, guard: HookGuard) -> Callable:
    def hook(grad) -> None:  # a tensor hook: None keeps the gradient as it is
        if guard.broken is None:
            try:
                recorder.on_output_grad(step, k)  # first gradient w.r.t. the model output: backward has begun
            except Exception as e:  # noqa: BLE001
                guard.fail(e)

    return hook


def _grad_hook(recorder, index: int, guard: HookGuard) -> Callable:
    def hook(param) -> None:
        if guard.broken is None:
            try:
                recorder.on_grad_ready(index)
            except Exception as e:  # noqa: BLE001
                guard.fail(e)

    return hook
