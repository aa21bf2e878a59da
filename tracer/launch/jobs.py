"""Runs started from the dashboard: one at a time, in a background thread, with progress.

``JobManager.start`` (a traced training run: a script, or the demo), ``start_ring``,
``start_zero`` and ``start_calibrate`` launch the same runners as the command line unless
a job is already going (a second click neither starts a second job nor disturbs the
first; one job at a time because every job wants all the cores). Each run gets its own
new folder under ``runs_dir``, named by the manager, never by the user; a calibration
writes into the run it calibrates, as ``ddpscope calibrate`` does. ``Job.source``
remembers the run a rerun came from, so the page can show the two side by side.
"""

from __future__ import annotations

import datetime as _dt
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from ddpscope.tracer.format import RUN_FILE
from ddpscope.tracer.launch import torchrun
from ddpscope.tracer.launch.calibrate import CalibrateConfig, run_calibrate
from ddpscope.tracer.launch.own_jobs import RingConfig, ZeroConfig, run_ring, run_zero
from ddpscope.tracer.launch.runner import RunConfig, run_job
from ddpscope.tracer.launch.torchrun import LaunchResult
from ddpscope.tracer.progress import MESSAGE_PREFIX
from ddpscope.tracer.writer import update_run_json

Config = RunConfig | RingConfig | ZeroConfig | CalibrateConfig
# a job past its last step ends within about this (s): the trace closed, the ranks exiting
# (~0.1 s from the warm launcher, ~1.1 s cold; benchmarks/rerun.py's "finish")
FINISH_WAIT_S = 1.5


@dataclass
class Job:
    """What the page shows about a run: its kind, folder, progress and outcome."""

    out: Path
    config: Config
    kind: str = "ddp"  # "ddp", "ring", "zero" or "calibrate"
    total: int = 1  # steps, rounds, stages or sizes (and the contention phase) to do
    done: int = 0
    last_ms: float | None = None
    lines: list[str] = field(default_factory=list)
    result: LaunchResult | None = None
    error: str | None = None  # the run could not even start
    source: Path | None = None  # the run this one reruns (with other settings)
    facts: dict | None = None  # added to the run's run.json when it ends (an applied recommendation)
    notes: list[str] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)
    settled: bool = False  # settle has waited once (a job stuck at its end is not waited for again)

    def settle(self, before_s: float = 0.0, timeout_s: float = FINISH_WAIT_S) -> None:
        """Wait, once, for a job that will end before ``before_s`` from now (a page's next
        refresh): past its last step, or with its steps left at its last step's pace
        (``last_ms``) done by then; at most that long plus ``timeout_s``. A page that
        shows it then draws the finished run now, not a refresh later (that wait was most
        of the loop added after a warm rerun)."""
        if not self.running or self.settled or self.total <= 0:
            return
        left_s = 0.0 if self.done >= self.total else \
            (self.total - self.done) * self.last_ms / 1e3 if self.kind == "ddp" and self.last_ms else None
        if left_s is not None and left_s <= before_s:
            self.settled = True
            self.ended.wait(left_s + timeout_s)

    @property
    def steps_done(self) -> int:  # the name the DDP page uses
        return self.done

    @property
    def unit(self) -> str:
        return {"ddp": "step", "ring": "round", "zero": "stage", "calibrate": "size"}[self.kind]

    @property
    def running(self) -> bool:
        return self.result is None and self.error is None

    @property
    def ok(self) -> bool:
        return self.result is not None and self.result.ok


def run_name(cfg: Config, now: _dt.datetime | None = None) -> str:
    now = now or _dt.datetime.now()
    if isinstance(cfg, RingConfig):
        lab = f"-{cfg.emulate_nodes}x{cfg.link}" if cfg.emulate_nodes else ""
        return f"{now:%Y%m%d-%H%M%S}-ring-{cfg.nproc}r-{cfg.mb:g}mb{lab}"
    if isinstance(cfg, ZeroConfig):
        return f"{now:%Y%m%d-%H%M%S}-zero-{cfg.model}-{cfg.nproc}r"
    cap = "script" if cfg.bucket_cap_mb is None else f"{cfg.bucket_cap_mb:g}mb"
    shard = "" if cfg.reshard_after_forward is None else f"-reshard{cfg.reshard_after_forward}"
    shard += "" if getattr(cfg, "zero_stage", None) is None else f"-zero{cfg.zero_stage}"
    return f"{now:%Y%m%d-%H%M%S}-{safe_label(cfg.label())}-{cfg.nproc}r-cap{cap}{shard}"


def safe_label(text: str) -> str:
    """A folder-name-safe version of a script's name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)[:40] or "run"


_RUNNERS: dict[type, Callable] = {RunConfig: run_job, RingConfig: run_ring, ZeroConfig: run_zero,
                                  CalibrateConfig: run_calibrate}


class JobManager:
    """``launcher``: how jobs start (``tracer.launch.torchrun.launch`` by default; the
    dashboard passes a warm launcher's ``launch``)."""

    def __init__(self, runs_dir: Path, launcher: Callable | None = None) -> None:
        self.runs_dir = Path(runs_dir)
        self.launcher = launcher or torchrun.launch
        self._lock = threading.Lock()
        self.current: Job | None = None

    def start(self, *, nproc: int, bucket_cap_mb: float | None, steps: int, demo: str | None = None,
              bucket_cap_mb_list: tuple[float, ...] | str | None = None,
              script: list[str] | None = None, cwd: str | Path | None = None, timeout_s: float = 600.0,
              source: Path | None = None, reshard_after_forward: str | None = None,
              forward_prefetch: int | None = None, backward_prefetch: int | None = None,
              zero_stage: int | None = None,
              emulate_nodes: int | None = None, link: str | None = None, facts: dict | None = None,
              grad_marks_every: int = 1) -> Job | None:
        """Start a traced training run (``demo``, or ``script`` run in ``cwd``); None if a
        job is already going. ``ValueError`` (naming the setting) on bad settings, before
        anything starts. ``bucket_cap_mb_list``: per-bucket limits (MiB) instead of
        ``bucket_cap_mb``. ``source``: the run this one reruns. ``reshard_after_forward``,
        ``forward_prefetch``, ``backward_prefetch``: FSDP2 settings overriding the script's;
        ``zero_stage``: DeepSpeed's ZeRO stage overriding the script's config.
        ``emulate_nodes``, ``link``: that many nodes of ``nproc`` ranks, over links of that
        rate (``tracer/launch/lab.py``). ``facts``: added to the run's ``run.json`` when it
        ends (what the What-if page predicted for it). ``grad_marks_every``: as ``ddpscope run
        --grad-marks-every`` (a rerun keeps the run's)."""
        def make(out: Path) -> RunConfig:
            return RunConfig(out=out, demo=demo, script=list(script or []), cwd=cwd or Path.cwd(), nproc=nproc,
                             bucket_cap_mb=bucket_cap_mb, bucket_cap_mb_list=bucket_cap_mb_list, steps=steps,
                             timeout_s=timeout_s,
                             reshard_after_forward=reshard_after_forward, forward_prefetch=forward_prefetch,
                             backward_prefetch=backward_prefetch, zero_stage=zero_stage,
                             emulate_nodes=emulate_nodes, link=link, grad_marks_every=grad_marks_every)

        return self._start(make, "ddp", steps, source, facts)

    def start_ring(self, *, nproc: int, mb: float, repeat: int, timeout_s: float = 600.0,
                   emulate_nodes: int | None = None, link: str | None = None) -> Job | None:
        """Start a ring all-reduce run (``ddpscope ring``), ``nproc`` ranks on each of
        ``emulate_nodes`` emulated nodes when given; as ``start``."""
        return self._start(lambda out: RingConfig(out=out, nproc=nproc, mb=mb, repeat=repeat, timeout_s=timeout_s,
                                                  emulate_nodes=emulate_nodes, link=link), "ring", repeat)

    def start_zero(self, *, model: str, nproc: int, stages: str = "0,1,2,3",
                   timeout_s: float = 600.0) -> Job | None:
        """Start a ZeRO memory run (``ddpscope zero``); as ``start``."""
        return self._start(lambda out: ZeroConfig(out=out, model=model, nproc=nproc, stages=stages,
                                                  timeout_s=timeout_s), "zero", len(stages.split(",")))

    def start_calibrate(self, *, run: Path, max_mb: float | None = None, timeout_s: float = 600.0) -> Job | None:
        """Calibrate a traced run (``ddpscope calibrate RUN [--max-mb]``): all-reduce times
        and contention on its ranks, written as ``calibration.json`` into ``run`` itself,
        which the What-if page's model then reads; as ``start``."""
        more = {} if max_mb is None else {"max_mb": max_mb}
        cfg = CalibrateConfig(run=run, timeout_s=timeout_s, **more)  # validates: ValueError says why not
        # total: the sizes it sweeps and the contention phase after them, said by the job's start
        return self._begin(lambda: Job(out=Path(run), config=cfg, kind="calibrate", total=0))

    def _start(self, make: Callable[[Path], Config], kind: str, total: int, source: Path | None = None,
               facts: dict | None = None) -> Job | None:
        def job() -> Job:
            base = make(self.runs_dir / "pending")  # validates: ValueError names the setting
            out = self.runs_dir / run_name(base)
            n = 1
            while out.exists():
                out = self.runs_dir / f"{run_name(base)}-{n}"
                n += 1
            return Job(out=out, config=replace(base, out=out), kind=kind, total=total, source=source, facts=facts)

        return self._begin(job)

    def _begin(self, make_job: Callable[[], Job]) -> Job | None:
        """Run the job ``make_job`` builds (under the lock: its folder is chosen once) in a
        thread of its own; None, building nothing, while another job runs."""
        with self._lock:
            if self.current is not None and self.current.running:
                return None
            self.current = job = make_job()
        threading.Thread(target=self._run, args=(job,), name="ddpscope-job", daemon=True).start()
        return job

    def _run(self, job: Job) -> None:
        def progress(rec: dict) -> None:
            event = rec.get("event")
            if event == "step":
                job.done = int(rec["step"])
                job.last_ms = rec.get("ms")
            elif event == "round":
                job.done, job.last_ms = int(rec["round"]), rec.get("ring_ms")
            elif event == "stage":
                job.done += 1
            elif event == "start" and job.kind == "calibrate":
                job.total = int(rec.get("sizes") or 0) + 1
            elif event in ("size", "done") and job.kind == "calibrate":
                job.done = job.total if event == "done" else job.done + 1

        def output(rank, line: str, err: bool) -> None:
            job.lines = (job.lines + [line])[-50:]
            if line.startswith(MESSAGE_PREFIX):  # what the capture says (rank 0): shown on the page
                job.notes.append(line[len(MESSAGE_PREFIX):])

        try:
            job.result = _RUNNERS[type(job.config)](job.config, progress, output, launcher=self.launcher)
            if job.facts and (job.out / RUN_FILE).exists():
                update_run_json(job.out, job.facts)
        except Exception as e:  # never lose the reason; the page shows it
            job.error = f"{type(e).__name__}: {e}"
        finally:
            job.ended.set()
