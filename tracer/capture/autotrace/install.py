"""Installing the zero-code capture in a rank (the bootstrap's ``sitecustomize`` calls
``install_from_env``): only in a launched rank whose environment asks for it; the
patches wait for their modules to be imported; an uncaught exception closes the trace
and is recorded for the launcher; SIGUSR1 dumps every thread's stack."""

from __future__ import annotations

import atexit
import faulthandler
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.autotrace.after_import import after_import
from ddpscope.tracer.capture.autotrace.config import CaptureConfig
from ddpscope.tracer.capture.autotrace.patches import (
    DDP_MODULE,
    FSDP1_MODULE,
    FSDP2_STATE_MODULE,
    _patch_ddp,
    _patch_fsdp1,
    _patch_fsdp2,
)
from ddpscope.tracer.capture.autotrace.session import Session
from ddpscope.tracer.capture.deepspeed.patches import DEEPSPEED_MODULE, patch_deepspeed


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


_session: Session | None = None  # this process's, once installed


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
    after_import(DEEPSPEED_MODULE, functools.partial(patch_deepspeed, _session))
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
