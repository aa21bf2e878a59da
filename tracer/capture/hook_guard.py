"""What every tracer's hooks share (DDP's, FSDP2's): the guard that keeps an error of
ddpscope's out of training (``HookGuard``), the handles that remove them, optimizer step
hooks run under the guard, and the optimizer found at its first step."""

from __future__ import annotations

from typing import Any, Callable

import torch


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


class HookHandles:
    def __init__(self) -> None:
        self._handles: list[Any] = []

    def add(self, handle: Any) -> None:
        self._handles.append(handle)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def guarded(guard: HookGuard, body: Callable[[Any], Any]) -> Callable:
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


def attach_optimizer_finder(params: list[torch.nn.Parameter], recorder, handles: HookHandles, guard: HookGuard,
                            on_found: Callable[[Any], None] | None = None) -> None:
    """Global optimizer step hooks that pick the optimizer updating ``params`` (the first
    one whose parameter groups hold any of them to step) and feed its steps to
    ``recorder``. Every other optimizer (a second model's, a ZeroRedundancyOptimizer's
    inner one, stepped inside the outer step) is left alone. ``on_found(optimizer)``: once,
    when it is found (DDP times ZeRO-1's parameter broadcasts from there)."""
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
                if on_found is not None:
                    on_found(opt)
        return verdict[key]

    def start(opt) -> None:
        if ours(opt):
            recorder.on_optimizer_start()

    def end(opt) -> None:
        if ours(opt):
            recorder.on_optimizer_end()

    handles.add(register_optimizer_step_pre_hook(guarded(guard, start)))
    handles.add(register_optimizer_step_post_hook(guarded(guard, end)))


def autograd_running() -> bool:
    """Whether autograd's engine is executing a backward on this thread now: a hook's
    phase from autograd itself, not from which hook ran last (a loss that calls its own
    ``backward()`` inside forward; a forward recomputed by activation checkpointing).
    The graph task's id is -1 outside a backward."""
    return _graph_task_id() != -1


# private to torch (torch/csrc/autograd/init.cpp, torch >= 1.13): without it, never in backward
_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)
