"""Runs started from the dashboard: one at a time, in a background thread, with progress.

``JobManager.start`` launches ``runner.run_job`` unless a job is already going (a second
click neither starts a second job nor disturbs the first). Each run gets its own new
folder under ``runs_dir``, named by the manager, never by the user.
"""

from __future__ import annotations

import datetime as _dt
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path

from tracer.launch import LaunchResult
from tracer.runner import RunConfig, run_job


@dataclass
class Job:
    """What the page shows about a run: its folder, progress and outcome."""

    out: Path
    config: RunConfig
    steps_done: int = 0
    last_loss: float | None = None
    last_ms: float | None = None
    lines: list[str] = field(default_factory=list)
    result: LaunchResult | None = None
    error: str | None = None  # the run could not even start

    @property
    def running(self) -> bool:
        return self.result is None and self.error is None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok


def run_name(cfg: RunConfig, now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{cfg.model}-{cfg.nproc}r-cap{cfg.bucket_cap_mb:g}mb"


class JobManager:
    def __init__(self, runs_dir: Path) -> None:
        self.runs_dir = Path(runs_dir)
        self._lock = threading.Lock()
        self.current: Job | None = None

    def start(self, *, model: str, nproc: int, bucket_cap_mb: float, steps: int,
              timeout_s: float = 600.0) -> Job | None:
        """Start a run; None if one is already going. Raises ValueError on bad settings."""
        with self._lock:
            if self.current is not None and self.current.running:
                return None
            base = RunConfig(out=self.runs_dir / "pending", model=model, nproc=nproc,
                             bucket_cap_mb=bucket_cap_mb, steps=steps, timeout_s=timeout_s)
            out = self.runs_dir / run_name(base)
            n = 1
            while out.exists():
                out = self.runs_dir / f"{run_name(base)}-{n}"
                n += 1
            job = Job(out=out, config=replace(base, out=out))
            self.current = job
        threading.Thread(target=self._run, args=(job,), name="ddpscope-job", daemon=True).start()
        return job

    def _run(self, job: Job) -> None:
        def progress(rec: dict) -> None:
            if rec.get("event") == "step":
                job.steps_done = int(rec["step"])
                job.last_loss, job.last_ms = rec.get("loss"), rec.get("ms")

        def output(rank, line: str) -> None:
            job.lines = (job.lines + [line])[-50:]

        try:
            job.result = run_job(job.config, progress, output)
        except Exception as e:  # never lose the reason; the page shows it
            job.error = f"{type(e).__name__}: {e}"
