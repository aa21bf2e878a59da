"""``ddpscope calibrate``: time this machine's all-reduces (4 KiB .. ``--max-mb`` MiB) and
the contention of compute with communication, on the ranks an existing traced run had,
bound to cores as its ranks were; the what-if predictions read it as the run's
``calibration.json``. Torch-free, like the runner."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ddpscope.tracer import format as fmt
from ddpscope.tracer import options as o
from ddpscope.tracer.launch.runner import Launcher
from ddpscope.tracer.launch.torchrun import LaunchConfig, LaunchResult, OnLine, launch
from ddpscope.tracer.progress import parse_progress
from ddpscope.tracer.writer import read_json


@dataclass(kw_only=True)
class CalibrateConfig:
    """A calibration of a traced run (``run``: its folder): all-reduce times of 4 KiB ..
    ``max_mb`` MiB and the contention of compute and communication, on as many local
    ranks as the run had, bound to cores as its ranks were. Stored as
    ``calibration.json`` in the run's folder."""

    run: Path | str
    max_mb: float = o.CALIBRATE_MAX_MB.field()
    timeout_s: float = o.TIMEOUT.field(600.0)
    nproc: int = field(init=False, default=0)  # from the run
    bind: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        o.check_fields(self)
        self.run = Path(self.run)
        path = self.run / fmt.RUN_FILE
        if not path.is_file():
            raise ValueError(f"{self.run} is not a run folder (no {fmt.RUN_FILE})")
        try:
            facts = read_json(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{path} cannot be read: {e}") from None
        if not isinstance(facts, dict) or str(facts.get("kind") or fmt.KIND_DDP) != fmt.KIND_DDP:
            raise ValueError(f"{self.run} is not a DDP training run: only those are calibrated")
        if int(facts.get("nnodes") or 1) != 1:
            raise ValueError(f"{self.run} ran on {facts.get('nnodes')} nodes: calibrate runs on one node only")
        world = facts.get("world_size") or facts.get("nproc_per_node")
        if not isinstance(world, int) or not 2 <= world <= o.MAX_NPROC:
            raise ValueError(f"{self.run}: run.json has no usable world size ({world!r}); calibrate needs 2 or more")
        self.nproc = world
        self.bind = bool(facts.get("ranks_bound_to_cores", facts.get("demo") is not None))
        if not os.access(self.run, os.W_OK):
            raise ValueError(f"{self.run} is not writable: the calibration is stored there")

    def launch_config(self) -> LaunchConfig:
        args = ["--out", str(self.run.resolve()), "--max-mb", repr(self.max_mb)] + (["--bind"] if self.bind else [])
        return LaunchConfig(target="ddpscope.tracer.workloads.calibrate_job", args=args, nproc=self.nproc,
                            log_dir=self.run / "logs" / "calibrate", timeout_s=self.timeout_s)


def run_calibrate(cfg: CalibrateConfig, on_progress: Callable[[dict], None] = lambda p: None,
                  on_output: OnLine = lambda r, l, e: None, launcher: Launcher = launch
                  ) -> LaunchResult:
    """Run the calibration job against an existing run folder; only ``calibration.json``
    (written atomically by rank 0) and its logs are added there."""
    shutil.rmtree(cfg.run / "logs" / "calibrate", ignore_errors=True)

    def _line(local_rank: int | None, text: str, err: bool) -> None:
        rec = parse_progress(text)
        if rec is not None:
            on_progress(rec)
        else:
            on_output(local_rank, text, err)

    return launcher(cfg.launch_config(), _line)
