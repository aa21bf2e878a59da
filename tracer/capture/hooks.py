"""The hooks that feed the recorder: DDP communication hook, gradient-ready hooks,
forward hooks on the DDP module, and optimizer step hooks.

The communication hook keeps DDP's semantics exactly: like DDP's default (and
``default_hooks.allreduce_hook``) it divides the bucket by the group size and sums it
with one all-reduce; its completion callback only takes a timestamp. It works with
``gradient_as_bucket_view`` either way, because it reduces ``bucket.buffer()`` in place
and hands that same tensor back.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

_STATE_ATTR = "_ddpscope_comm_state"


class CommHookState:
    """What DDP passes to the hook. ``recorder`` is None while no tracer is attached
    (DDP cannot unregister a hook; detached, it is a plain averaging all-reduce)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.recorder = None
        self.keep_work = False


def traced_allreduce_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    recorder = state.recorder
    buffer = bucket.buffer()
    rec = None if recorder is None else recorder.on_bucket_launch(bucket.index(), buffer, bucket)
    buffer.div_(dist.get_world_size(state.group))  # average, as DDP's default does
    work = dist.all_reduce(buffer, group=state.group, async_op=True)
    if rec is None:
        return work.get_future().then(lambda fut: fut.value()[0])
    if state.keep_work:
        rec.work = work
    clock = recorder.clock

    def _done(fut: torch.futures.Future) -> torch.Tensor:
        rec.done = clock.stamp()  # the only thing the callback does besides passing through
        return fut.value()[0]

    return work.get_future().then(_done)


# DDP checks these annotations by identity; under postponed evaluation they are strings.
traced_allreduce_hook.__annotations__.update(
    bucket=dist.GradBucket, **{"return": torch.futures.Future[torch.Tensor]}
)


def attach_comm_hook(ddp: DDP) -> CommHookState:
    """Register the traced hook on ``ddp`` once; later tracers reuse its state."""
    state = getattr(ddp, _STATE_ATTR, None)
    if state is not None:
        return state
    if getattr(ddp, "_comm_hooks", None):
        raise RuntimeError(
            "this DDP model already has a communication hook; ddpscope needs its own "
            "to time each bucket. Trace the model without your hook."
        )
    state = CommHookState(ddp.process_group)
    ddp.register_comm_hook(state, traced_allreduce_hook)
    setattr(ddp, _STATE_ATTR, state)
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


def attach_hooks(ddp: DDP, params: list[torch.nn.Parameter], optimizer, recorder, handles: HookHandles) -> None:
    """Forward, output-gradient, gradient-ready and optimizer hooks, all into ``recorder``."""
    will_rebuild = _will_rebuild_buckets(ddp)

    def pre_forward(module, args):
        if torch.is_grad_enabled():  # evaluation forwards are not training steps
            recorder.on_forward_start()

    def post_forward(module, args, output):
        if not torch.is_grad_enabled():
            return
        warmup = will_rebuild and not getattr(module, "_has_rebuilt_buckets", True)
        recorder.on_forward_end(warmup)
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(_output_grad_hook)

    def _output_grad_hook(grad):
        recorder.on_output_grad()  # first gradient w.r.t. the model output: backward has begun

    handles.add(ddp.register_forward_pre_hook(pre_forward))
    handles.add(ddp.register_forward_hook(post_forward))
    for i, p in enumerate(params):
        handles.add(p.register_post_accumulate_grad_hook(_grad_hook(recorder, i)))
    if optimizer is not None:
        handles.add(optimizer.register_step_pre_hook(lambda opt, a, kw: recorder.on_optimizer_start()))
        handles.add(optimizer.register_step_post_hook(lambda opt, a, kw: recorder.on_optimizer_end()))


def _grad_hook(recorder, index: int) -> Callable:
    def hook(param):
        recorder.on_grad_ready(index)

    return hook
