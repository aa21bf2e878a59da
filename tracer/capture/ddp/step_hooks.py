"""DDP's step hooks, all into the recorder: forward pre and post hooks on the DDP module
(a step and its passes), a hook on the model output's gradient (backward has begun), a
gradient-ready hook per parameter, and the optimizer's step hooks (the model's optimizer,
or the one found at its first step), with ZeRO-1's parameter sync.

Every hook returns what PyTorch expects of it (None) and runs under a ``HookGuard``: an
error of ddpscope's inside one stops tracing on that rank, never the training step.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer.capture.ddp.param_sync import attach_param_sync
from ddpscope.tracer.capture.ddp.reducer import will_rebuild_buckets
from ddpscope.tracer.capture.hook_guard import HookGuard, HookHandles, attach_optimizer_finder, guarded


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def attach_hooks(ddp: DDP, params: list[torch.nn.Parameter], optimizer, recorder, handles: HookHandles,
                 guard: HookGuard, grad_hooks: bool = True) -> None:
    """Forward, output-gradient, gradient-ready and optimizer hooks, all into ``recorder``.
    ``optimizer``: the model's optimizer, None (steps end at the next forward), or
    ``"auto"``: found at its first step (the optimizer that updates these parameters).
    ``grad_hooks=False``: the compiled capture stamps gradient-ready times in C++.
    Every hook returns None (what PyTorch expects of each) and runs under ``guard``."""
    will_rebuild = will_rebuild_buckets(ddp)
    # DDP's first iteration is a warm-up whatever its bucket policy (its lazy init, the first
    # allocations and connections; Hugging Face Trainer's 43 ms vs 19 ms after): marked even where
    # DDP never rebuilds its buckets (find_unused_parameters=True). Read at attach: a DDP that
    # already ran before tracing began has had its first iteration.
    first_iteration = not getattr(ddp, "_lazy_init_ran", True)

    def pre_forward(module, args) -> None:
        if guard.broken is None and torch.is_grad_enabled():  # evaluation forwards are not training steps
            try:  # under no_sync() DDP does not reduce this pass's gradients (accumulation)
                recorder.on_forward_start(sync=bool(getattr(module, "require_backward_grad_sync", True)))
            except Exception as e:  # noqa: BLE001
                guard.fail(e)

    def post_forward(module, args, output) -> None:
        if guard.broken is not None or not torch.is_grad_enabled() or recorder.current is None:
            return
        nonlocal first_iteration
        try:
            warmup = first_iteration or (will_rebuild and not getattr(module, "_has_rebuilt_buckets", True))
            first_iteration = False
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
        attach_optimizer_finder(params, recorder, handles, guard,
                                on_found=lambda opt: attach_param_sync(opt, recorder, handles, guard))
    elif optimizer is not None:
        handles.add(optimizer.register_step_pre_hook(guarded(guard, lambda opt: recorder.on_optimizer_start())))
        handles.add(optimizer.register_step_post_hook(guarded(guard, lambda opt: recorder.on_optimizer_end())))
        attach_param_sync(optimizer, recorder, handles, guard)


def attach_grad_hooks(params: list[torch.nn.Parameter], recorder, handles: HookHandles, guard: HookGuard) -> None:
    """A Python hook per parameter, run when its gradient is accumulated."""
    for i, p in enumerate(params):
        handles.add(p.register_post_accumulate_grad_hook(_grad_hook(recorder, i, guard)))


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
