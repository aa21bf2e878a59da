"""``FSDPTracer``: trace one FSDP2 model (``fully_shard``) on this rank, per unit.

``ddpscope run`` starts it from FSDP's lazy initialisation (the root's first forward),
when every unit is known; it shares the DDP tracer's clock, writer, clock offsets, live
file and format, and writes ``kind: "sharded"`` into run.json with the units and the
ZeRO stage the run's settings amount to. Like ``DDPTracer`` it never raises for what
happens at run time: ``start()`` says why it could not start, and an error inside one of
its hooks stops tracing on that rank, never training.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.clock import make_clock
from ddpscope.tracer.capture.collective_timer import CollectiveTimer
from ddpscope.tracer.capture.hook_guard import HookGuard, HookHandles, attach_optimizer_finder, autograd_running
from ddpscope.tracer.capture.live import LiveFile
from ddpscope.tracer.capture.memory import MeasuredSteps
from ddpscope.tracer.capture.offsets import estimate_offsets
from ddpscope.tracer.capture.rank_files import header_events, open_rank_trace, release_group
from ddpscope.tracer.capture.sharded import units as fsdp_units
from ddpscope.tracer.capture.sharded.events import lane_events, step_events
from ddpscope.tracer.capture.sharded.fsdp_hooks import FSDPHooks
from ddpscope.tracer.capture.sharded.memory import ShardedMemory
from ddpscope.tracer.capture.sharded.own_collectives import OwnCollectives
from ddpscope.tracer.capture.sharded.recorder import ShardedRecorder, ShardedStep
from ddpscope.tracer.capture.sharded.settings import read_prefetch
from ddpscope.tracer.capture.tracer_config import TracerConfig
from ddpscope.tracer.progress import say
from ddpscope.tracer.writer import TraceWriter, read_json, write_json_atomic


def zero_stage(units: list[fsdp_units.Unit]) -> tuple[int, str]:
    """The ZeRO stage FSDP2's settings amount to, and why: parameters kept unsharded from
    forward to backward (every unit but the root with ``reshard_after_forward=False``) is
    stage 2; resharded after forward (True, or N ranks: a hybrid) is stage 3. The root is
    left out: FSDP never reshards it after forward unless told to. Units sharded over
    groups of one rank (HSDP with a shard dimension of 1: torchtitan's
    ``data_parallel_shard_degree 1``, DDP done by FSDP2) shard nothing: stage 0, whatever
    they reshard (FSDP2 then neither all-gathers nor reduce-scatters, and all-reduces each
    unit's whole gradient across the replicas, as DDP's buckets do)."""
    if units and all(u.shard_size == 1 for u in units):
        replicas = max(u.replicate_size for u in units)
        reduced = (f"each unit's gradients are all-reduced across the {replicas} replicas, as DDP's" if replicas > 1
                   else "no gradient is reduced (one rank)")
        return 0, (f"shard groups of 1 rank: nothing is sharded; every rank keeps whole parameters, gradients and "
                   f"optimizer state, and {reduced}")
    settings = {u.reshard_after_forward for u in units if not u.is_root} or {u.reshard_after_forward for u in units}
    if settings == {False}:
        return 2, "reshard_after_forward=False: parameters stay gathered from forward to backward"
    ints = sorted(s for s in settings if not isinstance(s, bool))
    if ints:
        return 3, f"reshard_after_forward={ints[0]}: resharded to {ints[0]} ranks after forward (a hybrid of 2 and 3)"
    if settings == {True}:
        return 3, "reshard_after_forward=True: parameters resharded after forward, gathered again for backward"
    return 3, "units differ: some reshard after forward, some do not"


class FSDPTracer:
    """Traces the FSDP2 model ``root_module`` (its root state ``root_state``, lazily initialised)."""

    units_word = "FSDP units"  # what a rank's units are called when they differ between ranks

    def __init__(self, root_module: torch.nn.Module, root_state, config: TracerConfig, *,
                 on_step: Callable[[ShardedStep], None] | None = None, run_meta: dict | None = None) -> None:
        self.model = root_module
        self.state = root_state
        self.config = config
        self.on_step = on_step
        self.run_meta = dict(run_meta or {})
        self.failure: str | None = None
        self._guard = HookGuard(self._tracing_failed)
        self._handles = HookHandles()
        self._hooks: FSDPHooks | None = None
        self._writer: TraceWriter | None = None
        self._live: LiveFile | None = None
        self._cpu_group = None
        self._closed = False
        self.recorder: ShardedRecorder | None = None
        self.rank = dist.get_rank() if dist.is_initialized() else 0

    @property
    def active(self) -> bool:
        return self.recorder is not None and self.failure is None and not self._closed

    @property
    def steps(self) -> int:
        return self.recorder.next_step if self.recorder else 0

    def set_meta(self, **fields: Any) -> None:
        """Add JSON-able facts to this rank's trace metadata (``--profile``'s file, ...)."""
        if self._writer is not None and not self._closed:
            self._writer.set_meta(**fields)

    def start(self) -> str | None:
        """Start tracing; None, or why not (nothing of it is left attached). Never raises."""
        try:
            self._attach()
            return None
        except Exception as e:  # noqa: BLE001 - the script trains on, untraced
            self._detach()
            if self._writer is not None:
                self._writer.close(status=fmt.FAILED, error="the tracer could not start")
                self._writer.unlink()
                self._writer = None
            self._release_cpu_group()
            reason = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
            self.failure = f"tracing could not start ({reason}); the script runs untraced"
            return self.failure

    def _attach(self) -> None:
        cfg = self.config
        self.units = fsdp_units.find_units(self.state)
        if not self.units:
            raise RuntimeError("the FSDP model has no parameters to shard")
        device = self.units[0].group.device
        self.stage, self.stage_reason = zero_stage(self.units)  # run.json has them from its first writing
        # gloo has no reduce-scatter; shard groups of 1 rank run none (FSDP2 copies the gradient)
        sharded = any(u.shard_size > 1 for u in self.units)
        self.sent_as = "all_reduce" if dist.get_backend() == "gloo" and sharded else None
        clock = self._make_clock(device)
        self._open_files(device, clock, fsdp_units.signature(self.units),
                         fsdp_units.meta_params(self.model)[:3], [u.facts() for u in self.units])
        names = [u.name for u in self.units]
        measure_step = self._measure_steps()
        self.memory = ShardedMemory(self.units, device, lambda: self.recorder.optimizer if self.recorder else None)
        self.recorder = ShardedRecorder(clock=self.clock, emit=lambda s: self._emit(s, names),
                                        sample=self.memory, measure_step=measure_step, on_close=self.on_step,
                                        in_backward=autograd_running,
                                        offset_us=self.offsets_start[self.rank].offset_us)
        self._hooks = FSDPHooks(self.model, self.units, self.recorder, self._guard,
                                on_measured_forward=(self.memory.activations.start, self.memory.activations.stop))
        self._hooks.attach()
        # the collectives no unit issues (clip_grad_norm_'s over DTensors, the script's own)
        self._handles.add(CollectiveTimer(OwnCollectives(self.recorder), self._guard, own_groups=(self._cpu_group,),
                                          host_clock=not self.clock.resolves))
        attach_optimizer_finder(list(self.model.parameters()), self.recorder, self._handles, self._guard)
        try:
            self._live = LiveFile(cfg.out_dir, self.rank, self.recorder,
                                  position=lambda: position(self.recorder, names), tick=self.recorder.flush_held)
        except OSError:
            self._live = None
        if torch.is_grad_enabled():  # started inside the root's first forward: that is step 0
            self.recorder.on_forward_start(bool(getattr(self.units[0].group, "reduce_grads", True)))

    def _make_clock(self, device: torch.device):
        """The clock for the units' device (tests/standin_device replaces it to run the device
        path where there is no GPU)."""
        clock = make_clock(device)
        if device.type == "cuda":  # every cut on the compute stream (FSDP2 calls its collectives in its own streams)
            clock.pin_stream(torch.cuda.current_stream(device))
        return clock

    def _open_files(self, device, clock, signature, meta_params: list[str], unit_facts: list[dict]) -> None:
        """What every sharded tracer does first (FSDP2's, DeepSpeed's): the clock, a gloo
        group of ddpscope's own, clock offsets, every rank's units checked alike (every
        rank stops, or none), the rank file opened."""
        cfg = self.config
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend()
        self.clock = clock
        self._cpu_group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=cfg.sync_timeout_s))
        self.offsets_start = estimate_offsets(self.clock.host_us, self._cpu_group, cfg.offset_rounds)
        mine = {"host": socket.gethostname(), "units": signature, "meta": meta_params}
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine, group=self._cpu_group)
        self.hosts = [e["host"] for e in everyone]
        for r, e in enumerate(everyone):
            if e["units"] != everyone[0]["units"]:
                raise RuntimeError(f"the {self.units_word} differ between ranks (rank 0: {len(everyone[0]['units'])} units, "
                                   f"rank {r}: {len(e['units'])}; first difference: "
                                   f"{_first_difference(everyone[0]['units'], e['units'])})")
            if e["meta"]:
                raise RuntimeError(f"rank {r}'s parameters are still on the meta device ({', '.join(e['meta'])}): "
                                   "meta-device initialisation was not materialised (to_empty, init) before forward")
        self._meta = {
            "format": fmt.FORMAT, "version": fmt.VERSION, "kind": fmt.KIND_SHARDED, "status": fmt.RUNNING,
            "rank": self.rank, "world_size": self.world_size, "local_rank": int(os.environ.get("LOCAL_RANK", self.rank)),
            "host": self.hosts[self.rank], "pid": os.getpid(), "backend": self.backend, "device": str(device),
            "clock": self.clock.kind, "clock_offset": {"start": self.offsets_start[self.rank].to_json(), "end": None},
            "units": unit_facts, "steps": 0, "torch_version": str(torch.__version__),
        }
        self._writer = open_rank_trace(
            cfg.out_dir, self.rank, self.world_size, self._meta,
            header_events(self.rank, self.hosts[self.rank]) + lane_events(self.rank), cfg.flush_interval_s,
            self._cpu_group, on_opened=lambda: self._write_run_json(fmt.RUNNING) if self.rank == 0 else None)

    def _measure_steps(self) -> MeasuredSteps:
        """Which steps memory is measured in (``MeasuredSteps``)."""
        return MeasuredSteps(self.clock, self.config.memory_interval_s, self.offsets_start[self.rank].offset_us)

    def _emit(self, s: ShardedStep, names: list[str]) -> None:
        if self._writer is None or self._writer.error is not None:
            return
        self._writer.add(step_events(s, self.rank, names, self.sent_as))

    def _detach(self) -> None:
        if self._hooks is not None:
            self._hooks.detach()
        self._handles.remove()

    def _tracing_failed(self, reason: str) -> None:
        step = self.recorder.current.step if self.recorder and self.recorder.current else self.steps
        self.failure = f"rank {self.rank}: tracing stopped at step {step} ({reason}); training goes on untraced"
        say(self.failure)
        if self.recorder is not None:
            self.recorder.emit = lambda s: None

    def close(self, error: str | None = None) -> None:
        """Close the open step, take every hook away, write the end of the files. Once."""
        if self._closed or self._writer is None:
            return
        self._closed = True
        failed, broken = error is not None, self.failure is not None
        if self._live is not None:
            self._live.close(fmt.FAILED if failed or broken else fmt.COMPLETE)
        try:
            if self.recorder is not None:
                self.recorder.finish(aborted=failed or broken)
        except Exception as e:  # noqa: BLE001 - the trace ends here, training does not
            self.failure = self.failure or f"could not close the last step ({type(e).__name__}: {e})"
            broken = True
        finally:
            self._detach()
        status = fmt.FAILED if failed or broken else fmt.COMPLETE
        error = error[:2000] if failed else self.failure
        self._writer.set_meta(status=status, error=error)
        offsets_end = None
        if not failed:
            try:  # collective: every rank that ends cleanly takes part
                offsets_end = estimate_offsets(self.clock.host_us, self._cpu_group, self.config.offset_rounds)
            except Exception:  # noqa: BLE001 - a peer died: keep the start estimate
                offsets_end = None
        self._release_cpu_group()
        if offsets_end is not None:
            self._meta["clock_offset"]["end"] = offsets_end[self.rank].to_json()
        steps = self.recorder.steps_written if self.recorder else 0
        try:
            self._writer.close(status=status, error=error, clock_offset=self._meta["clock_offset"], steps=steps,
                               **self.clock.facts())  # CUDA: anchors, drift, waits
        except OSError:
            if not failed:
                raise
        if self.rank == 0:
            self._write_run_json(status, error, offsets_end, steps)

    def _release_cpu_group(self) -> None:
        group, self._cpu_group = self._cpu_group, None
        release_group(group)

    def _run_facts(self) -> dict:
        """run.json's facts of the model and how it is sharded (``sharding``)."""
        return {"model_class": type(self.model).__name__.removeprefix("FSDP"),
                "model_params": sum(u.numel for u in self.units),
                "trainable_params": trainable_params(self.model),
                "sharding": {"framework": "fsdp2", "stage": self.stage, "stage_reason": self.stage_reason,
                             "units": [u.facts() for u in self.units], "reduce_scatter_sent_as": self.sent_as,
                             **read_prefetch(self.units), "param_dtype": _dtype_name(self.units, "param_dtype"),
                             "reduce_dtype": _dtype_name(self.units, "reduce_dtype")}}

    def _write_run_json(self, status: str, error: str | None = None, offsets_end=None, steps: int = 0) -> None:
        path = self.config.out_dir / fmt.RUN_FILE
        run = read_json(path) if path.exists() else {}
        run.update({
            "format": fmt.FORMAT, "version": fmt.VERSION, "kind": fmt.KIND_SHARDED, "status": status,
            "world_size": self.world_size, "backend": self.backend, "device": self._meta["device"],
            "clock": self.clock.kind, "hosts": self.hosts, "torch_version": str(torch.__version__),
            **self._run_facts(),
            "clock_offsets": {"start": [o.to_json() for o in self.offsets_start],
                              "end": None if offsets_end is None else [o.to_json() for o in offsets_end]},
            "steps": steps, "ranks": [fmt.rank_file(r) for r in range(self.world_size)],
            **self.config.run_meta, **self.run_meta,
        })
        run.setdefault("started_at", fmt.started_at())
        if error:
            run["error"] = error
        write_json_atomic(path, run)


def trainable_params(model: torch.nn.Module) -> int:
    """Elements of the model's parameters that train (``requires_grad``), whole: a DTensor's
    global size, a ZeRO-3 parameter's ``ds_numel``. The others (a LoRA base model's) are
    held and sharded all the same, with no gradient or optimizer state."""
    return sum(int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad)


def _dtype_name(units: list[fsdp_units.Unit], attr: str) -> str | None:
    params = [p for u in units for p in u.group.fsdp_params]
    dtype = getattr(params[0], attr, None) if params else None
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _first_difference(a: list, b: list) -> str:
    for x, y in zip(a, b):
        if x != y:
            return f"{x[0]!r} ({x[1]} parameters) against {y[0]!r} ({y[1]})"
    return f"{len(a)} units against {len(b)}"


def position(recorder: ShardedRecorder, names: list[str],
             where: Callable[[], tuple[int, str, str | None]] | None = None) -> dict:
    """Where this rank is, for the hang watchdog: the step, the unit and what it does
    (``where``: the recorder's ``where`` as its writer reads it, if not as it is)."""
    cur = recorder.current
    if cur is None:
        return {"step": recorder.next_step, "steps_done": recorder.next_step, "phase": "between steps",
                "activity": [recorder.next_step]}
    unit, phase, coll = recorder.where if where is None else where()
    name = names[unit] if 0 <= unit < len(names) else None
    if cur.optimizer is not None and cur.optimizer[1] is None:
        where = "optimizer"
    elif coll is not None:  # no unit's: the script's own, clip_grad_norm_'s, DeepSpeed's after the step
        where = f"{coll.replace('_', '-')} of {f'unit {name}' if name is not None else 'no unit'} ({phase})"
    elif name is not None:
        where = f"{phase} of unit {name}"
    else:
        where = "forward" if cur.passes and cur.passes[-1].backward_start is None else "backward"
    return {"step": cur.step, "steps_done": cur.step, "phase": where,
            "activity": [cur.step, len(cur.passes), len(cur.segments), len(cur.colls) + len(cur.raw),
                         len(cur.waits)]}
