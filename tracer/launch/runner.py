"""``ddpscope run``: launch a training script under torchrun, traced (``own_jobs.py``
launches ddpscope's own ring and ZeRO jobs the same way, through ``launch_traced``).

``run`` traces a training script as it is (the user's, or the bundled demo with
``--demo``): its ranks start with the capture bootstrap on ``PYTHONPATH`` and the
capture settings in the environment (``tracer.capture.autotrace.config``). Torch-free: the
dashboard validates settings with these configs without importing torch.

The run folder gets ``run.json`` (status ``running`` until rank 0 marks it ``complete``;
``failed`` with the reason if the job fails; what a rerun needs), ``rank-<r>.json`` per
rank and ``logs/`` (torchrun's per-rank stdout/stderr and error files); a multi-node run
also ``nodes/`` and one log folder per node (``nodes.py``).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ddpscope.tracer import format as fmt
from ddpscope.tracer import options as o
from ddpscope.tracer.capture.autotrace.config import CaptureConfig
from ddpscope.tracer.launch import nodes
from ddpscope.tracer.launch.hangs import drop_empty_stacks
from ddpscope.tracer.launch.native import build_native
from ddpscope.tracer.launch.nodes import check_out_dir
from ddpscope.tracer.launch.outcome import failed_after_training, unfinished_ranks
from ddpscope.tracer.launch.torchrun import LaunchConfig, LaunchResult, OnLine, launch
from ddpscope.tracer.progress import parse_progress
from ddpscope.tracer.writer import read_json, write_json_atomic

Launcher = Callable[[LaunchConfig, OnLine], LaunchResult]

BOOTSTRAP = Path(__file__).resolve().parents[1] / "capture" / "autotrace" / "bootstrap"
DEMO_SCRIPT = "ddpscope.tracer.workloads.demo.train"
DEMO_STEPS = 20  # a demo run without --steps


@dataclass(kw_only=True)
class RunConfig:
    """A traced run of a training script. ``script``: the command after ``--``, i.e.
    ``["train.py", *args]`` or ``["-m", "package.module", *args]``, run in ``cwd``;
    or ``demo`` (a bundled model) instead. Sizes in MiB (PyTorch's ``bucket_cap_mb`` is
    MiB), times in seconds."""

    out: Path | str = o.OUT.field()
    script: list[str] = field(default_factory=list)
    demo: str | None = o.DEMO.field()
    nproc: int = o.NPROC.field()
    bucket_cap_mb: float | None = o.BUCKET_CAP_MB.field()
    bucket_cap_mb_list: tuple[float, ...] | str | None = o.BUCKET_CAP_MB_LIST.field()
    steps: int | None = o.STEPS.field()
    timeout_s: float = o.TIMEOUT.field()
    hang_timeout_s: float = o.HANG_TIMEOUT.field()
    nnodes: int = o.NNODES.field()
    node_rank: int = o.NODE_RANK.field()
    emulate_nodes: int | None = o.EMULATE_NODES.field()
    link: str | None = o.LINK.field()
    rdzv_endpoint: str | None = o.RDZV_ENDPOINT.field()
    profile: bool = o.PROFILE.field()
    profile_steps: int = o.PROFILE_STEPS.field()
    capture: str = o.CAPTURE.field()
    reshard_after_forward: str | None = o.RESHARD_AFTER_FORWARD.field()
    forward_prefetch: int | None = o.FORWARD_PREFETCH.field()
    backward_prefetch: int | None = o.BACKWARD_PREFETCH.field()
    zero_stage: int | None = o.ZERO_STAGE.field()
    grad_marks_every: int = o.GRAD_MARKS_EVERY.field()
    cwd: Path | str = field(default_factory=Path.cwd)

    def __post_init__(self) -> None:
        o.check_fields(self)
        if self.bucket_cap_mb_list is not None:
            self.bucket_cap_mb_list = o.mib_list(self.bucket_cap_mb_list)
            if self.bucket_cap_mb is not None:
                raise ValueError("give --bucket-cap-mb or --bucket-cap-mb-list, not both")
        self.out = Path(self.out)
        self.cwd = Path(self.cwd).resolve()
        self.script = [str(a) for a in self.script]
        if self.demo is not None and self.script:
            raise ValueError("give either --demo MODEL or a script after --, not both")
        if not self.argv:
            raise ValueError("nothing to run: give the training script after -- (e.g. -- train.py --lr 3e-4) "
                             "or --demo gpt")
        if not self.cwd.is_dir():
            raise ValueError(f"the working folder {self.cwd} does not exist")
        nodes.check_node_settings(self)
        self.program_path()  # the script or module exists
        check_out_dir(self.out, self.job if self.nnodes > 1 else None, self.node_rank)

    @property
    def job(self) -> str:
        """This job's identity, the same on every node: what every node was asked to run."""
        return nodes.job_key({"argv": self.argv, "nproc": self.nproc, "nnodes": self.nnodes,
                              "rdzv_endpoint": self.rdzv_endpoint, "bucket_cap_mb": self.bucket_cap_mb,
                              "bucket_cap_mb_list": self.bucket_cap_mb_list,
                              "steps": self.steps, "capture": self.capture, **self.sharding,
                              "profile_steps": self.profile_steps if self.profile else None})

    @property
    def sharding(self) -> dict:
        """The sharding settings this run overrides, FSDP2's and DeepSpeed's (None: the script's own)."""
        return {"reshard_after_forward": self.reshard_after_forward, "forward_prefetch": self.forward_prefetch,
                "backward_prefetch": self.backward_prefetch, "zero_stage": self.zero_stage}

    @property
    def argv(self) -> list[str]:
        """What runs on every rank: the script (or ``-m module``) and its arguments."""
        if self.demo is not None:
            return ["-m", DEMO_SCRIPT, "--model", self.demo, "--steps", str(self.steps or DEMO_STEPS)]
        return self.script

    @property
    def module(self) -> bool:
        return self.argv[0] == "-m"

    @property
    def program(self) -> str:
        """The script path or module name."""
        if self.module:
            if len(self.argv) < 2 or self.argv[1].startswith("-"):
                raise ValueError("-m needs a module name (e.g. -m package.train)")
            return self.argv[1]
        return self.argv[0]

    @property
    def program_args(self) -> list[str]:
        return self.argv[2:] if self.module else self.argv[1:]

    def program_path(self) -> Path:
        """The file that runs: the script, or the module's file (``ValueError`` if none)."""
        if self.module:
            if self.program.split(".")[0] == "ddpscope":  # ours (the demo): where Python finds this package
                spec = importlib.util.find_spec(self.program)
                found = Path(spec.origin) if spec is not None and spec.origin else None
            else:
                found = find_module_file(self.program, [str(self.cwd), *sys.path[1:]])
            if found is None:
                raise ValueError(f"-m {self.program}: no such module (searched {self.cwd} and this Python's path)")
            return found
        path = (self.cwd / self.program).resolve()
        if self.program.startswith("-"):
            raise ValueError(f"{self.program!r} is not a script; put the script after -- (e.g. -- train.py)")
        if not path.is_file():
            raise ValueError(f"script {self.program} does not exist (in {self.cwd})")
        return path

    def label(self) -> str:
        """A short name for the run: the demo model, or the script's name."""
        return self.demo or Path(self.program.replace(".", "/") if self.module else self.program).stem

    def launch_config(self, capture_note: str | None = None) -> LaunchConfig:
        """``capture_note``: the compiled capture could not be built (why): the ranks use
        the Python hooks and record why."""
        capture = CaptureConfig(out=str(self.out.resolve()), bucket_cap_mb=self.bucket_cap_mb,
                                bucket_cap_mb_list=self.bucket_cap_mb_list, steps=self.steps,
                                profile_steps=self.profile_steps if self.profile else None,
                                capture="python" if capture_note else self.capture, capture_note=capture_note,
                                grad_marks_every=self.grad_marks_every, **self.sharding)
        return LaunchConfig(target=self.program, args=self.program_args, module=self.module, cwd=self.cwd,
                            nproc=self.nproc, nnodes=self.nnodes, node_rank=self.node_rank,
                            rdzv_endpoint=self.rdzv_endpoint, log_dir=self.out / fmt.node_logs(self.node_rank, self.nnodes),
                            timeout_s=self.timeout_s,
                            env={**capture_env(), **capture.to_env()}, run_dir=self.out.resolve(),
                            hang_timeout_s=self.hang_timeout_s)

    def facts(self) -> dict:
        """What ``run.json`` records so that the run can be rerun (before the ranks add
        what DDP really used)."""
        path = self.program_path()
        return {
            "kind": fmt.KIND_DDP, "model": self.label(), "demo": self.demo, "job": self.job,
            "script": {"argv": self.argv, "module": self.module, "path": str(path),
                       "sha256": file_sha256(path), "cwd": str(self.cwd)},
            "nproc_per_node": self.nproc, "nnodes": self.nnodes,
            "bucket_cap_mb_requested": self.bucket_cap_mb, "bucket_cap_mb_list_requested": self.bucket_cap_mb_list,
            "steps_requested": self.steps,
            "profile_steps": self.profile_steps if self.profile else None, "capture_path_requested": self.capture,
            "sharding_requested": self.sharding,
        }

    def command(self) -> list[str]:
        """The ``ddpscope run`` command line that reproduces this run (another --out)."""
        cmd = ["ddpscope", "run", "--nproc", str(self.nproc)]
        if self.bucket_cap_mb is not None:
            cmd += ["--bucket-cap-mb", f"{self.bucket_cap_mb:g}"]
        if self.bucket_cap_mb_list is not None:
            cmd += ["--bucket-cap-mb-list", ",".join(f"{c:g}" for c in self.bucket_cap_mb_list)]
        if self.steps is not None:
            cmd += ["--steps", str(self.steps)]
        if self.profile:
            cmd += ["--profile", "--profile-steps", str(self.profile_steps)]
        if self.capture != o.CAPTURE.default:
            cmd += ["--capture", self.capture]
        if self.grad_marks_every != o.GRAD_MARKS_EVERY.default:
            cmd += [o.GRAD_MARKS_EVERY.flag, str(self.grad_marks_every)]
        for flag, value in ((o.RESHARD_AFTER_FORWARD.flag, self.reshard_after_forward),
                            (o.FORWARD_PREFETCH.flag, self.forward_prefetch),
                            (o.BACKWARD_PREFETCH.flag, self.backward_prefetch),
                            (o.ZERO_STAGE.flag, self.zero_stage)):
            if value is not None:
                cmd += [flag, str(value)]
        if self.nnodes > 1:
            cmd += ["--nnodes", str(self.nnodes), "--node-rank", str(self.node_rank),
                    "--rdzv-endpoint", str(self.rdzv_endpoint)]
        if self.emulate_nodes is not None:
            cmd += ["--emulate-nodes", str(self.emulate_nodes), "--link", str(self.link)]
        cmd += ["--out", str(self.out)]
        return cmd + (["--demo", self.demo] if self.demo else ["--", *self.script])


def find_module_file(name: str, path: list[str]) -> Path | None:
    """The file ``python -m name`` would run, found without importing anything."""
    parts = name.split(".")
    if not all(p.isidentifier() for p in parts):
        return None
    spec = importlib.machinery.PathFinder.find_spec(parts[0], path)
    for part in parts[1:]:
        if spec is None or not spec.submodule_search_locations:
            return None
        spec = importlib.machinery.PathFinder.find_spec(part, list(spec.submodule_search_locations))
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package runs its __main__
        main = importlib.machinery.PathFinder.find_spec("__main__", list(spec.submodule_search_locations))
        return Path(main.origin) if main is not None and main.origin else None
    return Path(spec.origin) if spec.origin else None


def file_sha256(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def capture_env() -> dict[str, str]:
    """PYTHONPATH for a traced job's ranks: the bootstrap first (its ``sitecustomize``
    installs the capture), then what was there. Nothing else: ddpscope is imported as the
    installed ``ddpscope`` package, so no name the user's code may own (``tracer``,
    ``viz``, ``tests``) is put on the ranks' path."""
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(BOOTSTRAP)] + ([path] if path else []))}


def create_out_dir(out: Path) -> None:
    """Create --out and prove it takes files; ``ValueError`` (one line) if it does not."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".ddpscope-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {out} is not writable: {e.strerror or e}") from None


def run_job(cfg: RunConfig, on_progress: Callable[[dict], None] = lambda p: None,
            on_output: OnLine = lambda r, l, e: None, launcher: Launcher = launch
            ) -> LaunchResult:
    """Run the traced script to its end and leave the run folder consistent.
    ``launcher``: torchrun (default) or a warm launcher (``tracer.launch.warm``).

    Raises ``ValueError`` if the run folder cannot be created (nothing is launched)."""
    note = None
    if cfg.capture == "compiled":  # built before any rank starts: no traced step pays for it
        built = build_native(lambda line: on_output(None, line, True))
        note = None if built["ok"] else f"the compiled capture could not be built: {built['error'][:300]}"
    if cfg.emulate_nodes is not None:  # every node a launcher of its own, in the lab
        from ddpscope.tracer.launch.emulated import run_emulated

        return run_emulated(cfg, on_progress, on_output, final=cfg.out, record=cfg.out)
    node = None if cfg.nnodes == 1 else Node(job=cfg.job, rank=cfg.node_rank, count=cfg.nnodes, nproc=cfg.nproc)
    result = launch_traced(cfg.launch_config(note), cfg.out, {**cfg.facts(), "command": shlex.join(cfg.command())},
                            on_progress, on_output, launcher, node)
    drop_empty_stacks(cfg.out, None if node is None else range(node.rank * node.nproc, (node.rank + 1) * node.nproc))
    if not cfg.out.is_dir():
        result.untraced = f"the run folder {cfg.out} was removed during the run: its trace is lost (training ran)"
        return result
    if not any(fmt.RANK_FILE_RE.match(p.name) for p in cfg.out.iterdir()):
        run_path = cfg.out / fmt.RUN_FILE
        run = read_json(run_path) if run_path.exists() else {}
        notes = [n for n in run.get("notes") or [] if isinstance(n, str)]
        result.untraced = "; ".join(notes) if notes else "no DistributedDataParallel, FSDP2 or DeepSpeed model was built; nothing was traced"
        if result.ok:
            run.update(status=fmt.UNTRACED, error=result.untraced)
            write_json_atomic(run_path, run)
    return result


@dataclass(frozen=True)
class Node:
    """This launcher's node of a multi-node job (``tracer/launch/nodes.py``)."""

    job: str
    rank: int
    count: int
    nproc: int


def launch_traced(lc: LaunchConfig, out: Path, facts: dict, on_progress: Callable[[dict], None],
                   on_output: OnLine, launcher: Launcher, node: Node | None = None) -> LaunchResult:
    """Launch, and leave the run folder consistent. ``node``: one node of several sharing
    ``out`` (only node 0 writes run.json; see ``nodes``)."""
    create_out_dir(out)
    run_path = out / fmt.RUN_FILE
    # when the launcher started the job and saw it end: µs on the host monotonic clock,
    # the ranks' own (time.perf_counter), so launch and teardown show beside the steps
    launched_us = time.perf_counter_ns() / 1000.0
    if node is not None:
        nodes.announce(out, node.job, node.rank, node.count, node.nproc)
    if node is None or node.rank == 0:
        write_json_atomic(run_path, {"format": fmt.FORMAT, "version": fmt.VERSION, "status": fmt.RUNNING, **facts,
                                     "launcher_us": {"launched": launched_us}})
    seen = [0]

    def _line(local_rank: int | None, text: str, err: bool) -> None:
        rec = parse_progress(text)
        if rec is not None:
            seen[0] += 1
            on_progress(rec)
        else:
            on_output(local_rank, text, err)

    result = launcher(lc, _line)
    # torchrun's console copy of the ranks' output can lose its last lines when a rank
    # exits; rank 0's own log holds them all: hand on the progress records not yet seen
    for rec in _logged_progress(lc.log_dir)[seen[0]:]:
        on_progress(rec)
    ended_us = time.perf_counter_ns() / 1000.0
    if node is not None:
        nodes.finish(out, node.rank, fmt.COMPLETE if result.ok and not result.interrupted else fmt.FAILED,
                     result.reason)
        if node.rank != 0:  # run.json is node 0's
            return result
    try:
        run = read_json(run_path) if run_path.exists() else {}
    except (OSError, ValueError):
        run = {}
    run["launcher_us"] = {"launched": launched_us, "ended": ended_us}
    if failed_after_training(result, out, run):
        # training and its trace were done; the process failed on its way out (ZeRO-3 under
        # gloo can abort at interpreter exit): the trace is complete and is kept as such
        how = result.how or "an error"
        what = f"was killed by {how} at exit" if how.startswith(("SIG", "signal")) else f"failed ({how})"
        result.after_training = (f"rank {result.failed_rank} {what}, after training finished: every rank had closed "
                                 "its trace, which is complete")
        run.update({"exit_failure": result.reason, "notes": [*run.get("notes", []), result.after_training]})
    elif not result.ok or result.interrupted:
        run.update({"status": fmt.FAILED, "error": result.reason, "failed_rank": result.failed_rank,
                    "failure": {"rank": result.failed_rank, "how": result.how, "where": result.where,
                                "hung": result.hung, "consequences": result.consequences,
                                "independent": result.independent,
                                "ranks": result.details}})
    elif out.is_dir():
        elsewhere, skip = [], set()
        if node is not None:  # the other nodes' ranks: here (a shared folder) or in their own folders
            elsewhere, late = nodes.wait_for_nodes(out, node.count)
            if late:
                run.setdefault("notes", []).append(
                    f"node{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not say how "
                    f"{'they' if len(late) > 1 else 'it'} ended within {nodes.FINISH_WAIT_S:g} s")
        if elsewhere:
            ranks = [r for k in elsewhere for r in range(k * node.nproc, (k + 1) * node.nproc)]
            skip = set(ranks)
            result.elsewhere = (f"this folder holds node 0's ranks; node{'s' if len(elsewhere) > 1 else ''} "
                                f"{', '.join(map(str, elsewhere))} wrote ranks {_span(ranks)} into "
                                f"{'their' if len(elsewhere) > 1 else 'its'} own --out: join the folders with "
                                f"`ddpscope merge {out} OTHER_NODE_FOLDER... --out MERGED`")
            run["nodes_elsewhere"] = elsewhere
        if (unfinished := unfinished_ranks(out, run, skip=skip)) is not None:
            # the job ran to its end, its trace did not (a full disk, a file that could not be
            # replaced): what was written stays readable, and is said to be incomplete
            result.incomplete = f"the trace is incomplete ({unfinished}); the job ran to its end"
            run.update({"status": fmt.INCOMPLETE, "error": result.incomplete})
    try:
        write_json_atomic(run_path, run)
    except OSError:
        pass  # the folder went away or cannot be written: the CLI says so (run_job)
    return result


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def _logged_progress(log_dir: Path) -> list[dict]:
    """Every progress record in local rank 0's stdout log (torchrun's layout)."""
    records = []
    for log in sorted(log_dir.glob("*/attempt_*/0/stdout.log")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        records += [r for r in map(parse_progress, text.splitlines()) if r is not None]
    return records
