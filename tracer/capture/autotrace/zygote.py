"""A warm rank factory: a process that has imported torch once and forks ranks on request.

``tracer.launch.warm.WarmLauncher`` starts it (``python -m ddpscope.tracer.capture.autotrace.zygote``) and
talks to it in JSON lines over its stdin/stdout. For a job it forks ``nproc`` ranks; each
rank sets up the environment torchrun would give it (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, TORCHELASTIC_*, OMP_NUM_THREADS), writes its stdout/stderr to
torchrun's log layout (``<log_dir>/<run_id>/attempt_0/<rank>/``), installs the capture
and runs the script as ``__main__`` (``runpy``), as ``python script.py`` would. What a
cold launch spends on process start and ``import torch`` (seconds on 2 cores) is then
spent once, ahead of time.

Only the forking thread survives a fork, so the zygote stays single-threaded and does
no torch work before forking: nothing it holds can be locked in a child. The ranks are
the zygote's children and own sessions (the launcher kills them by process group); the
zygote ends, killing any rank, when its stdin closes or its parent dies.
"""

from __future__ import annotations

import json
import os
import select
import signal
import sys
import time

_T0 = time.perf_counter()
_PARENT = os.getppid()
import torch  # noqa: E402  - the point of this process
import torch._dynamo  # noqa: E402,F401  (DDP's constructor imports it: ~1.7 s on 2 cores, once here)
import torch.distributed  # noqa: E402,F401
import torch.distributed.elastic.multiprocessing.errors  # noqa: E402,F401  (scripts' @record)
import torch.nn.parallel  # noqa: E402,F401

from ddpscope.tracer.launch.torchrun import kill_group  # noqa: E402  (stdlib only: the launcher's own reaping)

IMPORT_S = time.perf_counter() - _T0


def _send(msg: dict) -> None:
    os.write(1, (json.dumps(msg) + "\n").encode())


def _die_with_parent() -> None:
    """SIGTERM this process when its parent (the launcher) dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != _PARENT:  # it died while torch was imported: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def serve() -> None:
    jobs: dict[str, dict] = {}  # job id -> {"pids": {pid: rank}, "codes": [...]}
    _die_with_parent()
    signal.signal(signal.SIGTERM, lambda *_: _shutdown(jobs))
    _send({"event": "ready", "pid": os.getpid(), "import_s": round(IMPORT_S, 3)})
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.05)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:  # the launcher went away
                _shutdown(jobs)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.strip():
                    _handle(json.loads(line), jobs)
        _reap(jobs)


def _handle(req: dict, jobs: dict) -> None:
    if req.get("op") == "launch":
        pids = {}
        for rank in range(int(req["nproc"])):
            pid = os.fork()
            if pid == 0:
                _rank_main(req, rank)  # never returns
            pids[pid] = rank
        jobs[req["id"]] = {"pids": pids, "codes": [None] * len(pids)}
        _send({"event": "started", "id": req["id"], "pids": sorted(pids, key=pids.get)})
    elif req.get("op") == "kill":
        for pid in jobs.get(req["id"], {}).get("pids", {}):
            kill_group(pid)


def _reap(jobs: dict) -> None:
    for job_id, job in list(jobs.items()):
        for pid, rank in job["pids"].items():
            if job["codes"][rank] is not None:
                continue
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                job["codes"][rank] = os.waitstatus_to_exitcode(status)
        if all(c is not None for c in job["codes"]):
            _send({"event": "exited", "id": job_id, "codes": job["codes"]})
            del jobs[job_id]


def _shutdown(jobs: dict) -> None:
    for job in jobs.values():
        for pid in job["pids"]:
            kill_group(pid)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
    os._exit(0)


def _rank_main(req: dict, rank: int) -> None:
    """In the forked rank: become what torchrun would have started, run the script."""
    code = 1
    try:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        nproc = int(req["nproc"])
        logs = os.path.join(req["log_dir"], req["run_id"], "attempt_0", str(rank))
        os.makedirs(logs, exist_ok=True)
        for fd, name in ((1, "stdout.log"), (2, "stderr.log")):
            os.dup2(os.open(os.path.join(logs, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        env = {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(nproc), "ROLE_NAME": "default",
            "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(req["master_port"]),
            "TORCHELASTIC_RUN_ID": req["run_id"], "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_ERROR_FILE": os.path.join(logs, "error.json"),
            "PYTHONUNBUFFERED": "1",
        }
        os.environ.clear()  # the launcher's environment now, as torchrun would pass it on
        os.environ.update({**req.get("env", {}), **env})
        # torchrun's default for several ranks on a node; torch read the variable at import
        threads = os.environ.setdefault("OMP_NUM_THREADS", "1" if nproc > 1 else str(os.cpu_count() or 1))
        torch.set_num_threads(int(threads))
        _reseed_numpy()
        from ddpscope.tracer.capture.autotrace.install import install_from_env

        install_from_env()
        os.chdir(req["cwd"])
        code = _run_script(req)
    except BaseException:  # noqa: BLE001 - set-up failed: say so where the launcher looks
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def _run_script(req: dict) -> int:
    """Run the script as ``__main__``; its exit code. Its atexit handlers run before we
    leave, as at a normal interpreter exit (``os._exit`` then skips the zygote's)."""
    import atexit
    import runpy
    import threading

    target, args = req["target"], list(req.get("args", []))
    code = 0
    try:
        if req.get("module"):
            sys.argv = [target, *args]
            sys.path[0] = req["cwd"]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            path = os.path.abspath(target)
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(path)
            runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter would: print it, exit 1
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # join non-daemon threads, as the interpreter does at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _reseed_numpy() -> None:
    """A fresh process seeds NumPy's global generator from the OS; a fork would copy the
    zygote's state into every rank. (Python's ``random`` reseeds itself after a fork.)"""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()


if __name__ == "__main__":
    serve()
