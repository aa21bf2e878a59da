"""Zero-code capture: trace every rank of an unmodified training script.

``ddpscope run -- train.py`` starts the script's ranks with ``bootstrap/`` on
``PYTHONPATH`` and a ``CaptureConfig`` in ``$DDPSCOPE_CAPTURE``. The bootstrap's
``sitecustomize`` calls ``install_from_env()``, which waits for torch's DDP module to be
imported (no torch import of its own) and then patches, in place:

- ``DistributedDataParallel.__init__``: the arguments are bound to DDP's real
  signature, ``bucket_cap_mb`` is overridden when asked, and once DDP is built the
  model is traced (``DDPTracer`` with ``optimizer="auto"``). The class itself stays
  the same object, so frameworks that import it by name and check ``isinstance``
  (Lightning, Accelerate) build and see the traced model;
- ``torch.distributed.destroy_process_group``: the trace is finished while the process
  group still works (its end clock offsets are a collective);
- FSDP2's ``FSDPState._lazy_init``: when a root is initialised (its first forward),
  the FSDP2 model is traced per unit (``sharded/fsdp_tracer.py``), after the rerun's
  sharding settings are applied; FSDP1's constructor: said to be untraced.

The user's training comes first: whatever goes wrong in here is said in one line on
stderr (rank 0) and in ``run.json`` (``notes``), and the script goes on, untraced.
With ``steps``, the job ends cleanly after that many traced optimizer steps: the
trace is closed (complete), then ``SystemExit(0)`` unwinds the script; a timer ends
the process after ``exit_grace_s`` should the script swallow it or hang in teardown.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import inspect
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.after_import import after_import
from ddpscope.tracer.options import (
    BACKWARD_PREFETCH,
    BUCKET_CAP_MB,
    BUCKET_CAP_MB_LIST,
    CAPTURE,
    FORWARD_PREFETCH,
    OUT,
    RESHARD_AFTER_FORWARD,
    STEPS,
    check_fields,
    mib_list,
)
from ddpscope.tracer.progress import emit_progress, say
from ddpscope.tracer.writer import update_run_json

CAPTURE_ENV = "DDPSCOPE_CAPTURE"
DDP_MODULE = "torch.nn.parallel.distributed"
FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"  # FullyShardedDataParallel: said untraced
FSDP2_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"  # FSDPState._lazy_init: traced


@dataclass(kw_only=True)
class CaptureConfig:
    """What a rank of a ``ddpscope run`` job traces (sent through ``$DDPSCOPE_CAPTURE``).

    out: the run folder. bucket_cap_mb, bucket_cap_mb_list: override the script's (MiB;
    None keeps it).
    steps: end the job after this many traced optimizer steps (None: run to the end).
    progress: rank 0 prints a progress line per step for the launcher.
    exit_grace_s: after ``steps``, how long the script may take to unwind (seconds).
    profile_steps: also run torch.profiler on this many first traced steps (None: off).
    capture, capture_note: how all-reduces are timed, and why not compiled (``TracerConfig``).
    reshard_after_forward, forward_prefetch, backward_prefetch: FSDP2 settings overriding
    the script's (``sharded/settings.py``; None keeps the script's).
    """

    out: str = OUT.field()
    bucket_cap_mb: float | None = BUCKET_CAP_MB.field()
    bucket_cap_mb_list: list[float] | None = BUCKET_CAP_MB_LIST.field()
    steps: int | None = STEPS.field()
    progress: bool = True
    exit_grace_s: float = 30.0
    profile_steps: int | None = None
    capture: str = CAPTURE.field()
    capture_note: str | None = None
    reshard_after_forward: str | None = RESHARD_AFTER_FORWARD.field()
    forward_prefetch: int | None = FORWARD_PREFETCH.field()
    backward_prefetch: int | None = BACKWARD_PREFETCH.field()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.bucket_cap_mb_list is not None:
            self.bucket_cap_mb_list = list(mib_list(self.bucket_cap_mb_list))

    def to_env(self) -> dict[str, str]:
        return {CAPTURE_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ=os.environ) -> "CaptureConfig | None":
        raw = environ.get(CAPTURE_ENV)
        if not raw:
            return None
        return cls(**json.loads(raw))


class Session:
    """This process's capture: which DDP model is traced, what could not be, and the end."""

    def __init__(self, config: CaptureConfig) -> None:
        self.config = config
        self.script_caps: dict = {}  # the script's own bucket_cap_mb(_list), as it built DDP
        self.tracer = None
        self.profiler = None  # torch.profiler beside the tracer (--profile)
        self.stacks = None  # where faulthandler writes this rank's stacks on SIGUSR1
        self.notes: list[str] = []
        self.error: str | None = None  # an uncaught exception, seen by the excepthook
        self._last = time.perf_counter()
        # when this rank's script started (the bootstrap ran), torch's DDP was importable,
        # and the traced model was built: µs on the host monotonic clock (the trace's)
        self.times_us: dict[str, float] = {"bootstrap": _now_us()}
        self._lock = threading.Lock()

    # -- what the patches call ------------------------------------------------------
    def on_ddp_built(self, ddp, script_cap: Any, overridden: bool) -> None:
        if self.tracer is not None and type(self.tracer).__name__ != "DDPTracer":
            self.note(f"the script mixes DDP and FSDP: the DDP model ({type(ddp.module).__name__}) is not traced; "
                      "the FSDP2 model is")
            return
        if self.tracer is not None:
            self.note(f"a second DistributedDataParallel model ({type(ddp.module).__name__}) was built; "
                      f"only the first ({type(self.tracer.model.module).__name__}) is traced")
            return
        reason = untraceable(ddp)
        if reason:
            self.note(f"{reason}; the script runs untraced")
            return
        from ddpscope.tracer.capture.tracer import DDPTracer, TracerConfig

        self.times_us["ddp_built"] = _now_us()
        facts = {"capture_times_us": self.times_us, "capture": "ddpscope run", "bucket_cap_mb_script": script_cap,
                 "bucket_cap_mb_list_script": self.script_caps.get("bucket_cap_mb_list_script"),
                 "bucket_cap_mb_requested": self.config.bucket_cap_mb if overridden else None,
                 "bucket_cap_mb_list_requested": self.config.bucket_cap_mb_list if overridden else None,
                 "steps_requested": self.config.steps, "notes": self.notes}
        tracer = DDPTracer(ddp, "auto", TracerConfig(out_dir=self.config.out, run_meta=facts,
                                                           capture=self.config.capture,
                                                           capture_note=self.config.capture_note), on_step=self.on_step)
        why = tracer.start()  # never raises: says why it could not
        if why is not None:
            self.note(why)
            return
        self.tracer = tracer
        if self.config.profile_steps:
            self.profiler = _start_profiler(tracer, self.config)
        self._last = time.perf_counter()

    def on_step(self, step_record) -> None:
        """After each closed step (training thread): progress, and the step limit."""
        tracer = self.tracer
        if tracer is None:  # the trace is being finished (its open step closes)
            return
        if self.profiler is not None:
            self.profiler.after_step(step_record.step)
        now = time.perf_counter()
        done = tracer.steps
        if self.config.progress and tracer.rank == 0:
            emit_progress(event="step", step=done, steps=self.config.steps, ms=round((now - self._last) * 1e3, 1))
        self._last = now
        if self.config.steps is not None and done >= self.config.steps:
            self.finish()
            _exit_soon(self.config.exit_grace_s)
            raise SystemExit(0)  # unwinds the script; its finally blocks still run

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
            if cfg.forward_prefetch or cfg.backward_prefetch:
                apply_prefetch(units, cfg.forward_prefetch or None, cfg.backward_prefetch)
        except ValueError as e:  # FSDP's own check (N must divide the shard group): said, the script's kept
            self.note(f"--reshard-after-forward / prefetch not applied ({e}); the script's settings stay")
        self.times_us["ddp_built"] = _now_us()
        facts = {"capture_times_us": self.times_us, "capture": "ddpscope run", "sharding_requested": requested,
                 "steps_requested": cfg.steps, "notes": self.notes}
        if cfg.bucket_cap_mb is not None or cfg.bucket_cap_mb_list is not None:
            self.note("--bucket-cap-mb(-list) applies to DDP; this script shards with FSDP2, which has no buckets")
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

    # -- the end --------------------------------------------------------------------
    def finish(self, error: str | None = None) -> None:
        """Close the trace once (never raises: the script's own ending comes first)."""
        with self._lock:
            tracer, self.tracer = self.tracer, None
            profiler, self.profiler = self.profiler, None
        if profiler is not None:
            profiler.stop()  # saves the steps it recorded (never raises)
        if tracer is None:
            return
        try:
            tracer.close(error or self.error)
        except Exception as e:  # noqa: BLE001
            say(f"could not finish the trace: {type(e).__name__}: {e}")

    def note(self, text: str) -> None:
        """Say something once on stderr (rank 0) and keep it in run.json's notes."""
        self.notes.append(text)
        if _rank() == 0:
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


def is_worker(environ=os.environ) -> bool:
    """A rank of a launched job (torchrun, or a framework's launcher, sets these), not
    the launcher itself nor an unrelated Python process that inherited the environment."""
    return "RANK" in environ or "LOCAL_RANK" in environ


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"


def release_agent_store(environ=os.environ, argv: list[str] | None = None) -> None:
    """In a process the script spawns itself (``torch.multiprocessing.spawn``, the ZeRO
    recipe's ``mp.spawn(example, ...)``), forget the torchrun rank's
    ``TORCHELASTIC_USE_AGENT_STORE``: inherited, it makes ``init_process_group`` join
    torchrun's agent store instead of hosting the script's own, and rank 0 waits for a
    store nobody hosts. ``ddpscope run`` puts every script under torchrun; the ranks such
    a script makes host their store as under ``python script.py``. Only spawned
    processes (``--multiprocessing-fork`` on their command line) are touched."""
    argv = sys.orig_argv if argv is None else argv
    if "--multiprocessing-fork" in argv:
        environ.pop(AGENT_STORE_ENV, None)


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


# -- installing -------------------------------------------------------------------------
_session: Session | None = None


def install_from_env() -> Session | None:
    """Install the capture if ``$DDPSCOPE_CAPTURE`` asks for it (the bootstrap calls this)."""
    global _session
    if _session is not None:
        return _session
    config = CaptureConfig.from_env()
    if config is None:
        return None
    release_agent_store()
    if not is_worker():
        return None
    _session = Session(config)
    _session.stacks = _register_stack_dump(config.out)
    after_import(DDP_MODULE, functools.partial(_patch_ddp, _session))
    after_import(FSDP1_MODULE, functools.partial(_patch_fsdp1, _session))
    after_import(FSDP2_STATE_MODULE, functools.partial(_patch_fsdp2, _session))
    _chain_excepthook(_session)
    atexit.register(_session.finish)
    return _session


def _register_stack_dump(out: str):
    """On SIGUSR1 (the launcher's hang watchdog sends it), faulthandler writes every
    thread's Python stack to RUN/logs/stacks-rank-<r>.txt, from C, even while the
    training thread is stuck. Returns the open file (kept for the process's life)."""
    try:
        path = Path(out) / fmt.stacks_file(int(os.environ.get("RANK", "0")))
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "w")  # noqa: SIM115 - faulthandler writes to its descriptor until exit
        faulthandler.register(getattr(signal, fmt.STACKS_SIGNAL_NAME), file=f, all_threads=True)
        return f
    except (OSError, ValueError, RuntimeError):
        return None


def _patch_ddp(session: Session, module) -> None:
    session.times_us.setdefault("torch_imported", _now_us())
    ddp_cls = module.DistributedDataParallel
    original = ddp_cls.__init__
    if getattr(original, "_ddpscope", False):
        return
    signature = inspect.signature(original)
    cap, caps = session.config.bucket_cap_mb, session.config.bucket_cap_mb_list
    has_list = "bucket_cap_mb_list" in signature.parameters  # PyTorch >= 2.13
    if caps is not None and not has_list:  # an older DDP: one cap for every bucket
        cap, caps = max(caps), None
        session.note(f"this PyTorch's DDP takes no bucket_cap_mb_list: --bucket-cap-mb-list runs as bucket_cap_mb "
                     f"{cap:g} MiB (its largest), one cap for every bucket")

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # DDP's own error, as the script would have had it
            return original(self, *args, **kwargs)
        script_cap = bound.arguments.get("bucket_cap_mb")
        script_list = bound.arguments.get("bucket_cap_mb_list")
        try:
            session.script_caps = {"bucket_cap_mb_list_script": [float(c) for c in script_list] if script_list
                                   else None}
        except (TypeError, ValueError):  # not a list of numbers: DDP says so below
            session.script_caps = {}
        if cap is not None:
            bound.arguments["bucket_cap_mb"] = cap
            if bound.arguments.get("bucket_cap_mb_list"):
                bound.arguments["bucket_cap_mb_list"] = None  # it would win over bucket_cap_mb
                session.note(f"the script's bucket_cap_mb_list is replaced by --bucket-cap-mb {cap:g}")
        elif caps is not None:  # it wins over the script's bucket_cap_mb (the largest becomes the cap)
            bound.arguments["bucket_cap_mb_list"] = list(caps)
        original(*bound.args, **bound.kwargs)  # DDP's errors reach the script as they are
        try:
            session.on_ddp_built(self, script_cap, cap is not None or caps is not None)
        except Exception as e:  # noqa: BLE001 - training goes on, untraced
            session.note(f"tracing could not start ({type(e).__name__}: {e}); the script runs untraced")
        return None

    __init__._ddpscope = True
    ddp_cls.__init__ = __init__
    _patch_destroy(session)


def _patch_destroy(session: Session) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_ddpscope", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        try:
            group = signature.bind(*args, **kwargs).arguments.get("group")
        except TypeError:  # torch's own error, as the script would have had it
            return original(*args, **kwargs)
        if group is None or group is c10d.GroupMember.WORLD:
            exc = sys.exc_info()[1]  # inside a finally while an exception unwinds: a failed run
            session.finish(None if exc is None or isinstance(exc, SystemExit) and not exc.code
                           else f"{type(exc).__name__}: {exc}")
        return original(*args, **kwargs)

    destroy_process_group._ddpscope = True
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _patch_fsdp1(session: Session, module) -> None:
    cls = getattr(module, "FullyShardedDataParallel", None)
    if cls is None or getattr(cls.__init__, "_ddpscope", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        try:
            session.on_fsdp1()
        except Exception:  # noqa: BLE001 - a note is not worth a training run
            pass

    __init__._ddpscope = True
    cls.__init__ = __init__


def _patch_fsdp2(session: Session, module) -> None:
    """``FSDPState._lazy_init``: once FSDP made a state the root (its first forward, or
    an explicit ``unshard``), every unit is known; the tracer starts there."""
    cls = getattr(module, "FSDPState", None)
    original = getattr(cls, "_lazy_init", None)
    if original is None or getattr(original, "_ddpscope", False):
        return
    session.times_us.setdefault("torch_imported", _now_us())

    @functools.wraps(original)
    def _lazy_init(self, *args, **kwargs):
        first = getattr(self, "_is_root", None) is None
        result = original(self, *args, **kwargs)  # FSDP's errors reach the script as they are
        if first and getattr(self, "_is_root", False):
            try:
                session.on_fsdp_root(self)
            except Exception as e:  # noqa: BLE001 - training goes on, untraced
                session.note(f"tracing could not start ({type(e).__name__}: {e}); the script runs untraced")
        return result

    _lazy_init._ddpscope = True
    cls._lazy_init = _lazy_init
    _patch_destroy(session)


def _chain_excepthook(session: Session) -> None:
    previous = sys.excepthook

    def excepthook(exc_type, exc, tb):
        try:
            session.error = f"{exc_type.__name__}: {exc}"
            session.finish(session.error)
            _record_error(exc_type, exc, tb)
        finally:  # the script's (or Python's) own hook, whatever happened above
            previous(exc_type, exc, tb)

    sys.excepthook = excepthook


def _record_error(exc_type, exc, tb) -> None:
    """What torch's ``@record`` writes for an uncaught exception (torchrun's error file),
    for scripts without it: the launcher names the rank that failed first from these."""
    import traceback

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):  # the script's own @record wrote it already
        return
    data = {"message": {"message": f"{exc_type.__name__}: {exc}", "extraInfo": {
        "py_callstack": "".join(traceback.format_exception(exc_type, exc, tb)),
        "timestamp": str(int(time.time())), "time_ns": time.time_ns()}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        pass


def _exit_soon(grace_s: float) -> None:
    """End the process after ``grace_s`` even if the script catches ``SystemExit`` or
    hangs in its teardown (the trace is already closed and complete)."""
    def end():
        time.sleep(grace_s)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)

    threading.Thread(target=end, name="ddpscope-exit", daemon=True).start()


def _now_us() -> float:
    return time.perf_counter_ns() / 1000.0  # the clock the trace uses on CPU (tracer.capture.clock)


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", 0))
