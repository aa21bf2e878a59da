"""Where the sharded recorder hears from FSDP2: per unit, on that unit's own objects.

- Each unit's ``FSDPParamGroup`` gets instance attributes that shadow ``pre_forward``,
  ``post_forward``, ``pre_backward``, ``post_backward`` and ``wait_for_unshard``: FSDP
  calls them through the instance, so the wrapper runs and calls FSDP's own method with
  the same arguments and returns what it returns. Other FSDP models in the process are
  not touched.
- Each unit's all-gather and reduce-scatter objects (``_all_gather_comm``,
  ``_reduce_scatter_comm``) get a subclass of their own class (``isinstance`` checks in
  FSDP still hold) whose ``__call__`` times the collective and counts its bytes.
- The root module gets a forward pre-hook (prepended: the step starts before the root's
  all-gather) and a forward hook that runs even when forward raises. A hook prepended
  after ours that runs FSDP's own first (``FSDPMemTracker`` re-registers FSDP's, prepended)
  would put the root's all-gather before the step: the root unit's ``pre_forward`` then
  starts the pass itself.
- HSDP (units replicated across a mesh dimension): FSDP's gradient all-reduce across
  replicas is a plain ``dist.all_reduce`` inside ``_fsdp_collectives.foreach_reduce``.
  That module's ``dist`` name is pointed at a stand-in that is ``torch.distributed`` in
  every name but ``all_reduce``, which it times while a traced unit's post-backward
  runs (anything else's all-reduce passes straight through); put back at detach.

``detach()`` takes every one of these away again (instance attributes deleted, classes
restored, hook handles removed). Every wrapper runs under the tracer's ``HookGuard``:
an error of ddpscope's stops tracing on this rank, never the unit's work, which always
runs exactly once.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from ddpscope.tracer.capture.collective_timer import quiet
from ddpscope.tracer.capture.hook_guard import HookGuard, HookHandles
from ddpscope.tracer.capture.sharded.recorder import BACKWARD, FORWARD, ROOT, ShardedRecorder
from ddpscope.tracer.capture.sharded.units import Unit

GROUP_METHODS = ("pre_forward", "post_forward", "pre_backward", "post_backward", "wait_for_unshard")
COMM_ATTRS = {"_all_gather_comm": "all_gather", "_reduce_scatter_comm": "reduce_scatter"}
#: autograd's entry points a script calls (each cut: what runs inside is backward)
BACKWARD_CALLS = ("backward", "grad")


class FSDPHooks:
    """Attaches the recorder to one FSDP2 model's units; ``detach()`` undoes it all."""

    def __init__(self, root_module: torch.nn.Module, units: list[Unit], recorder: ShardedRecorder,
                 guard: HookGuard, on_measured_forward: tuple[Callable[[], bool], Callable[[], None]] | None = None,
                 on_backward_end: Callable[[], None] | None = None) -> None:
        self.root = root_module
        self.units = units
        self.rec = recorder
        self.guard = guard
        self.handles = HookHandles()
        self._patched_groups: list[Any] = []
        self._patched_comms: list[tuple[Any, type]] = []
        self._activations = on_measured_forward  # (start, stop) of activation counting
        self._counting = False
        self._on_backward_end = on_backward_end
        self._queued = False
        self._in_pass = False  # a training forward of the root is running (its pass started)
        self.current_issuer: int | None = None  # the unit whose hook issues the next all-gather
        self.reducing_unit: int | None = None  # the traced unit whose post-backward runs now
        self._collectives_module = None  # _fsdp_collectives, while its ``dist`` is our stand-in

    # -- attach / detach ------------------------------------------------------------
    def attach(self) -> None:
        for unit in self.units:
            group = unit.group
            for name in GROUP_METHODS:
                original = getattr(type(group), name)
                setattr(group, name, functools.wraps(original)(getattr(self, f"_make_{name}")(unit, original)))
            self._patched_groups.append(group)
            for attr, kind in COMM_ATTRS.items():
                comm = getattr(group, attr, None)
                if comm is not None and not getattr(type(comm), "_ddpscope", False):
                    self._patched_comms.append((comm, type(comm)))
                    comm.__class__ = _timed_class(type(comm), kind)
                    comm._ddpscope_timing = (self, unit.index)
        if any(unit.replicated for unit in self.units):
            from torch.distributed.fsdp._fully_shard import _fsdp_collectives

            if _fsdp_collectives.dist is torch.distributed:  # not already stood in for (another model's tracer)
                _fsdp_collectives.dist = _ReplicaAllReduce(self)
                self._collectives_module = _fsdp_collectives
        self._patch_backward_calls()
        self.handles.add(self.root.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self.handles.add(self.root.register_forward_hook(self._root_post_forward, always_call=True))

    def detach(self) -> None:
        self.handles.remove()
        for name in BACKWARD_CALLS:
            fn = getattr(torch.autograd, name)
            if getattr(fn, "_ddpscope_hooks", None) is self:  # nobody replaced it since
                setattr(torch.autograd, name, fn.__wrapped__)
        for group in self._patched_groups:
            for name in GROUP_METHODS:
                group.__dict__.pop(name, None)
        self._patched_groups.clear()
        for comm, cls in self._patched_comms:
            if type(comm).__mro__[1] is cls:  # still our subclass: nobody replaced it since
                comm.__class__ = cls
            comm.__dict__.pop("_ddpscope_timing", None)
        self._patched_comms.clear()
        module, self._collectives_module = self._collectives_module, None
        if module is not None and isinstance(module.dist, _ReplicaAllReduce) and module.dist.hooks is self:
            module.dist = torch.distributed
        self._stop_counting()

    def _patch_backward_calls(self) -> None:
        """Each call of autograd's backward (``torch.autograd.backward``, which
        ``Tensor.backward`` calls, and ``torch.autograd.grad``) cuts the unit's time: what
        runs inside is backward. Same signature, arguments, return and exceptions."""
        for name in BACKWARD_CALLS:
            original = getattr(torch.autograd, name)

            def call(*args, _original=original, **kwargs):
                self._safe(self.rec.on_backward_call, True)
                try:
                    return _original(*args, **kwargs)
                finally:
                    self._safe(self.rec.on_backward_call, False)

            wrapped = functools.wraps(original)(call)
            wrapped._ddpscope_hooks = self
            setattr(torch.autograd, name, wrapped)

    # -- guarded calls into the recorder ----------------------------------------------
    def _safe(self, fn: Callable, *args) -> Any:
        if self.guard.broken is not None:
            return None
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - training goes on; this rank stops tracing
            self.guard.fail(e)
            return None

    # -- the root's forward: a pass of the step ----------------------------------------
    def _root_pre_forward(self, module, args) -> None:
        if torch.is_grad_enabled() and not self._in_pass:  # evaluation forwards are not training steps
            self._in_pass = True
            reduce_grads = bool(getattr(self.units[0].group, "reduce_grads", True)) if self.units else True
            self._safe(self.rec.on_forward_start, reduce_grads)
            self._queued = False
            if self.rec.current is not None and self.rec.current.measure and self._activations is not None:
                self._counting = bool(self._safe(self._activations[0]))

    def _root_post_forward(self, module, args, output) -> None:
        self._in_pass = False
        self._stop_counting()
        if torch.is_grad_enabled() and self.rec.current is not None:
            self._safe(self.rec.on_forward_end)

    def _stop_counting(self) -> None:
        if self._counting and self._activations is not None:
            self._counting = False
            self._safe(self._activations[1])

    def _queue_backward_end(self) -> None:
        """Once per backward, from inside it: a callback that runs when the engine is done,
        after FSDP's own final callback (queued before, by the root's pre-backward), which
        reduce-scatters what is left and waits for every reduction."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._queued = False
        self._safe(self.rec.on_backward_end)
        if self._on_backward_end is not None:
            self._safe(self._on_backward_end)

    # -- per-unit wrappers ---------------------------------------------------------------
    def _make_pre_forward(self, unit: Unit, original: Callable) -> Callable:
        def pre_forward(module, args, kwargs):
            if unit.index == ROOT and not self._in_pass and self.rec.current is None:
                self._root_pre_forward(self.root, args)  # FSDP's root hook ran before ours: the step starts here
            self._safe(self.rec.enter, unit.index, FORWARD)
            self.current_issuer = unit.index
            return original(unit.group, module, args, kwargs)
        return pre_forward

    def _make_post_forward(self, unit: Unit, original: Callable) -> Callable:
        def post_forward(module, input, output):
            try:
                return original(unit.group, module, input, output)
            finally:
                self._safe(self.rec.leave, unit.index, FORWARD)
        return post_forward

    def _make_pre_backward(self, unit: Unit, original: Callable) -> Callable:
        def pre_backward(default_prefetch, *unused):
            if unit.group._training_state.name != "PRE_BACKWARD":  # FSDP's own no-op otherwise
                self._safe(self.rec.enter, unit.index, BACKWARD)
                self._safe(self._queue_backward_end)
            self.current_issuer = unit.index
            return original(unit.group, default_prefetch, *unused)
        return pre_backward

    def _make_post_backward(self, unit: Unit, original: Callable) -> Callable:
        def post_backward(*unused):
            self.current_issuer = unit.index
            self.reducing_unit = unit.index
            try:
                return original(unit.group, *unused)
            finally:
                self.reducing_unit = None
                self._safe(self.rec.leave, unit.index, BACKWARD)
        return post_backward

    def _make_wait_for_unshard(self, unit: Unit, original: Callable) -> Callable:
        def wait_for_unshard():
            # nothing to wait for: FSDP returns at once; or a shard group of one rank, where no
            # all-gather ran and this is the copy-in of the parameters (cast to their compute
            # dtype): the unit's own work, left in its compute, never a wait for communication
            if unit.group._all_gather_result is None or unit.shard_size == 1:
                return original(unit.group)
            token = self._safe(self.rec.wait_start, unit.index)
            try:
                return original(unit.group)
            finally:
                self._safe(self.rec.wait_end, token)
        return wait_for_unshard

    # -- collectives (called from the timed comm classes) --------------------------------
    def comm_start(self, kind: str, unit: int, nbytes: int) -> Any:
        prefetch = kind == "all_gather" and self.current_issuer is not None and self.current_issuer != unit
        return self._safe(self.rec.comm_start, kind, unit, nbytes, prefetch)

    def comm_end(self, rec: Any, work: Any = None) -> None:
        self._safe(self.rec.comm_end, rec, work)


class _ReplicaAllReduce:
    """``torch.distributed`` as FSDP2's ``_fsdp_collectives`` sees it while an HSDP model is
    traced: every name is torch.distributed's own; ``all_reduce`` (HSDP's across replicas)
    is timed when a traced unit's post-backward issued it, with the same arguments and
    result."""

    def __init__(self, hooks: FSDPHooks) -> None:
        self.hooks = hooks

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.distributed, name)

    def all_reduce(self, tensor, *args, **kwargs):
        unit = self.hooks.reducing_unit
        if unit is None or self.hooks.guard.broken is not None:
            return torch.distributed.all_reduce(tensor, *args, **kwargs)
        rec = self.hooks.comm_start("all_reduce", unit, tensor.numel() * tensor.element_size())
        work = None
        try:
            with quiet():  # this unit's, not one of no unit's (collective_timer)
                work = torch.distributed.all_reduce(tensor, *args, **kwargs)
            return work
        finally:
            self.hooks.comm_end(rec, work)


@functools.cache
def _timed_class(cls: type, kind: str) -> type:
    """A subclass of FSDP's collective class ``cls`` whose call is timed (one per class)."""
    original = cls.__call__

    def __call__(self, *args, **kwargs):
        timing = self.__dict__.get("_ddpscope_timing")
        if timing is None:
            return original(self, *args, **kwargs)
        hooks, unit = timing
        tensor = kwargs.get("output_tensor" if kind == "all_gather" else "input_tensor")
        if tensor is None and args:
            tensor = args[0] if kind == "all_gather" else args[1] if len(args) > 1 else None
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        rec = hooks.comm_start(kind, unit, nbytes)
        work = None
        try:
            with quiet():  # the unit's collective, not one of no unit's (collective_timer)
                work = original(self, *args, **kwargs)
            return work
        finally:
            hooks.comm_end(rec, work)  # an async Work: its end comes from its future

    return type(cls.__name__, (cls,), {"__call__": __call__, "_ddpscope": True,
                                       "__doc__": f"{cls.__name__}, timed by ddpscope", "__module__": cls.__module__})
