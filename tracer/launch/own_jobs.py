"""ddpscope's own jobs, launched as a script is: ``ddpscope ring`` (a ring all-reduce built
from send/recv, traced step by step beside ``dist.all_reduce``) and ``ddpscope zero`` (the
demo model under each ZeRO stage). Their configs and runners; the jobs themselves are in
``tracer/workloads/``. Torch-free."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ddpscope.tracer import format as fmt
from ddpscope.tracer import options as o
from ddpscope.tracer.launch import nodes
from ddpscope.tracer.launch.nodes import check_node_settings, check_out_dir
from ddpscope.tracer.launch.runner import Launcher, Node, launch_traced
from ddpscope.tracer.launch.torchrun import LaunchConfig, LaunchResult, OnLine, launch


@dataclass(kw_only=True)
class RingConfig:
    """A ring all-reduce run: ``nproc`` ranks on this machine (on each of ``nnodes``
    nodes, or of ``emulate_nodes`` emulated ones over links of ``link``), a tensor of
    ``mb`` MiB."""

    out: Path | str = o.OUT.field()
    nproc: int = o.RING_NPROC.field()
    mb: float = o.RING_MB.field()
    repeat: int = o.RING_REPEAT.field()
    dtype: str = o.RING_DTYPE.field()
    calibration: bool = o.RING_CALIBRATION.field()
    emulate_nodes: int | None = o.EMULATE_NODES.field()
    link: str | None = o.LINK.field()
    nnodes: int = o.NNODES.field()
    node_rank: int = o.NODE_RANK.field()
    rdzv_endpoint: str | None = o.RDZV_ENDPOINT.field()
    timeout_s: float = o.TIMEOUT.field(600.0)

    def __post_init__(self) -> None:
        o.check_fields(self)
        self.out = Path(self.out)
        check_node_settings(self)
        if self.nproc * (self.emulate_nodes or self.nnodes) < 2:
            raise ValueError("a ring needs two ranks: give --nproc 2 or more, or --emulate-nodes 2")
        # every rank of the machine holds four copies of the tensor (input, ring, reference, received chunk)
        need = 3.5 * self.mb * 2**20 * self.nproc * (self.emulate_nodes or 1)
        total = _physical_memory_bytes()
        if total and need > 0.8 * total:
            raise ValueError(f"--mb {self.mb:g} x {self.nproc * (self.emulate_nodes or 1)} ranks here needs about "
                             f"{need / 2**30:.1f} GiB, more than this machine's {total / 2**30:.1f} GiB allows; "
                             "lower --mb")
        check_out_dir(self.out, self.job if self.nnodes > 1 else None, self.node_rank)

    @property
    def job(self) -> str:
        """This job's identity, the same on every node (``nodes.job_key``)."""
        return nodes.job_key({"ring": [self.nproc, self.mb, self.repeat, self.dtype, self.calibration],
                              "nnodes": self.nnodes, "rdzv_endpoint": self.rdzv_endpoint})

    def command(self) -> list[str]:
        """The ``ddpscope ring`` command line that reproduces this run."""
        cmd = ["ddpscope", "ring", "--nproc", str(self.nproc), "--mb", f"{self.mb:g}", "--repeat", str(self.repeat),
               "--dtype", self.dtype] + ([] if self.calibration else ["--no-calibration"])
        if self.nnodes > 1:
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                    "--rdzv-endpoint", str(self.rdzv_endpoint)]
        if self.emulate_nodes is not None:
            cmd += ["--emulate-nodes", str(self.emulate_nodes), "--link", str(self.link)]
        return cmd + ["--timeout", f"{self.timeout_s:g}", "--out", str(self.out.resolve())]

    def launch_config(self) -> LaunchConfig:
        args = ["--mb", repr(self.mb), "--repeat", str(self.repeat), "--dtype", self.dtype,
                "--out", str(self.out.resolve())]
        if not self.calibration:
            args.append("--no-calibration")
        return LaunchConfig(target="ddpscope.tracer.workloads.ring_job", args=args, nproc=self.nproc,
                            nnodes=self.nnodes, node_rank=self.node_rank, rdzv_endpoint=self.rdzv_endpoint,
                            log_dir=self.out / fmt.node_logs(self.node_rank, self.nnodes), timeout_s=self.timeout_s)


@dataclass(kw_only=True)
class ZeroConfig:
    """A ZeRO memory run: the demo ``model`` trained ``steps`` steps under each of ``stages``."""

    out: Path | str = o.OUT.field()
    nproc: int = o.ZERO_NPROC.field()
    model: str = o.MODEL.field()
    steps: int = o.ZERO_STEPS.field()
    stages: str = o.ZERO_STAGES.field()
    timeout_s: float = o.TIMEOUT.field(600.0)

    def __post_init__(self) -> None:
        o.check_fields(self)
        self.out = Path(self.out)
        parts = [p.strip() for p in str(self.stages).split(",")]
        if not parts or any(p not in ("0", "1", "2", "3") for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(f"--stages must list distinct stages from 0,1,2,3 (e.g. 0,3), got {self.stages!r}")
        self.stages = ",".join(parts)
        check_out_dir(self.out)

    def command(self) -> list[str]:
        """The ``ddpscope zero`` command line that reproduces this run."""
        return ["ddpscope", "zero", "--nproc", str(self.nproc), "--model", self.model, "--steps", str(self.steps),
                "--stages", self.stages, "--timeout", f"{self.timeout_s:g}", "--out", str(self.out.resolve())]

    def launch_config(self) -> LaunchConfig:
        args = ["--model", self.model, "--steps", str(self.steps), "--stages", self.stages,
                "--out", str(self.out.resolve())]
        return LaunchConfig(target="ddpscope.tracer.workloads.zero_job", args=args, nproc=self.nproc, log_dir=self.out / "logs",
                            timeout_s=self.timeout_s)


def _physical_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def run_ring(cfg: RingConfig, on_progress: Callable[[dict], None] = lambda p: None,
             on_output: OnLine = lambda r, l, e: None, launcher: Launcher = launch
             ) -> LaunchResult:
    """Run the traced ring job (``tracer/workloads/ring_job.py``) to its end; as ``run_job``
    (emulated nodes: one ``ddpscope ring`` per node, in the lab)."""
    if cfg.emulate_nodes is not None:
        from ddpscope.tracer.launch.emulated import run_emulated

        return run_emulated(cfg, on_progress, on_output, final=cfg.out, record=cfg.out)
    node = None if cfg.nnodes == 1 else Node(job=cfg.job, rank=cfg.node_rank, count=cfg.nnodes, nproc=cfg.nproc)
    return launch_traced(cfg.launch_config(), cfg.out, {
        "kind": fmt.KIND_RING, "mb": cfg.mb, "repeat": cfg.repeat, "dtype": cfg.dtype,
        "nproc_per_node": cfg.nproc, "nnodes": cfg.nnodes, "job": cfg.job,
        "command": " ".join(cfg.command()), "started_at": fmt.started_at()}, on_progress, on_output, launcher, node)


def run_zero(cfg: ZeroConfig, on_progress: Callable[[dict], None] = lambda p: None,
             on_output: OnLine = lambda r, l, e: None, launcher: Launcher = launch
             ) -> LaunchResult:
    """Run the ZeRO memory job (``tracer/workloads/zero_job.py``) to its end; as ``run_job``."""
    return launch_traced(cfg.launch_config(), cfg.out, {
        "kind": fmt.KIND_ZERO, "model": cfg.model, "steps": cfg.steps, "nproc_per_node": cfg.nproc,
        "nnodes": 1, "command": " ".join(cfg.command()), "started_at": fmt.started_at()}, on_progress, on_output, launcher)
