"""A launcher kept warm: single-node jobs started from a zygote with torch imported.

A cold ``torchrun`` launch on a 2-core machine spends seconds before the script's first
line: torchrun's own start, then every rank's interpreter start and ``import torch``.
``WarmLauncher`` starts one zygote (``tracer.capture.autotrace.zygote``) ahead of time and forks
the ranks from it, so the dashboard's rerun loop pays that once. It offers the same
``launch(cfg, on_line) -> LaunchResult`` as ``tracer.launch.torchrun`` with the same
guarantees: the same log layout (so failures are explained the same way), a watchdog,
Ctrl-C, every rank reaped. Multi-node jobs, and anything the zygote cannot start, go to
torchrun. Torch-free (the zygote imports torch, this process does not).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from ddpscope.tracer.launch import torchrun
from ddpscope.tracer.launch.hangs import HangWatch
from ddpscope.tracer.launch.torchrun import LaunchConfig, LaunchResult

# how often a running job's logs are read (its lines, the progress a page shows, arrive
# within this) when no message of the zygote's comes sooner: each turn opens every rank's
# two logs (at 0.05 s that was ~2.5 % of a core of the dashboard's server, beside the job)
POLL_S = 0.25


class WarmLauncher:
    """One zygote, one job at a time. ``start()`` begins warming in the background."""

    def __init__(self, env: dict[str, str] | None = None) -> None:
        self._env = env or {}
        self._proc: subprocess.Popen | None = None
        self._events: queue.Queue[dict | None] = queue.Queue()
        self._lock = threading.Lock()
        self.ready_s: float | None = None  # seconds the zygote took to import torch
        self.asked = False  # start() was called: a zygote is wanted from then on
        self.error: str | None = None

    # -- the zygote ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the zygote if it is not running (returns at once; it warms up alone)."""
        with self._lock:
            self.asked = True
            if self._proc is not None and self._proc.poll() is None:
                return
            env = {**os.environ, **self._env}
            self._events, self.ready_s = queue.Queue(), None
            spawned: queue.Queue[subprocess.Popen | BaseException] = queue.Queue()
            # Started from a thread of its own that lives as long as the zygote: the zygote
            # dies with the thread that started it (PR_SET_PDEATHSIG follows the parent
            # *thread*), and the caller's may be short-lived (each Streamlit page run has
            # its own: a zygote started there died when the page finished drawing).
            threading.Thread(target=self._spawn_and_read, args=(env, self._events, spawned), daemon=True,
                             name="ddpscope-zygote").start()
            got = spawned.get()
            if isinstance(got, BaseException):
                raise got
            self._proc = got

    def _spawn_and_read(self, env: dict, events: queue.Queue, spawned: queue.Queue) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ddpscope.tracer.capture.autotrace.zygote"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, env=env, start_new_session=True, bufsize=0)
        except BaseException as e:  # noqa: BLE001 - handed to start(), which raises it
            spawned.put(e)
            return
        spawned.put(proc)
        for raw in proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if msg.get("event") == "ready":
                self.ready_s = msg.get("import_s")
            events.put(msg)
        proc.wait()  # reaped here: the zygote leaves no zombie
        events.put(None)  # the zygote is gone

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.ready_s is None:
            if self._proc is None or self._proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def close(self) -> None:
        """Stop the zygote (it kills any rank still running)."""
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.close()
                proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()

    # -- a job ---------------------------------------------------------------------------
    def launch(self, cfg: LaunchConfig, on_line: torchrun.OnLine = lambda r, l, e: None) -> LaunchResult:
        """Run the job to its end (like ``torchrun.launch``); through torchrun when it
        spans nodes or the zygote cannot be had."""
        self.start()
        if cfg.nnodes != 1 or not self._wait_ready(120.0):
            return torchrun.launch(cfg, on_line)
        run_id = f"warm-{uuid.uuid4().hex[:8]}"
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        job_id = uuid.uuid4().hex
        # the ranks get this process's environment as it is now (as torchrun's would), not the
        # one the zygote started with
        request = {"op": "launch", "id": job_id, "target": cfg.target, "args": cfg.args, "module": cfg.module,
                   "cwd": str(cfg.cwd or Path.cwd()), "nproc": cfg.nproc, "env": {**os.environ, **cfg.env},
                   "log_dir": str(cfg.log_dir), "run_id": run_id, "master_port": torchrun.free_port()}
        proc, events = self._proc, self._events
        proc.stdin.write((json.dumps(request) + "\n").encode())
        tails = _Tails(cfg.log_dir / run_id / "attempt_0", cfg.nproc, on_line)
        deadline = time.monotonic() + cfg.timeout_s
        pids: list[int] = []
        codes: list[int] | None = None
        timed_out = interrupted = False
        hang = None
        watch = HangWatch(cfg.run_dir, cfg.hang_timeout_s) if cfg.run_dir is not None and cfg.hang_timeout_s > 0 \
            else None
        try:
            while codes is None:
                if watch is not None and (hang := watch.poll()) is not None:
                    break
                try:
                    msg = events.get(timeout=POLL_S)
                except queue.Empty:
                    msg = {}
                if msg is None:  # the zygote died under the job
                    codes = [1] * cfg.nproc
                    break
                if msg.get("event") == "started" and msg.get("id") == job_id:
                    pids = list(msg["pids"])
                elif msg.get("event") == "exited" and msg.get("id") == job_id:
                    codes = list(msg["codes"])
                tails.poll()
                if time.monotonic() >= deadline:
                    timed_out = True
                    break
        except KeyboardInterrupt:
            interrupted = True
        finally:
            if codes is None:
                for pid in pids:
                    torchrun.kill_group(pid)
                codes = self._wait_exit(events, job_id, cfg.nproc)
            tails.poll()
        failed = [c for c in codes if c != 0]
        return torchrun.job_result(cfg, failed[0] if failed else 0, timed_out, interrupted, hang=hang,
                                   exits={cfg.node_rank * cfg.nproc + i: c for i, c in enumerate(codes)})

    def _wait_exit(self, events: queue.Queue, job_id: str, nproc: int) -> list[int]:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                msg = events.get(timeout=0.1)
            except queue.Empty:
                continue
            if msg is None:
                break
            if msg.get("event") == "exited" and msg.get("id") == job_id:
                return list(msg["codes"])
        self.close()  # a rank that will not die: the zygote goes with it, a new one warms up next time
        return [-signal.SIGKILL] * nproc


_shared: WarmLauncher | None = None
_shared_lock = threading.Lock()
# The dashboard's first view comes first: the zygote's ``import torch`` (~1.5 s of a core)
# beside the browser drawing it made the Timeline's first chart 3.19 s where it is 2.80 s
# without (2 cores, benchmarks/first_chart.py); a rerun asked for sooner starts it at once.
WARM_AFTER_S = 3.0


def shared_launcher() -> WarmLauncher:
    """This process's warm launcher (one zygote however many pages use it): warming up
    ``WARM_AFTER_S`` after it is first asked for, or at its first launch if sooner."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WarmLauncher()
            timer = threading.Timer(WARM_AFTER_S, _warm, args=(_shared,))
            timer.daemon = True
            timer.start()
        elif _shared.asked:  # warmed before: a zygote that died or was closed warms up again now
            _warm(_shared)
        return _shared


def _warm(launcher: WarmLauncher) -> None:
    try:
        launcher.start()
    except Exception:  # noqa: BLE001 - the first launch tries again, and says why if it cannot
        pass



class _Tails:
    """Follows every rank's stdout.log and stderr.log, line by line."""

    def __init__(self, folder: Path, nproc: int, on_line: torchrun.OnLine) -> None:
        self._files = [(rank, folder / str(rank) / name, name == "stderr.log") for rank in range(nproc)
                       for name in ("stdout.log", "stderr.log")]
        self._pos = {p: 0 for _, p, _ in self._files}
        self._rest = {p: b"" for _, p, _ in self._files}
        self._on_line = on_line

    def poll(self) -> None:
        for rank, path, err in self._files:
            try:
                with open(path, "rb") as f:
                    f.seek(self._pos[path])
                    data = f.read()
            except OSError:
                continue
            if not data:
                continue
            self._pos[path] += len(data)
            lines = (self._rest[path] + data).split(b"\n")
            self._rest[path] = lines.pop()
            for line in lines:
                self._on_line(rank, line.decode(errors="replace"), err)
