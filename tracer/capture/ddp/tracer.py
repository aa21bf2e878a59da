"""``DDPTracer``: attach to a DistributedDataParallel model (and its optimizer) and write
one trace per rank. The training loop stays as it is::

    with DDPTracer(ddp_model, optimizer, out_dir="traces/run1"):
        for batch in loader:
            loss = loss_fn(ddp_model(batch))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()

Steps are detected (a step starts at a training forward and ends when
``optimizer.step()`` returns) or, with ``step_boundary="explicit"``, end where the loop
calls ``tracer.step()``. Pass ``optimizer="auto"`` to have the optimizer found at its
first step (the one that updates the model's parameters), as ``ddpscope run`` does.
A communication hook the script registers after the tracer starts is wrapped and timed.
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.backward_encoder import BackwardEncoder, worth_it
from ddpscope.tracer.capture.clock import CpuClock, make_clock
from ddpscope.tracer.capture.collective_timer import CollectiveTimer
from ddpscope.tracer.capture.ddp.buffer_sync import BufferBroadcastTimer
from ddpscope.tracer.capture.ddp.comm_hook import attach_comm_hook, ddp_register_builtin_comm_hook
from ddpscope.tracer.capture.ddp.compiled import CompiledBuckets, load_extension, usable
from ddpscope.tracer.capture.ddp.recorder import StepRecorder
from ddpscope.tracer.capture.ddp.reducer import frozen_params, reducer_params
from ddpscope.tracer.capture.ddp.run_facts import ddp_facts, zero_stage
from ddpscope.tracer.capture.ddp.step_hooks import attach_grad_hooks, attach_hooks
from ddpscope.tracer.capture.hook_guard import HookGuard, HookHandles
from ddpscope.tracer.capture.live import LiveFile
from ddpscope.tracer.capture.offsets import ClockOffset, estimate_offsets
from ddpscope.tracer.capture.rank_files import header_events, open_rank_trace, release_group
from ddpscope.tracer.capture.tracer_config import TracerConfig
from ddpscope.tracer.progress import say
from ddpscope.tracer.writer import TraceWriter, read_json, write_json_atomic

NCCL_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"


def enable_kernel_timing(group, device: torch.device) -> bool:
    """Turn on the NCCL backend's own timing of its collectives (a start and an end CUDA
    event each, what ``TORCH_NCCL_ENABLE_TIMING=1`` turns on): a bucket's kernel time then
    comes from NCCL, apart from its wait behind earlier buckets. Whether it is on; never
    raises (a backend without it keeps the launch-to-done spans)."""
    for target in (lambda: group._get_backend(device), lambda: group):
        try:
            target()._enable_collectives_timing()
            return True
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue
    return False
TEST_FAIL_ENV = "DDPSCOPE_TEST_TRACER_FAIL"  # test-only: this rank's tracer cannot start


class DDPTracer:
    """Context manager that traces ``model`` (a ``DistributedDataParallel``) on this rank.

    ``optimizer``: the model's optimizer, ``"auto"`` (found at its first step), or None
    (then a step ends at the next training forward after a syncing backward).
    ``on_step(step_record)``: called on the training thread each time a step closes."""

    def __init__(self, model: DDP, optimizer: torch.optim.Optimizer | str | None = None,
                 config: TracerConfig | None = None, *, on_step: Callable[[Any], None] | None = None,
                 **config_kw: Any) -> None:
        if not isinstance(model, DDP):
            raise TypeError(f"DDPTracer needs a DistributedDataParallel model, got {type(model).__name__}")
        if isinstance(optimizer, str) and optimizer != "auto":
            raise ValueError(f"optimizer must be an Optimizer, 'auto' or None, got {optimizer!r}")
        if config is None:
            config = TracerConfig(**config_kw)
        elif config_kw:
            raise TypeError("pass either config= or keyword options, not both")
        self.model = model
        self.optimizer = optimizer
        self.config = config
        self._handles = HookHandles()
        self._recorder: StepRecorder | None = None
        self._writer: TraceWriter | None = None
        self._encoder: BackwardEncoder | None = None  # the compiled capture's: steps encoded in backward
        self._encoder_facts: dict = {}
        self._comm_state = None
        self._on_step = on_step
        self._live: LiveFile | None = None
        self._closed = False
        self._compiled: CompiledBuckets | None = None
        self._cpu_group: dist.ProcessGroup | None = None
        self.capture_note: str | None = None
        self._guard = HookGuard(self._tracing_failed)
        self.failure: str | None = None  # why this tracer could not start, or stopped tracing

    @property
    def active(self) -> bool:
        """Tracing now (started, not stopped by an error, not closed)."""
        return self._recorder is not None and self.failure is None and not self._closed

    # -- lifecycle ----------------------------------------------------------------
    def __enter__(self) -> "DDPTracer":
        """Start tracing. If it cannot start (a communication hook registered before it,
        no process group, a rank that cannot write), it says why in one line (rank 0) and
        steps aside: the ``with`` block trains as it would untraced."""
        why = self.start()
        if why is not None and _rank() == 0:
            say(why)
        return self

    def start(self) -> str | None:
        """Start tracing; None, or why it could not (then nothing of it is attached). Never
        raises for what happens at run time: training comes first."""
        try:
            self._attach()
            return None
        except Exception as e:  # noqa: BLE001 - the script trains on, untraced
            self._detach_partial()
            # ours (CommHookTaken, a rank that cannot write) are RuntimeErrors, said as they are
            reason = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
            self.failure = f"tracing could not start ({reason}); the script runs untraced"
            return self.failure
        except BaseException:
            self._detach_partial()
            raise

    def _detach_partial(self) -> None:
        """Leave nothing of a tracer that could not start: no hooks, no writer thread, no file."""
        self._handles.remove()
        if self._compiled is not None:
            self._compiled.detach()
            self._compiled = None
        if self._comm_state is not None:
            self._comm_state.recorder = None
        self._stop_encoder()
        self._release_cpu_group()
        if self._live is not None:
            self._live.close(fmt.FAILED)
            self._live.path.unlink(missing_ok=True)
            self._live = None
        if self._writer is not None:  # it holds no step: leave no file that says otherwise
            try:
                self._writer.close(status=fmt.FAILED, error="the tracer could not start")
            except OSError:
                pass
            self._writer.unlink()
            self._writer = None
        self._recorder = None

    def _attach(self) -> "DDPTracer":
        if not dist.is_initialized():
            raise RuntimeError("DDPTracer needs an initialized process group (dist.init_process_group)")
        cfg = self.config
        names, params = reducer_params(self.model)
        device = self._timing_device(params)
        ext, self.capture_note = self._compiled_extension(device)
        # First, before any collective: a hook registered earlier cannot be wrapped.
        comm_state = attach_comm_hook(self.model, register=ext is None)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.backend = dist.get_backend(self.model.process_group)
        self.clock = self._make_clock(device)
        # The tracer's own gloo group: host clocks are compared on the host (beside NCCL
        # too), and its short timeout bounds how long a rank waits for a peer that died.
        self._cpu_group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=cfg.sync_timeout_s))
        self.offsets_start = estimate_offsets(self.clock.host_us, self._cpu_group, cfg.offset_rounds)
        hosts: list[Any] = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=self._cpu_group)
        self.hosts = hosts

        self._meta = {
            "format": fmt.FORMAT, "version": fmt.VERSION, "status": fmt.RUNNING,
            "rank": self.rank, "world_size": self.world_size,
            "local_rank": int(os.environ.get("LOCAL_RANK", self.rank)),
            "host": hosts[self.rank], "pid": os.getpid(),
            "backend": self.backend, "device": str(device), "clock": self.clock.kind,
            "clock_offset": {"start": self.offsets_start[self.rank].to_json(), "end": None},
            "param_names": names, "param_bytes": [p.numel() * p.element_size() for p in params],
            # DDP buckets each dtype apart: a prediction of its layout needs them
            "param_dtypes": [str(p.dtype).removeprefix("torch.") for p in params],
            "bucket_layouts": [], "steps": 0,
            "step_boundary": cfg.step_boundary, "torch_version": str(torch.__version__),
            "capture_path": "python" if ext is None else "compiled", "capture_path_note": self.capture_note,
            "grad_marks_every": cfg.grad_marks_every,
        }
        self._writer = open_rank_trace(
            cfg.out_dir, self.rank, self.world_size, self._meta, header_events(self.rank, hosts[self.rank]),
            cfg.flush_interval_s, self._cpu_group,
            on_opened=lambda: self._write_run_json(status=fmt.RUNNING) if self.rank == 0 else None,
            injected=f"injected by {TEST_FAIL_ENV}" if os.environ.get(TEST_FAIL_ENV) == str(self.rank) else None)

        nccl_timing = self.backend == "nccl" and (os.environ.get(NCCL_TIMING_ENV) == "1"
                                                  or enable_kernel_timing(self.model.process_group, device))
        self._recorder = StepRecorder(
            clock=self.clock, rank=self.rank, param_names=names, params=params,
            optimizer=None if self.optimizer == "auto" else self.optimizer, step_boundary=cfg.step_boundary,
            emit=self._emit, nccl_kernel_timing=nccl_timing, on_close=self._on_step,
            memory_interval_s=cfg.memory_interval_s, offset_us=self.offsets_start[self.rank].offset_us,
            grad_marks_every=cfg.grad_marks_every, frozen_params=frozen_params(self.model),
        )
        comm_state.keep_work = nccl_timing
        comm_state.recorder, comm_state.guard = self._recorder, self._guard
        self._comm_state = comm_state
        if ext is not None:
            self._compiled = CompiledBuckets(ext, self.model, self._recorder, device, getattr(self.clock, "skew_ns", 0),
                                             kernel_timing=nccl_timing)
            self._recorder.bucket_source = self._compiled.attach()
            self._recorder.memory.grad_bytes = ext.GradBytes(params)  # the gradients' bytes, counted in C++
            comm_state.before_register = self._python_capture  # the script's own hook: timed in Python
            comm_state.builtin_direct = self._builtin_hook  # DDP's built-in C++ hook: timed here
        self._handles.add(BufferBroadcastTimer(self.model, self._recorder, self._guard))
        self._handles.add(CollectiveTimer(self._recorder, self._guard, own_groups=(self._cpu_group,),
                                          host_clock=self.clock.kind == CpuClock.kind))
        attach_hooks(self.model, params, self.optimizer, self._recorder, self._handles, self._guard,
                     grad_hooks=self._compiled is None or not self._compiled.ready_in_cpp)
        encode = worth_it(device.type) if self.encode_in_backward is None else self.encode_in_backward
        if self._compiled is not None and self._compiled.ready_in_cpp and encode:
            # no Python hook of ours in backward to wait for the GIL it takes (backward_encoder.py)
            self._encoder = BackwardEncoder(self._writer)
            self._recorder.backward_began = self._encoder.backward_began
        try:  # where this rank is, for the launcher's hang watchdog (optional: never fatal)
            self._live = LiveFile(cfg.out_dir, self.rank, self._recorder)
        except OSError:
            self._live = None
        return self

    # Steps built and encoded beside the next backward (backward_encoder.py); None: where
    # it pays (worth_it). benchmarks/cuda_overhead.py traces a copy with it off, side by side.
    encode_in_backward: bool | None = None

    # The device whose events time the run, and its clock: the model's (the host's on CPU).
    # tests/standin_device replaces both to run the device path where there is no GPU.
    def _timing_device(self, params: list[torch.nn.Parameter]) -> torch.device:
        return params[0].device if params else torch.device("cpu")

    def _make_clock(self, device: torch.device):
        return make_clock(device)

    def _compiled_extension(self, device: torch.device):
        """``(extension, None)`` for the compiled capture, or ``(None, why not)``; the
        reason is said once (rank 0) when the compiled capture was asked for by name."""
        if self.config.capture == "python":
            return None, self.config.capture_note
        if (why := usable(device)) is not None:
            return None, why
        ext, why = load_extension()
        if why is not None:
            if dist.get_rank() == 0:
                say(f"{why}; the Python hooks time this run")
            return None, why
        return ext, None

    def _python_capture(self) -> None:
        """The script registers its own communication hook: its collectives may not go
        through the reducer's group, so ours (Python) wraps and times it from here on."""
        if self._compiled is not None:
            ready_in_cpp = self._compiled.ready_in_cpp  # else the Python ready hooks are on already
            self._compiled.detach()
            self._compiled = None
            if (why := self._stop_encoder()) is not None:  # Python hooks in backward from now on
                self._tracing_failed(why)
            if self._recorder is not None:
                self._recorder.bucket_source = None
                if ready_in_cpp:
                    attach_grad_hooks(self._recorder.params, self._recorder, self._handles, self._guard)
            self._meta["capture_path"] = "python"
            self._meta["capture_path_note"] = "the script registered a communication hook: timed in Python"
            if self._writer is not None:
                self._writer.set_meta(capture_path="python", capture_path_note=self._meta["capture_path_note"])

    def _builtin_hook(self, comm_hook_type) -> bool:
        """The script registers one of DDP's built-in C++ hooks: registered as it is. It
        all-reduces on the reducer's group, which is the compiled capture's wrapper, so its
        collectives are timed there (FP16_COMPRESS: fp16 copies, half the bucket's bytes)."""
        if self._compiled is None or not self._compiled.attached:
            return False
        ddp_register_builtin_comm_hook(self.model, comm_hook_type)  # DDP's own (ours shadows it)
        note = f"the script registered DDP's built-in {comm_hook_type.name} hook: timed by the compiled capture"
        self._meta["capture_path_note"] = note
        if self._writer is not None:
            self._writer.set_meta(capture_path_note=note)
        return True

    def step(self) -> None:
        """End the current step here (needed with ``step_boundary="explicit"``)."""
        if self._recorder is not None:
            self._recorder.mark_step()

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.close(None if exc_type is None else f"{exc_type.__name__}: {exc}")
        return False

    def close(self, error: str | None = None) -> None:
        """End tracing: close the open step (``incomplete`` on error), estimate the end
        clock offsets (a collective, only when no error: a failed peer would never
        answer), write the files. Once; later calls do nothing."""
        if self._closed or self._writer is None:
            return
        self._closed = True
        failed = error is not None  # the job failed: no end collective (a failed peer would never answer)
        broken = self.failure is not None  # this rank's tracing stopped early (a hook failed)
        if self._live is not None:  # where it stopped: before the open step is closed below
            self._live.close(fmt.FAILED if failed or broken else fmt.COMPLETE)
        try:
            if self._recorder is not None:
                self._recorder.finish(aborted=failed or broken)
        except Exception as e:  # noqa: BLE001 - the trace ends here, training does not
            if not broken:
                self.failure = f"could not close the last step ({type(e).__name__}: {e})"
                broken = True
        finally:
            self._handles.remove()
            if self._compiled is not None:
                self._compiled.detach()  # DDP's reducer gets its own process group back
            if self._comm_state is not None:
                self._comm_state.recorder = None
        if (why := self._stop_encoder()) is not None and not broken:  # the steps it held are lost
            self.failure, broken = f"rank {self.rank}: tracing stopped ({why})", True
        status = fmt.FAILED if failed or broken else fmt.COMPLETE
        error = error[:2000] if failed else self.failure
        offsets_end: list[ClockOffset] | None = None
        self._writer.set_meta(status=status, error=error)  # on disk even if the end sync dies
        if not failed:
            try:  # collective: every rank that ends cleanly takes part
                offsets_end = estimate_offsets(self.clock.host_us, self._cpu_group, self.config.offset_rounds)
            except Exception:  # a peer died: keep the start estimate
                offsets_end = None
        self._release_cpu_group()  # the tracer's last collective is done
        if offsets_end is not None:
            self._meta["clock_offset"]["end"] = offsets_end[self.rank].to_json()
        lost = self._writer.error is not None  # said once when it happened
        try:
            self._writer.close(status=status, error=error, clock_offset=self._meta["clock_offset"],
                               steps=self._recorder.steps_written if self._recorder else 0,
                               **self.clock.facts(), **self._encoder_facts)  # CUDA: anchors, drift, waits
        except OSError:
            if self._live is not None:  # the launcher reads it: this rank's trace is not whole
                self._live.rewrite(fmt.FAILED)
            if not failed and not lost:
                raise
        if self.rank == 0 and not lost:
            self._write_run_json(status=status, error=error, offsets_end=offsets_end)

    def _release_cpu_group(self) -> None:
        group, self._cpu_group = self._cpu_group, None
        release_group(group)

    def set_meta(self, **fields: Any) -> None:
        """Add JSON-able facts to this rank's trace metadata (its ``ddpscope`` metadata event)."""
        if self._writer is not None and not self._closed:
            self._writer.set_meta(**fields)

    @property
    def steps(self) -> int:
        """Steps closed so far."""
        return self._recorder.next_step if self._recorder else 0

    # -- internals ----------------------------------------------------------------
    def _emit(self, events, layouts: list[dict] | None) -> None:
        if self._writer.error is not None:  # the trace cannot be written (disk full, folder gone)
            self._stop_recording()
            return
        (self._writer if self._encoder is None else self._encoder).add(events)
        if layouts is not None:  # rare (DDP rebuilt its buckets): each change appends the metadata once
            self._writer.set_meta(bucket_layouts=[dict(l) for l in layouts])

    def _stop_encoder(self) -> str | None:
        """Encode the steps the encoder holds here and end its thread; why that failed, or None."""
        encoder, self._encoder = self._encoder, None
        if self._recorder is not None:
            self._recorder.backward_began = None
        try:
            return None if encoder is None else encoder.drain()
        except Exception as e:  # noqa: BLE001 - a bug of ours: the trace ends, training does not
            return str(e)
        finally:
            self._encoder_facts = encoder.facts() if encoder is not None else self._encoder_facts

    def _tracing_failed(self, reason: str) -> None:
        """A hook of the tracer's failed (its guard caught the exception, training did not
        see it): this rank stops recording and says so once; the script trains on."""
        rec = self._recorder
        step = rec.current.step if rec is not None and rec.current is not None else self.steps
        self.failure = f"rank {self.rank}: tracing stopped at step {step} ({reason}); training goes on untraced"
        say(self.failure)
        self._stop_recording()

    def _stop_recording(self) -> None:
        """The trace can no longer be written: nothing more is kept (the writer said so in
        one line); hooks stay (removing them inside one is not safe) but hand on only,
        and the file on disk keeps the steps written whole before."""
        if self._comm_state is not None:
            self._comm_state.recorder = None  # the comm hook passes all-reduces through untimed
        if self._compiled is not None:
            self._compiled.detach()
        if self._recorder is not None:
            self._recorder.bucket_source = None
            self._recorder.emit = lambda events, layouts: None
            self._recorder.pending.clear()
        if self._live is not None:
            self._live.close(fmt.FAILED)
            self._live = None

    def _write_run_json(self, status: str, error: str | None = None,
                        offsets_end: list[ClockOffset] | None = None) -> None:
        path = self.config.out_dir / fmt.RUN_FILE
        run = read_json(path) if path.exists() else {}  # the runner may have put facts there
        ddp = self.model
        layouts = self._recorder.layouts if self._recorder else []
        run.update({
            "format": fmt.FORMAT, "version": fmt.VERSION, "status": status,
            "world_size": self.world_size, "backend": self.backend, "device": self._meta["device"],
            "clock": self.clock.kind, "hosts": self.hosts, "torch_version": str(torch.__version__),
            **ddp_facts(ddp),
            "param_names": self._meta["param_names"], "param_bytes": self._meta["param_bytes"],
            "param_dtypes": self._meta["param_dtypes"],
            # DDP's layout after its rebuild, as the communication hook saw it
            "bucket_layout": layouts[-1]["buckets"] if layouts else None,
            "clock_offsets": {
                "start": [o.to_json() for o in self.offsets_start],
                "end": None if offsets_end is None else [o.to_json() for o in offsets_end],
            },
            "steps": self._recorder.steps_written if self._recorder else 0,
            "capture_path": self._meta["capture_path"], "capture_path_note": self._meta["capture_path_note"],
            "grad_marks_every": self.config.grad_marks_every,
            "ranks": [fmt.rank_file(r) for r in range(self.world_size)],
            "sharding": zero_stage(self._recorder.optimizer if self._recorder else None),
            **self.config.run_meta,
        })
        run.setdefault("started_at", fmt.started_at())
        if error:
            run["error"] = error
        write_json_atomic(path, run)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))
