"""``python -m tracer run``, ``ring`` and ``zero``: launch a job under torchrun, traced.

The run folder gets ``run.json`` (status ``running`` until rank 0 marks it ``complete``;
``failed`` with the reason if the job fails), ``rank-<r>.json`` per rank and ``logs/``
(torchrun's per-rank stdout/stderr and error files).
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tracer import format as fmt
from tracer.workloads.demo.models import MODELS
from tracer.launch.torchrun import LaunchConfig, LaunchResult, launch
from tracer.workloads.worker import PROGRESS_PREFIX  # printed by the jobs on rank 0
from tracer.writer import read_json, write_json_atomic

PROJECT_ROOT = Path(__file__).resolve().parents[2]
MAX_NPROC = 64
MAX_BUCKET_CAP_MB = 10240.0  # 10 GiB: more than any real gradient bucket
MAX_STEPS = 100_000


@dataclass(kw_only=True)
class RunConfig:
    """A demo run. Sizes in MiB (PyTorch's ``bucket_cap_mb`` is MiB), times in seconds."""

    out: Path | str
    nproc: int = 2
    bucket_cap_mb: float = 25.0
    model: str = "mlp"
    steps: int = 20
    timeout_s: float = 900.0
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    gradient_as_bucket_view: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not 1 <= self.nproc <= MAX_NPROC:
            raise ValueError(f"--nproc must be in 1..{MAX_NPROC}, got {self.nproc}")
        if not 0 < self.bucket_cap_mb <= MAX_BUCKET_CAP_MB:
            raise ValueError(f"--bucket-cap-mb must be > 0 and <= {MAX_BUCKET_CAP_MB:g} (MiB), got {self.bucket_cap_mb:g}")
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if not 1 <= self.steps <= MAX_STEPS:
            raise ValueError(f"--steps must be in 1..{MAX_STEPS}, got {self.steps}")
        _check_timeout(self.timeout_s)
        _check_out_dir(self.out)

    def launch_config(self) -> LaunchConfig:
        args = ["--model", self.model, "--steps", str(self.steps), "--bucket-cap-mb", repr(self.bucket_cap_mb),
                "--seed", str(self.seed), "--out", str(self.out.resolve())]
        if self.gradient_as_bucket_view:
            args.append("--gradient-as-bucket-view")
        return LaunchConfig(target="tracer.workloads.demo.train", args=args, nproc=self.nproc, nnodes=self.nnodes,
                            node_rank=self.node_rank, rdzv_endpoint=self.rdzv_endpoint,
                            log_dir=self.out / "logs", timeout_s=self.timeout_s, env=project_env())


MAX_RING_MB = 4096.0  # MiB per rank; each rank holds about 3.5 copies
RING_DTYPES = ("float32", "float64", "bfloat16", "float16", "int64", "int32")


@dataclass(kw_only=True)
class RingConfig:
    """A ring all-reduce run: ``nproc`` ranks on this machine, a tensor of ``mb`` MiB."""

    out: Path | str
    nproc: int = 4
    mb: float = 4.0
    repeat: int = 5
    dtype: str = "float32"
    calibration: bool = True
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not 2 <= self.nproc <= MAX_NPROC:
            raise ValueError(f"--nproc must be in 2..{MAX_NPROC} (a ring needs two ranks), got {self.nproc}")
        if not 0 < self.mb <= MAX_RING_MB:
            raise ValueError(f"--mb must be > 0 and <= {MAX_RING_MB:g} (MiB), got {self.mb:g}")
        if not 1 <= self.repeat <= 1000:
            raise ValueError(f"--repeat must be in 1..1000, got {self.repeat}")
        if self.dtype not in RING_DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(RING_DTYPES)}, got {self.dtype!r}")
        _check_timeout(self.timeout_s)
        need = 3.5 * self.mb * 2**20 * self.nproc
        total = _physical_memory_bytes()
        if total and need > 0.8 * total:
            raise ValueError(f"--mb {self.mb:g} x --nproc {self.nproc} needs about {need / 2**30:.1f} GiB, "
                             f"more than this machine's {total / 2**30:.1f} GiB allows; lower --mb")
        _check_out_dir(self.out)

    def launch_config(self) -> LaunchConfig:
        args = ["--mb", repr(self.mb), "--repeat", str(self.repeat), "--dtype", self.dtype,
                "--out", str(self.out.resolve())]
        if not self.calibration:
            args.append("--no-calibration")
        return LaunchConfig(target="tracer.workloads.ring_job", args=args, nproc=self.nproc, log_dir=self.out / "logs",
                            timeout_s=self.timeout_s, env=project_env())


@dataclass(kw_only=True)
class ZeroConfig:
    """A ZeRO memory run: the demo ``model`` trained ``steps`` steps under each of ``stages``."""

    out: Path | str
    nproc: int = 2
    model: str = "mlp"
    steps: int = 3
    stages: str = "0,1,2,3"
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not 2 <= self.nproc <= MAX_NPROC:
            raise ValueError(f"--nproc must be in 2..{MAX_NPROC} (sharding needs two ranks), got {self.nproc}")
        if self.model not in MODELS:
            raise ValueError(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if not 2 <= self.steps <= 100:
            raise ValueError(f"--steps must be in 2..100 (the last step is measured after warm-up), got {self.steps}")
        parts = [p.strip() for p in str(self.stages).split(",")]
        if not parts or any(p not in ("0", "1", "2", "3") for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"--stages must list distinct stages from 0,1,2,3 (e.g. 0,3), got {self.stages!r}")
        self.stages = ",".join(parts)
        _check_timeout(self.timeout_s)
        _check_out_dir(self.out)

    def launch_config(self) -> LaunchConfig:
        args = ["--model", self.model, "--steps", str(self.steps), "--stages", self.stages,
                "--out", str(self.out.resolve())]
        return LaunchConfig(target="tracer.workloads.zero_job", args=args, nproc=self.nproc, log_dir=self.out / "logs",
                            timeout_s=self.timeout_s, env=project_env())


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def project_env() -> dict[str, str]:
    """Environment that lets torchrun's workers import ddpscope from any working folder."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(PROJECT_ROOT) + (os.pathsep + path if path else "")}


def _check_timeout(timeout_s: float) -> None:
    if not 0 < timeout_s <= 7 * 24 * 3600:
        raise ValueError(f"--timeout must be > 0 seconds (and at most a week), got {timeout_s:g}")


def _check_out_dir(out: Path) -> None:
    """--out must be a new or empty folder we can write to; nothing is created here."""
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {out} exists and is not a folder")
        if any(out.iterdir()):
            raise ValueError(f"--out {out} is not empty; choose a new folder (traces are never overwritten)")
        probe = out
    else:
        probe = out.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise ValueError(f"--out {out}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable ({probe} denies writing)")


def create_out_dir(out: Path) -> None:
    """Create --out and prove it takes files; ``ValueError`` (one line) if it does not."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".ddpscope-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out} is not writable: {e.strerror or e}") from None


def parse_progress(line: str) -> dict | None:
    """The progress record in a line of rank 0's output, or None."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        rec = json.loads(line[len(PROGRESS_PREFIX):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def run_job(cfg: RunConfig, on_progress: Callable[[dict], None] = lambda p: None,
            on_output: Callable[[int | None, str], None] = lambda r, l: None) -> LaunchResult:
    """Run the traced demo job to its end and leave the run folder consistent.

    Raises ``ValueError`` if the run folder cannot be created (nothing is launched)."""
    return _launch_traced(cfg.launch_config(), cfg.out, {
        "kind": fmt.KIND_DDP, "model": cfg.model, "steps_requested": cfg.steps,
        "nproc_per_node": cfg.nproc, "nnodes": cfg.nnodes}, cfg.node_rank, on_progress, on_output)


def run_ring(cfg: RingConfig, on_progress: Callable[[dict], None] = lambda p: None,
             on_output: Callable[[int | None, str], None] = lambda r, l: None) -> LaunchResult:
    """Run the traced ring job (``tracer/ring_job.py``) to its end; as ``run_job``."""
    return _launch_traced(cfg.launch_config(), cfg.out, {
        "kind": fmt.KIND_RING, "mb": cfg.mb, "repeat": cfg.repeat, "dtype": cfg.dtype,
        "nproc_per_node": cfg.nproc, "nnodes": 1}, 0, on_progress, on_output)


def run_zero(cfg: ZeroConfig, on_progress: Callable[[dict], None] = lambda p: None,
             on_output: Callable[[int | None, str], None] = lambda r, l: None) -> LaunchResult:
    """Run the ZeRO memory job (``tracer/zero_job.py``) to its end; as ``run_job``."""
    return _launch_traced(cfg.launch_config(), cfg.out, {
        "kind": fmt.KIND_ZERO, "model": cfg.model, "steps": cfg.steps, "nproc_per_node": cfg.nproc,
        "nnodes": 1}, 0, on_progress, on_output)


def _launch_traced(lc: LaunchConfig, out: Path, facts: dict, node_rank: int,
                   on_progress: Callable[[dict], None], on_output: Callable[[int | None, str], None]) -> LaunchResult:
    create_out_dir(out)
    run_path = out / fmt.RUN_FILE
    write_json_atomic(run_path, {
        "format": fmt.FORMAT, "version": fmt.VERSION, "status": fmt.RUNNING,
        "command": shlex.join(["python", "-m", "tracer", *sys.argv[1:]])
        if sys.argv[1:2] in (["run"], ["ring"], ["zero"]) else None, **facts,
    })

    def _line(local_rank: int | None, text: str) -> None:
        rec = parse_progress(text)
        if rec is not None:
            on_progress(rec)
        else:
            on_output(local_rank, text)

    result = launch(lc, _line)
    run = read_json(run_path) if run_path.exists() else {}
    if not result.ok or result.interrupted:
        run.update({"status": fmt.FAILED, "error": result.reason, "failed_rank": result.failed_rank})
        write_json_atomic(run_path, run)
    elif run.get("status") == fmt.RUNNING:  # a node other than 0: rank 0 wrote the run's metadata elsewhere
        run.update({"status": fmt.COMPLETE, "node_rank": node_rank,
                    "note": "ranks of one node; the run's metadata is in node 0's run.json"})
        write_json_atomic(run_path, run)
    return result
