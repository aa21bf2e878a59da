"""This process's capture: which model is traced (the first DDP or FSDP2 model built), what
could not be and why (said once, kept in run.json's notes), progress and the step limit
after each step, and the end (the trace closed once, whatever ends the script)."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.autotrace.config import CaptureConfig
from ddpscope.tracer.capture.autotrace.step_limit import end_job
from ddpscope.tracer.progress import emit_progress, say
from ddpscope.tracer.writer import update_run_json

#: the pid of the process whose session set it (see ``Session.rank_process``)
SESSION_PID_ENV = "DDPSCOPE_SESSION_PID"


def _model_folder(k: int, ddp) -> str:
    """The run folder of the job's DDP model ``k`` (1 for the second built), relative to
    the job's own: ``models/<k>-<class>``."""
    return f"{fmt.MODELS_DIR}/{k}-{type(ddp.module).__name__}"


class Session:
    """This process's capture: which DDP model is traced, what could not be, and the end."""

    def __init__(self, config: CaptureConfig) -> None:
        self.config = config
        self.script_caps: dict = {}  # the script's own bucket_cap_mb(_list), as it built DDP
        self.built_by: dict | None = None  # who built the traced model (built_by.py), where
        self.tracer = None
        self.extra: list = []  # the tracers of further DDP models, each into models/<k>-<class>
        self.profiler = None  # torch.profiler beside the tracer (--profile)
        self.stacks = None  # where faulthandler writes this rank's stacks on SIGUSR1
        self.notes: list[str] = []
        self.error: str | None = None  # an uncaught exception, seen by the excepthook
        self._last = time.perf_counter()
        # when this rank's script started (the bootstrap ran), torch's DDP was importable,
        # and the traced model was built: µs on the host monotonic clock (the trace's)
        self.times_us: dict[str, float] = {"bootstrap": now_us()}
        self.world_destroyed = False  # the script destroyed its default process group (patches.py)
        # A process the rank's script starts (an inductor compile worker, a data loader) inherits
        # its environment, and with it a session of its own: not the rank (what it would say of
        # the rank's job, it says of itself)
        self.pid = os.getpid()  # a process forked from the rank has this session too, and another pid
        self.rank_process = os.environ.get(SESSION_PID_ENV, str(self.pid)) == str(self.pid)
        os.environ[SESSION_PID_ENV] = str(self.pid)
        self._lock = threading.Lock()

    # -- what the patches call ------------------------------------------------------
    def on_ddp_built(self, ddp, script_cap: Any, overridden: bool) -> None:
        if self.tracer is not None and type(self.tracer).__name__ != "DDPTracer":
            self.note(f"the script mixes DDP and FSDP: the DDP model ({type(ddp.module).__name__}) is not traced; "
                      "the FSDP2 model is")
            return
        if self.tracer is not None:
            self._trace_another(ddp, script_cap, overridden)
            return
        reason = untraceable(ddp)
        if reason:
            self.note(f"{reason}; the script runs untraced")
            return
        from ddpscope.tracer.capture.ddp.tracer import DDPTracer, TracerConfig

        self.times_us["ddp_built"] = now_us()
        facts = {"capture_times_us": self.times_us, **self._ddp_facts(script_cap, overridden), "notes": self.notes}
        tracer = DDPTracer(ddp, "auto", TracerConfig(out_dir=self.config.out, run_meta=facts,
                                                           capture=self.config.capture,
                                                           capture_note=self.config.capture_note,
                                                           grad_marks_every=self.config.grad_marks_every),
                            on_step=self.on_step)
        why = tracer.start()  # never raises: says why it could not
        if why is not None:
            self.note(why)
            return
        self.tracer = tracer
        if self.config.profile_steps:
            self.profiler = _start_profiler(tracer, self.config)
        self._last = time.perf_counter()

    def _ddp_facts(self, script_cap: Any, overridden: bool) -> dict:
        """run.json's facts of a traced DDP model: its bucket caps, as the script set them
        and as overridden, and the step limit."""
        return {"capture": "ddpscope run", "bucket_cap_mb_script": script_cap,
                "bucket_cap_mb_list_script": self.script_caps.get("bucket_cap_mb_list_script"),
                "ddp_built_by": self.built_by,
                "bucket_cap_mb_requested": self.config.bucket_cap_mb if overridden else None,
                "bucket_cap_mb_list_requested": self.config.bucket_cap_mb_list if overridden else None,
                "steps_requested": self.config.steps}

    def _trace_another(self, ddp, script_cap: Any, overridden: bool) -> None:
        """A further DDP model (a GAN's discriminator, a teacher): traced as the first is,
        with its own buckets, layout and steps (its own optimizer's), into a run folder of
        its own, ``models/<k>-<class>``; the main run.json lists them all. Every rank
        builds the models in the same order, so every rank's tracers pair up."""
        from ddpscope.tracer.capture.ddp.tracer import DDPTracer, TracerConfig

        name = type(ddp.module).__name__
        reason = untraceable(ddp)
        k = len(self.extra) + 1
        folder = _model_folder(k, ddp)
        if reason:
            self.note(f"DDP model {k} ({name}): {reason}; it runs untraced")
            return
        out = Path(self.config.out) / folder
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            self.note(f"DDP model {k} ({name}) is not traced: {folder} cannot be made ({e.strerror or e})")
            return
        facts = {**self._ddp_facts(script_cap, overridden), "model_index": k, "model_of": "../..",
                 "notes": [f"model {k} of this job ({name}); the job's run folder is ../.."]}
        tracer = DDPTracer(ddp, "auto", TracerConfig(out_dir=out, run_meta=facts, capture=self.config.capture,
                                                     capture_note=self.config.capture_note,
                                                     grad_marks_every=self.config.grad_marks_every))
        why = tracer.start()  # never raises (a collective inside: every rank starts it alike)
        if why is not None:
            self.note(f"DDP model {k} ({name}): {why}")
            return
        self.extra.append(tracer)
        first = type(self.tracer.model.module).__name__
        models = [{"index": 0, "model": first, "folder": "."}] + [
            {"index": i, "model": type(t.model.module).__name__, "folder": _model_folder(i, t.model)}
            for i, t in enumerate(self.extra, 1)]
        if rank() == 0:
            try:
                update_run_json(self.config.out, {"models": models})
            except OSError:
                pass
        self.note(f"DDP model {k} ({name}) is traced too, into {folder} (its own buckets, layout and steps)")

    def on_step(self, step_record) -> None:
        """After each closed step (training thread): progress, and the step limit."""
        tracer = self.tracer
        if tracer is None:  # the trace is being finished (its open step closes)
            return
        if self.profiler is not None:
            self.profiler.after_step(step_record.step)
        self._after_step(tracer.steps, tracer.rank)

    def _after_step(self, done: int, rank_: int) -> None:
        """``done`` steps are done on this rank: progress (rank 0), and the step limit."""
        now = time.perf_counter()
        if self.config.progress and rank_ == 0:
            emit_progress(event="step", step=done, steps=self.config.steps, ms=round((now - self._last) * 1e3, 1))
        self._last = now
        if self.config.steps is not None and done >= self.config.steps:
            end_job(self.finish, self.config.exit_grace_s, self.config.steps, self.note, rank_)

    def on_fsdp1(self) -> None:
        if not any("FullyShardedDataParallel" in n for n in self.notes):
            self.note("FSDP1 (FullyShardedDataParallel) is not traced: ddpscope traces DistributedDataParallel "
                      "and FSDP2 (fully_shard); the FSDP1 model runs untraced")

    def on_fsdp_root(self, root_state) -> None:
        """FSDP2 lazily initialised a root (its first forward): every unit is known now."""
        from ddpscope.tracer.capture.sharded.fsdp_tracer import FSDPTracer
        from ddpscope.tracer.capture.sharded.settings import apply_prefetch, apply_reshard, parse_reshard
        from ddpscope.tracer.capture.sharded.units import find_units
        from ddpscope.tracer.capture.sharded.units import problems as fsdp_problems
        from ddpscope.tracer.capture.tracer_config import TracerConfig

        root = root_state._modules[0]
        if self.tracer is not None:
            what = "DDP" if type(self.tracer).__name__ == "DDPTracer" else "FSDP"
            self.note(f"the script mixes DDP and FSDP: a second model ({type(root).__name__}, FSDP2) is not traced; "
                      f"the first one traced ({what}) is")
            return
        cfg = self.config
        requested = {"reshard_after_forward": cfg.reshard_after_forward, "forward_prefetch": cfg.forward_prefetch,
                     "backward_prefetch": cfg.backward_prefetch}
        try:  # the rerun's settings, before any unit is gathered
            units = find_units(root_state)
            if cfg.reshard_after_forward is not None:
                apply_reshard(units, parse_reshard(cfg.reshard_after_forward))
            if cfg.forward_prefetch is not None or cfg.backward_prefetch is not None:
                apply_prefetch(units, cfg.forward_prefetch, cfg.backward_prefetch)
        except ValueError as e:  # FSDP's own check (N must divide the shard group): said, the script's kept
            self.note(f"--reshard-after-forward / prefetch not applied ({e}); the script's settings stay")
        self.times_us["ddp_built"] = now_us()
        facts = {"capture_times_us": self.times_us, "capture": "ddpscope run", "sharding_requested": requested,
                 "steps_requested": cfg.steps, "notes": self.notes,
                 "fsdp_trained_by": None if self.built_by is None else {"framework": self.built_by["framework"]}}
        if cfg.bucket_cap_mb is not None or cfg.bucket_cap_mb_list is not None:
            self.note("--bucket-cap-mb(-list) applies to DDP; this script shards with FSDP2, which has no buckets")
        if cfg.grad_marks_every > 1:
            self.note("--grad-marks-every applies to DDP; an FSDP2 trace has no gradient-ready marks to thin")
        tracer = FSDPTracer(root, root_state, TracerConfig(out_dir=cfg.out, capture="python"), on_step=self.on_step,
                            run_meta=facts)
        why = tracer.start()  # never raises: says why it could not
        if why is not None:
            self.note(why)
            return
        self.tracer = tracer
        for problem in fsdp_problems(tracer.units):  # traced, with what its figures leave out
            self.note(problem)
        if cfg.profile_steps:
            self.profiler = _start_profiler(tracer, cfg)
        self._last = time.perf_counter()

    def on_deepspeed_engine(self, engine) -> None:
        """``deepspeed.initialize`` built an engine: traced (``DeepSpeedTracer``) unless it
        uses what ddpscope does not trace (named once; then its settings still go to
        run.json, kind ``deepspeed``, and ``--steps`` counts its optimizer steps)."""
        from ddpscope.tracer.capture.deepspeed.engine_facts import engine_facts, untraced_features
        from ddpscope.tracer.capture.deepspeed.patches import count_steps
        from ddpscope.tracer.capture.deepspeed.tracer import DeepSpeedTracer
        from ddpscope.tracer.capture.tracer_config import TracerConfig

        facts = engine_facts(engine)
        if self.tracer is not None:
            self.note(f"the script builds a DeepSpeed engine beside the traced model: the engine "
                      f"({facts['engine']}) is not traced")
            return
        what = f"DeepSpeed ZeRO stage {facts['zero_stage']} ({facts['engine']}, {facts['dtype']})"
        if self.config.grad_marks_every > 1:
            self.note("--grad-marks-every applies to DDP; a DeepSpeed trace has no gradient-ready marks to thin")
        features = untraced_features(engine, facts)
        why = f"{', '.join(features)} in use: ddpscope does not trace it" if features else None
        if why is None:
            self.times_us["ddp_built"] = now_us()
            meta = {"capture_times_us": self.times_us, "capture": "ddpscope run", "steps_requested": self.config.steps,
                    "notes": self.notes}
            tracer = DeepSpeedTracer(engine, facts, TracerConfig(out_dir=self.config.out, capture="python"),
                                     on_step=self.on_step, run_meta=meta)
            why = tracer.start()  # never raises: says why it could not
            if why is None:
                self.tracer = tracer
                if self.config.profile_steps:
                    self.profiler = _start_profiler(tracer, self.config)
                self._last = time.perf_counter()
                return
        if rank() == 0:
            try:
                update_run_json(self.config.out, {"kind": fmt.KIND_DEEPSPEED, "status": fmt.UNTRACED,
                                                   "deepspeed": facts})
            except OSError:
                pass
        self.note(f"{what} was built but is not traced ({why}); the job runs untraced, its settings are in run.json")
        if self.config.steps is not None:
            count_steps(engine, lambda done: self._after_step(done, rank()))

    # -- the end --------------------------------------------------------------------
    def finish(self, error: str | None = None) -> None:
        """Close the trace once (never raises: the script's own ending comes first)."""
        if self.tracer is None and not self.extra and not self.notes:
            self._say_why_nothing_was_built()
        with self._lock:
            tracer, self.tracer = self.tracer, None
            profiler, self.profiler = self.profiler, None
            extra, self.extra = self.extra, []
        if profiler is not None:
            profiler.stop()  # saves the steps it recorded (never raises)
        # every rank closes its tracers in the order it made them (each close ends with a collective)
        for t in ([tracer] if tracer is not None else []) + extra:
            try:
                t.close(error or self.error)
            except Exception as e:  # noqa: BLE001
                say(f"could not finish the trace: {type(e).__name__}: {e}")

    def _say_why_nothing_was_built(self) -> None:
        """At the end of a rank of a job of several that traced nothing and said nothing:
        what is likely (rank 0 says it, and the launcher then says it instead of "no DDP
        model was built"): a script that never made a process group trained each rank
        alone; Accelerate, on a machine without accelerators, makes the group but wraps
        no model in DDP (it sees one process) unless told ``ACCELERATE_USE_CPU``."""
        try:
            world = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            return
        # (a rank's script may spawn the ranks that train, as mp.spawn does: they trace themselves)
        if world < 2 or rank() != 0 or not self.rank_process or os.getpid() != self.pid \
                or any(Path(self.config.out).glob("rank-*.json")):
            return
        dist, torch = sys.modules.get("torch.distributed"), sys.modules.get("torch")
        said = []
        try:
            if not self.world_destroyed and not (dist is not None and dist.is_available() and dist.is_initialized()):
                said.append(f"the script never initialised a process group (torch.distributed.init_process_group): "
                            f"each of the {world} ranks trained alone, so nothing was traced")
            if "accelerate" in sys.modules and torch is not None and not torch.cuda.is_available() and \
                    os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "y", "yes", "t", "true", "on") \
                    and _accelerate_saw_one_process():
                said.append("Accelerate wraps no model in DDP on a machine without accelerators unless "
                            "ACCELERATE_USE_CPU=1 is in the environment (what `accelerate launch --cpu` sets) or "
                            f"the script passes Accelerator(cpu=True): each of the {world} ranks trained alone; "
                            "rerun with it set")
        except RuntimeError:
            return
        if said:  # the launcher's last line says it (it reads the notes of a run that traced nothing)
            self.note("; ".join(said), echo=False)

    def note(self, text: str, echo: bool = True) -> None:
        """Say something once on stderr (rank 0) and keep it in run.json's notes
        (``echo=False``: only kept there; the launcher says it when the job ends)."""
        self.notes.append(text)
        if rank() == 0:
            if echo:
                say(text)
            try:
                update_run_json(self.config.out, {"notes": self.notes})
            except OSError:
                pass


def _start_profiler(tracer, config: CaptureConfig):
    """torch.profiler on the first ``config.profile_steps`` traced steps, or None (one
    line says why) if it cannot start: the trace goes on without it."""
    from ddpscope.tracer.capture.profile import StepProfiler

    try:
        return StepProfiler(config.out, tracer.rank, config.profile_steps,
                            cuda=str(tracer.clock.kind).startswith("cuda"), host_us=tracer.clock.host_us,
                            set_meta=tracer.set_meta).start()
    except Exception as e:  # noqa: BLE001 - training goes on
        say(f"rank {tracer.rank}: torch.profiler could not start ({type(e).__name__}: {e}); tracing goes on")
        return None


def untraceable(ddp) -> str | None:
    """Why this DDP model cannot be traced, or None."""
    if getattr(ddp, "_use_python_reducer", False):
        return ("DDP runs under compiled autograd's Python reducer (torch._dynamo.config.optimize_ddp="
                "'python_reducer'): gradients are reduced outside DDP's reducer, which ddpscope times")
    if getattr(ddp, "_delay_all_reduce_all_params", False):
        return "every parameter is in delay_all_reduce_named_params: DDP builds no reducer to time"
    if getattr(ddp, "reducer", None) is None:
        return "this DDP model has no reducer"
    return None


def _accelerate_saw_one_process() -> bool:
    """Accelerate's state, where it made one, says it runs one process (its
    ``distributed_type`` is ``NO``); True where it cannot be read (never raises)."""
    try:
        shared = sys.modules["accelerate.state"].PartialState._shared_state
        kind = shared.get("distributed_type", "NO")
        return getattr(kind, "value", kind) == "NO"
    except Exception:  # noqa: BLE001 - another Accelerate: say it as before
        return True


def now_us() -> float:
    return time.perf_counter_ns() / 1000.0  # the clock the trace uses on CPU (tracer.capture.clock)


def rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", 0))
