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
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

_STATE_ATTR = "_ddpscope_comm_state"


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


def _first_tensor(value: Any) -> torch.Tensor:
    # A hook's future holds the bucket's new value: a tensor, or a one-tensor list when
    # the hook returned a Work's future as it is.
    return value[0] if isinstance(value, (list, tuple)) else value


def traced_allreduce_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    recorder = state.recorder
    rec = None if recorder is None else recorder.on_bucket_launch(bucket.index(), bucket.buffer(), bucket)
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
    clock = recorder.clock

    def _done(f: torch.futures.Future) -> torch.Tensor:
        rec.done = clock.stamp()  # the only thing the callback does besides passing through
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
        DDP.register_comm_hook(ddp, state, traced_allreduce_hook)  # DDP's own, not our shadow
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
    state = CommHookState(ddp.process_group)
    if register:
        _register(ddp, state)
    setattr(ddp, _STATE_ATTR, state)

    def claim() -> None:
        if state.user_hook:  # DDP's own rule and message
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        state.user_hook = True

    def register_comm_hook(state_: object, hook: Callable) -> None:
        """DDP's ``register_comm_hook``, for a model ddpscope traces: the hook runs
        inside ddpscope's, which times the future it returns."""
        ddp._check_comm_hook(hook)
        claim()
        _register(ddp, state)
        if ddp.logger is not None:
            ddp.logger._set_comm_hook_name(hook.__qualname__)
        ddp._comm_hooks.append((hook, state_))
        state.inner = (hook, state_)

    def register_builtin_comm_hook(comm_hook_type) -> None:
        """The built-in C++ hooks: as they are where the compiled capture times the
        reducer's group (their all-reduces go there), else as their Python twins (same
        arithmetic, same order)."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        if (comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS and not state.user_hook
                and state.builtin_direct is not None and state.builtin_direct(comm_hook_type)):
            state.user_hook, state.builtin = True, comm_hook_type.name
            return
        if comm_hook_type == dist.BuiltinCommHookType.FP16_COMPRESS:
            register_comm_hook(ddp.process_group, default_hooks.fp16_compress_hook)
        elif comm_hook_type == dist.BuiltinCommHookType.ALLREDUCE:
            claim()  # DDP's own averaging all-reduce, which ours already is
        else:
            raise ValueError(f"ddpscope cannot trace DDP's built-in hook {comm_hook_type}")

    # Instance attributes shadow DDP's methods for this model only: frameworks call
    # ``model.register_comm_hook(...)`` after wrapping (Lightning, Accelerate).
    ddp.register_comm_hook = register_comm_hook
    ddp._register_builtin_comm_hook = register_builtin_comm_hook
    return state


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
                 grad_hooks: bool = True) -> None:
    """Forward, output-gradient, gradient-ready and optimizer hooks, all into ``recorder``.
    ``optimizer``: the model's optimizer, None (steps end at the next forward), or
    ``"auto"``: found at its first step (the optimizer that updates these parameters).
    ``grad_hooks=False``: the compiled capture stamps gradient-ready times in C++."""
    will_rebuild = _will_rebuild_buckets(ddp)

    def pre_forward(module, args):
        if torch.is_grad_enabled():  # evaluation forwards are not training steps
            # under no_sync() DDP does not reduce this pass's gradients (accumulation)
            recorder.on_forward_start(sync=bool(getattr(module, "require_backward_grad_sync", True)))

    def post_forward(module, args, output):
        if not torch.is_grad_enabled() or recorder.current is None:
            return
        warmup = will_rebuild and not getattr(module, "_has_rebuilt_buckets", True)
        recorder.on_forward_end(warmup)
        step, k = recorder.current, len(recorder.current.passes) - 1
        hook = _output_grad_hook(recorder, step, k)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(hook)

    handles.add(ddp.register_forward_pre_hook(pre_forward))
    handles.add(ddp.register_forward_hook(post_forward))
    if grad_hooks:
        attach_grad_hooks(params, recorder, handles)
    if optimizer == "auto":
        _attach_optimizer_finder(params, recorder, handles)
    elif optimizer is not None:
        handles.add(optimizer.register_step_pre_hook(lambda opt, a, kw: recorder.on_optimizer_start()))
        handles.add(optimizer.register_step_post_hook(lambda opt, a, kw: recorder.on_optimizer_end()))


def attach_grad_hooks(params: list[torch.nn.Parameter], recorder, handles: HookHandles) -> None:
    """A Python hook per parameter, run when its gradient is accumulated."""
    for i, p in enumerate(params):
        handles.add(p.register_post_accumulate_grad_hook(_grad_hook(recorder, i)))


def _attach_optimizer_finder(params: list[torch.nn.Parameter], recorder, handles: HookHandles) -> None:
    """Global optimizer step hooks that pick the optimizer updating ``params`` (the first
    one whose parameter groups hold any of them) and feed its steps to ``recorder``."""
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
        return verdict[key]

    handles.add(register_optimizer_step_pre_hook(lambda opt, a, kw: ours(opt) and recorder.on_optimizer_start()))
    handles.add(register_optimizer_step_post_hook(lambda opt, a, kw: ours(opt) and recorder.on_optimizer_end()))


def _output_grad_hook(recorder, step, k: int) -> Callable:
    def hook(grad):
        recorder.on_output_grad(step, k)  # first gradient w.r.t. the model output: backward has begun

    return hook


def _grad_hook(recorder, index: int) -> Callable:
    def hook(param):
        recorder.on_grad_ready(index)

    return hook
