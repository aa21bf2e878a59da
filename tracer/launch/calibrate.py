"""``ddpscope calibrate``: time this machine's all-reduces (4 KiB .. ``--max-mb`` MiB) and
the contention of compute with communication, on the ranks an existing traced run had,
bound to cores as its ranks were, across its nodes: the lab's emulated nodes again
(the same number, link rate and ranks per node) for a run of emulated nodes, or, on a
cluster, one ``ddpscope calibrate RUN --nnodes N --node-rank K --rdzv-endpoint H:P``
per node, on the run's own device and backend (gloo on CPU, NCCL or gloo on CUDA: a
sweep of another says nothing of the run's, and the what-if leaves it unused). The what-if
predictions read it as the run's ``calibration.json``. Torch-free, like the runner (how
many GPUs a run on CUDA finds here is asked of a child process)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ddpscope.tracer import format as fmt
from ddpscope.tracer import options as o
from ddpscope.tracer.launch.lab import parse_rate, why_not
from ddpscope.tracer.launch.rerun import whole_number
from ddpscope.tracer.launch.runner import Launcher
from ddpscope.tracer.launch.torchrun import LaunchConfig, LaunchResult, OnLine, launch
from ddpscope.tracer.progress import parse_progress
from ddpscope.tracer.workloads.worker import why_not_as_run
from ddpscope.tracer.writer import read_json


@dataclass(kw_only=True)
class CalibrateConfig:
    """A calibration of a traced run (``run``: its folder): all-reduce times of 4 KiB ..
    ``max_mb`` MiB and the contention of compute and communication, on as many ranks
    as the run had, bound to cores as its ranks were, on its nodes (emulated ones
    again when it ran on emulated nodes). Stored as ``calibration.json`` in the run's
    folder. ``nnodes``, ``node_rank``, ``rdzv_endpoint``: this node of a run on several."""

    run: Path | str
    max_mb: float = o.CALIBRATE_MAX_MB.field()
    nnodes: int = o.NNODES.field()
    node_rank: int = o.NODE_RANK.field()
    rdzv_endpoint: str | None = o.RDZV_ENDPOINT.field()
    timeout_s: float = o.TIMEOUT.field(600.0)
    nproc: int = field(init=False, default=0)  # ranks per node, from the run
    bind: bool = field(init=False, default=False)
    emulate_nodes: int | None = field(init=False, default=None)  # the run's lab, again
    link: str | None = field(init=False, default=None)
    emulation: dict | None = field(init=False, default=None)  # the run's run.json says
    device: str | None = field(init=False, default=None)  # "cpu" or "cuda": the run's (None: run.json does not say)
    backend: str | None = field(init=False, default=None)  # "gloo" or "nccl", with device

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
        if not isinstance(facts, dict) or not _calibrated(facts):
            raise ValueError(f"{self.run} is not a DDP or DeepSpeed training run: only those are calibrated (their "
                             "what-ifs cost all-reduces)")
        world = facts.get("world_size") or facts.get("nproc_per_node")
        if not isinstance(world, int) or not 2 <= world:
            raise ValueError(f"{self.run}: run.json has no usable world size ({world!r}); calibrate needs 2 or more")
        nodes = whole_number(facts.get("nnodes")) or 1
        self.nproc = world // nodes
        if nodes * self.nproc != world or self.nproc > o.MAX_NPROC:
            raise ValueError(f"{self.run}: run.json's world size {world} is not {nodes} node(s) of up to "
                             f"{o.MAX_NPROC} ranks each")
        lab = facts.get("emulation")
        if nodes > 1 and self.nnodes == 1 and isinstance(lab, dict):  # its lab, again
            try:
                self.link = str(lab["link"])
                parse_rate(self.link)
            except (KeyError, ValueError) as e:
                raise ValueError(f"{self.run}: run.json's emulation has no usable link ({e})") from None
            self.emulate_nodes = nodes
            if (reason := why_not()) is not None:
                raise ValueError(f"{self.run} ran on emulated nodes, and calibrates on them again: {reason}")
        elif self.nnodes != nodes:
            raise ValueError(f"{self.run} ran on {nodes} node{'s' if nodes > 1 else ''}: calibrate with --nnodes "
                             f"{nodes}" + (" --node-rank K --rdzv-endpoint HOST:PORT on each of them" if nodes > 1 else ""))
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}, got {self.node_rank}")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
        self.device, self.backend = _devices(self.run, facts, self.nproc)
        self.bind = bool(facts.get("ranks_bound_to_cores", facts.get("demo") is not None))
        self.emulation = lab if isinstance(lab, dict) else None
        if not os.access(self.run, os.W_OK):
            raise ValueError(f"{self.run} is not writable: the calibration is stored there")

    @property
    def log_dir(self) -> Path:
        return self.run / "logs" / "calibrate" / (f"node-{self.node_rank}" if self.nnodes > 1 else "")

    def command(self) -> list[str]:
        """The ``ddpscope calibrate`` command line (run on every node of a lab)."""
        cmd = ["ddpscope", "calibrate", "--max-mb", f"{self.max_mb:g}", "--timeout", f"{self.timeout_s:g}"]
        if self.emulate_nodes is not None:  # what the lab's launcher strips for each node
            cmd += ["--emulate-nodes", str(self.emulate_nodes), "--link", str(self.link)]
        return cmd + ["--", str(self.run.resolve())]

    def launch_config(self) -> LaunchConfig:
        args = ["--out", str(self.run.resolve()), "--max-mb", repr(self.max_mb)] + (["--bind"] if self.bind else [])
        if self.device is not None:
            args += ["--device", self.device, "--backend", str(self.backend)]
        if self.nnodes > 1:  # what calibration.json says the sweep crossed
            args += ["--nodes", str(self.nnodes)]
            if self.emulation is not None:
                args += ["--emulation", json.dumps(self.emulation)]
        return LaunchConfig(target="ddpscope.tracer.workloads.calibrate_job", args=args, nproc=self.nproc,
                            nnodes=self.nnodes, node_rank=self.node_rank, rdzv_endpoint=self.rdzv_endpoint,
                            log_dir=self.log_dir, timeout_s=self.timeout_s)


def _calibrated(facts: dict) -> bool:
    """Whether a run's what-if reads a calibration: DDP's, and DeepSpeed's buckets."""
    kind = str(facts.get("kind") or fmt.KIND_DDP)
    sharding = facts.get("sharding")
    return kind == fmt.KIND_DDP or (kind == fmt.KIND_SHARDED and isinstance(sharding, dict)
                                    and sharding.get("framework") == "deepspeed")


def _devices(run: Path, facts: dict, nproc: int) -> tuple[str | None, str | None]:
    """The device type and backend a run ran on (run.json's ``device``, ``backend``), to
    calibrate it on them: ("cpu", "gloo"), ("cuda", "nccl") or ("cuda", "gloo"); (None,
    None) where run.json does not say (this machine's choice, as for ddpscope's own jobs).
    A ``ValueError`` where this machine cannot (no GPU, fewer GPUs than NCCL's ranks) or
    calibrate does not (another device or backend) sweep those."""
    device, backend = facts.get("device"), str(facts.get("backend") or "")
    if not isinstance(device, str) or not device:
        return None, None
    kind = device.split(":")[0]
    # a group of several backends ("cpu:gloo,cuda:nccl") ran the run's tensors on its device's
    if kind == "cpu" and (not backend or "gloo" in backend):
        return "cpu", "gloo"
    if kind != "cuda" or not (on := "nccl" if "nccl" in backend else "gloo" if "gloo" in backend else None):
        raise ValueError(f"{run} ran on {device} with {backend or 'an unnamed backend'}: calibrate sweeps gloo on "
                         "CPU, and NCCL or gloo on CUDA, only")
    if (why := why_not_as_run(_gpus_here(), nproc, on)) is not None:
        raise ValueError(f"{run} ran on CUDA ({on}), and this machine has {why}: calibrate it where it ran")
    return "cuda", on


def _gpus_here() -> int:
    """How many CUDA devices torch sees here (``CUDA_VISIBLE_DEVICES`` applied), asked of a
    child process: this one stays torch-free and never initialises CUDA (the warm launcher
    forks ranks from it). A ``ValueError`` when the child cannot say."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        return int(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        raise ValueError("cannot tell how many GPUs this machine has (python -c 'import torch' failed): the run "
                         "ran on CUDA, and is calibrated on CUDA only") from None


def run_calibrate(cfg: CalibrateConfig, on_progress: Callable[[dict], None] = lambda p: None,
                  on_output: OnLine = lambda r, l, e: None, launcher: Launcher = launch
                  ) -> LaunchResult:
    """Run the calibration job against an existing run folder; only ``calibration.json``
    (written atomically by rank 0) and its logs are added there. A run of emulated
    nodes calibrates in a lab like its own (one ``ddpscope calibrate`` per node)."""
    if cfg.emulate_nodes is not None:
        from ddpscope.tracer.launch.emulated import run_emulated

        shutil.rmtree(cfg.run / "logs" / "calibrate", ignore_errors=True)
        return run_emulated(cfg, on_progress, on_output, final=cfg.run / "calibration.json", record=None)
    shutil.rmtree(cfg.log_dir, ignore_errors=True)

    def _line(local_rank: int | None, text: str, err: bool) -> None:
        rec = parse_progress(text)
        if rec is not None:
            on_progress(rec)
        else:
            on_output(local_rank, text, err)

    return launcher(cfg.launch_config(), _line)
