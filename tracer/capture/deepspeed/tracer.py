"""``DeepSpeedTracer``: trace one DeepSpeed ZeRO engine (stages 1-3) on this rank.

``ddpscope run`` starts it when ``deepspeed.initialize`` returns the engine. The trace
is a sharded trace (kind ``sharded``, ``sharding.framework: "deepspeed"``): the same
step, pass and optimizer spans, collectives on their kind's lane named for the unit
that issued them (``units.py``), waits for ZeRO-3's gathers, memory by category from
ZeRO's partitions (``memory.py``), so every reader of FSDP2's traces reads it.

Where it hooks (docs/deepspeed-design.md), all on this engine's instances, none on
DeepSpeed's classes but the communication backend's (``comm.py``):

- ``engine.forward``: a pass's forward (a step starts at its first forward);
- ``engine._backward_prologue`` / ``_backward_epilogue``: the backward, both for
  ``engine.backward(loss)`` and a bare ``loss.backward()``; the epilogue holds the
  last bucket's reduction, so the backward ends when it returns;
- ``engine.step`` at a gradient-accumulation boundary (read before DeepSpeed moves its
  micro-step counter): the optimizer, and the step's end;
- the optimizer's bucket reduction (stages 1-2 ``reduce_ipg_grads``, stage 3
  ``__reduce_and_partition_ipg_grads``): the bucket's number in the step and its
  parameters;
- ZeRO-3's gather handles' ``wait`` (``AllGatherCoalescedHandle``, ``AllGatherHandle``):
  compute waiting for a unit's parameters (and when the gathers were seen done: ``comm.py``);
- ``torch.distributed``'s collectives called from anywhere but DeepSpeed's backend (the
  script's own all-reduce of its loss): ``collective_timer``, collectives of no unit.

Times are the host's monotonic clock (µs), also on CUDA: DeepSpeed's collectives run on
its own streams there, and these are the times the host launched and waited for them
(said in run.json). Like the other tracers it never raises for what happens at run
time: ``start()`` says why it could not start; an error in one of its wrappers stops
tracing, never training.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch

from ddpscope.tracer.capture.clock import make_clock
from ddpscope.tracer.capture.collective_timer import CollectiveTimer
from ddpscope.tracer.capture.deepspeed.comm import BACKEND, CommTap, bucket_done, bucket_mark
from ddpscope.tracer.capture.deepspeed.engine_facts import ITEMSIZE, offloads_in_use
from ddpscope.tracer.capture.deepspeed.memory import DeepSpeedMemory
from ddpscope.tracer.capture.deepspeed.units import find_units
from ddpscope.tracer.capture.hook_guard import autograd_running
from ddpscope.tracer.capture.live import LiveFile
from ddpscope.tracer.capture.sharded.fsdp_tracer import FSDPTracer, position, trainable_params
from ddpscope.tracer.capture.sharded.own_collectives import OwnCollectives
from ddpscope.tracer.capture.sharded.recorder import BACKWARD, FORWARD, ROOT, ShardedRecorder, ShardedStep
from ddpscope.tracer.capture.tracer_config import TracerConfig

_ENGINE_METHODS = ("forward", "_backward_prologue", "_backward_epilogue", "step")
_BUCKET_METHODS = {1: "reduce_ipg_grads", 2: "reduce_ipg_grads",
                   3: "_DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads"}
_WAIT_HANDLES = ("AllGatherCoalescedHandle", "AllGatherHandle")
_PARTITION_MODULE = "deepspeed.runtime.zero.partition_parameters"


class DeepSpeedTracer(FSDPTracer):
    """Traces the DeepSpeed engine ``engine`` whose settings are ``facts`` (engine_facts)."""

    units_word = "DeepSpeed models"

    def __init__(self, engine, facts: dict, config: TracerConfig, *,
                 on_step: Callable[[ShardedStep], None] | None = None, run_meta: dict | None = None) -> None:
        super().__init__(engine.module, None, config, on_step=on_step, run_meta=run_meta)
        self.engine = engine
        self.facts = facts
        self.tap: CommTap | None = None
        self._patched: list[tuple[Any, str]] = []  # (object, attribute) set on instances, taken off at the end
        self._waits: list[tuple[type, Any]] = []  # (handle class, its own wait) while patched

    # -- start ------------------------------------------------------------------------
    def _attach(self) -> None:
        engine, facts = self.engine, self.facts
        stage = facts.get("zero_stage")
        if stage not in (1, 2, 3):
            raise RuntimeError(f"ZeRO stage {stage}: ddpscope traces DeepSpeed's ZeRO stages 1, 2 and 3")
        backend = getattr(sys.modules.get("deepspeed.comm.comm"), "cdb", None)
        if backend is None:
            raise RuntimeError("DeepSpeed's communication backend (deepspeed.comm's cdb) was not found")
        opt = engine.optimizer
        if not hasattr(opt, _BUCKET_METHODS[stage]):
            raise RuntimeError(f"the ZeRO optimizer ({type(opt).__name__}) has no {_BUCKET_METHODS[stage]}: "
                               "a DeepSpeed ddpscope does not know")
        self.stage = stage
        self.sent_as = None  # what DeepSpeed calls is what the backend runs
        world = int(facts.get("world_size") or 1)
        self.units, unit_of, owner_of = find_units(engine.module, stage, world, ITEMSIZE.get(facts["dtype"], 4))
        self.param_names = {id(p): n for n, p in engine.module.named_parameters()}
        device = next((p.device for p in engine.module.parameters()), torch.device("cpu"))
        used = offloads_in_use(facts)  # below stage 3 an offload_param set is said unused
        to, params_to, set_to = used["optimizer"], used["param"], facts.get("offload_param")
        offload = ((f", optimizer offload to {to}" if to else "")
                   + (f", parameter offload to {params_to}" if params_to else
                      f", offload_param {set_to} set (stage 3 only: unused here)" if set_to else ""))
        self.stage_reason = (f"DeepSpeed ZeRO stage {stage} ({type(opt).__name__}, {facts['dtype']}, "
                             f"overlap_comm={facts.get('overlap_comm')}{offload})")
        # host times on every device: see the module's docstring
        self._open_files(device, make_clock(torch.device("cpu")), [(u.name, u.numel) for u in self.units], [],
                         [u.facts() for u in self.units])
        names = [u.name for u in self.units]
        params = list(engine.module.parameters())
        self.memory = DeepSpeedMemory(opt, params, stage, offload=bool(to or params_to))
        self.recorder = ShardedRecorder(clock=self.clock, emit=lambda s: self._emit(s, names),
                                        sample=self.memory, measure_step=self._measure_steps(),
                                        on_close=self.on_step, in_backward=autograd_running,
                                        offset_us=self.offsets_start[self.rank].offset_us)
        self.recorder.optimizer = opt
        self.tap = CommTap(self.recorder, unit_of, owner_of, self._guard, self.param_names,
                           param_of=(lambda p: p) if stage == 3 else lambda e: opt.bit16_groups[e[0]][e[1]])
        self.tap.attach(type(backend))
        # what reaches torch.distributed past DeepSpeed's backend in a step (the script's own
        # all-reduce of its loss): a collective of no unit, as on an FSDP2 trace
        self._handles.add(CollectiveTimer(OwnCollectives(self.recorder), self._guard, own_groups=(self._cpu_group,),
                                          passed_over=(BACKEND,)))  # the tap's
        self._wrap_engine()
        self._wrap_bucket(opt, _BUCKET_METHODS[stage])
        if stage == 3:
            self._wrap_waits(unit_of)
        try:
            self._live = LiveFile(self.config.out_dir, self.rank, self.recorder,
                                  position=lambda: position(self.recorder, names, self.tap.where),
                                  tick=self.recorder.flush_held)
        except OSError:
            self._live = None

    def _run_facts(self) -> dict:
        facts = self.facts
        return {"model_class": type(self.model).__name__,
                "model_params": sum(u.numel for u in self.units),
                "trainable_params": trainable_params(self.model),
                "deepspeed": facts,
                "sharding": {"framework": "deepspeed", "stage": self.stage, "stage_reason": self.stage_reason,
                             "units": [u.facts() for u in self.units], "reduce_scatter_sent_as": None,
                             "param_dtype": facts.get("dtype"), "reduce_dtype": facts.get("communication_dtype"),
                             "times": "host: when the host launched, waited for and saw done each collective"}}

    # -- the wrappers -----------------------------------------------------------------
    def _set(self, obj, name: str, value) -> None:
        setattr(obj, name, value)  # an instance attribute shadows the class's method
        self._patched.append((obj, name))

    def _guarded(self, body: Callable[[], Any]) -> None:
        if self._guard.broken is None:
            try:
                body()
            except Exception as e:  # noqa: BLE001 - tracing stops, training goes on
                self._guard.fail(e)

    def _wrap_engine(self) -> None:
        engine, rec, memory = self.engine, self.recorder, self.memory
        forward, prologue, epilogue, step = (getattr(engine, m) for m in _ENGINE_METHODS)
        measuring = [False]

        def forward_start() -> None:
            if not torch.is_grad_enabled():
                return  # an evaluation forward: not a training pass
            rec.on_forward_start()
            rec.enter(ROOT, FORWARD)
            measuring[0] = bool(rec.current is not None and rec.current.measure and memory.activations.start())

        def forward_end() -> None:
            if measuring[0]:
                measuring[0] = False
                memory.activations.stop()
            if torch.is_grad_enabled():
                rec.leave(ROOT, FORWARD)
                rec.on_forward_end()

        @functools.wraps(forward)
        def traced_forward(*args, **kwargs):
            self._guarded(forward_start)
            try:
                return forward(*args, **kwargs)
            finally:
                self._guarded(forward_end)

        @functools.wraps(prologue)
        def traced_prologue(*args, **kwargs):
            self._guarded(lambda: rec.enter(ROOT, BACKWARD))
            return prologue(*args, **kwargs)

        @functools.wraps(epilogue)
        def traced_epilogue(*args, **kwargs):
            try:
                return epilogue(*args, **kwargs)
            finally:
                self._guarded(lambda: (rec.leave(ROOT, BACKWARD), rec.on_backward_end()))

        @functools.wraps(step)
        def traced_step(*args, **kwargs):
            boundary = [False]

            def start() -> None:
                boundary[0] = bool(engine.is_gradient_accumulation_boundary()) and rec.current is not None
                if boundary[0]:
                    self.tap.step_ends()
                    rec.on_optimizer_start()
                    self.tap.in_step = True

            self._guarded(start)
            try:
                result = step(*args, **kwargs)
            finally:
                self.tap.in_step = False
            if boundary[0]:
                self._guarded(self.tap.step_ends)  # the step's own async gathers: seen done by now
                self._guarded(rec.on_optimizer_end)  # closes the step (its on_close may end the job: --steps)
            return result

        for name, fn in zip(_ENGINE_METHODS, (traced_forward, traced_prologue, traced_epilogue, traced_step)):
            self._set(engine, name, fn)

    def _wrap_bucket(self, opt, method: str) -> None:
        """Mark the bucket being reduced for the collectives it issues (``CommTap.bucket``
        while it runs): its entries as DeepSpeed lists them (stages 1-2: ``(group, index
        in group, id)``; 3: the parameters themselves), copied, and the reduction's start
        and end (``perf_counter_ns``). Its number in the step, unit, names and sizes are
        found when the step is emitted: this runs on caches the gradients have just
        flushed, where each thing read is a miss."""
        original, rec, tap, guard = getattr(opt, method), self.recorder, self.tap, self._guard

        @functools.wraps(original)
        def traced_bucket(*args, **kwargs):
            if rec.current is not None and guard.broken is None:
                try:
                    buckets = opt.ipg_buckets
                    dtype = args[0] if args else next(iter(kwargs.values()), None)
                    for b in ((buckets.get(dtype),) if dtype is not None else buckets.values()):
                        if b is not None and b.params:
                            params = b.params
                            tap.bucket = bucket_mark(params)
                            break
                except Exception as e:  # noqa: BLE001 - tracing stops, training goes on
                    guard.fail(e)
            try:
                return original(*args, **kwargs)
            finally:
                if tap.bucket is not None:
                    bucket_done(tap.bucket)
                tap.bucket = None

        self._set(opt, method, traced_bucket)

    def _wrap_waits(self, unit_of: dict[int, int]) -> None:
        """Compute waiting for a ZeRO-3 gather: the wait of DeepSpeed's gather handles
        (class-level: each handle is made per gather; taken off again at the end)."""
        module = sys.modules.get(_PARTITION_MODULE)
        rec, tap = self.recorder, self.tap

        def waited(handle, step, start, end) -> None:
            """Recorded whole after the wait (one call: see ``ShardedRecorder.comm_timed``)."""
            tap.poll(end)  # the awaited gather was done when its wait returned (at the latest)
            params = getattr(handle, "params", None) or [getattr(handle, "param", None)]
            rec.wait_timed(step, unit_of.get(id(params[0]), -1), start, end)
        for cls in (getattr(module, n, None) for n in _WAIT_HANDLES):
            own = None if cls is None else cls.__dict__.get("wait")
            if own is None or getattr(own, "_ddpscope", False):
                continue

            def make(own_wait):
                @functools.wraps(own_wait)
                def wait(handle, *args, **kwargs):
                    step = rec.current
                    if step is None or self._guard.broken is not None:
                        return own_wait(handle, *args, **kwargs)
                    start = None
                    try:
                        tap.poll()  # what finished before this wait ended no later than now
                        start = rec.clock.stamp()
                    except Exception as e:  # noqa: BLE001 - tracing stops, training goes on
                        self._guard.fail(e)
                    try:
                        return own_wait(handle, *args, **kwargs)
                    finally:
                        if start is not None:
                            self._guarded(lambda: waited(handle, step, start, rec.clock.stamp()))

                wait._ddpscope = True
                return wait

            cls.wait = make(own)
            self._waits.append((cls, own))

    def _detach(self) -> None:
        for obj, name in reversed(self._patched):
            try:
                delattr(obj, name)  # the class's method shows through again
            except AttributeError:
                pass
        self._patched.clear()
        for cls, own in self._waits:
            cls.wait = own
        self._waits.clear()
        if self.tap is not None:
            self.tap.detach()
        self._handles.remove()  # the collective timer
