"""``ddpscope run | ring | zero | calibrate | build``: parse -> build a config (a
``ValueError`` names the flag) -> run the job through its runner -> report. Exit codes: 0
success, 1 the job failed (a one-line reason and the failing rank's stderr tail), 2 bad
arguments (one line, nothing written), 130 interrupted. Torch-free: the parent never
imports torch."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from ddpscope.cli.output import (
    PROG,
    OutputFilter,
    calibrate_progress,
    ring_progress,
    run_progress,
    say,
    zero_progress,
)
from ddpscope.tracer import format as fmt
from ddpscope.tracer.progress import PROGRESS_PASSTHROUGH_ENV, emit_progress


def launch_command(args: argparse.Namespace) -> int:
    """parse (config) -> run (the job, through its runner) -> report, for run/ring/zero/calibrate."""
    from ddpscope.tracer.launch import calibrate, own_jobs, runner

    config_cls = {"run": runner.RunConfig, "ring": own_jobs.RingConfig, "zero": own_jobs.ZeroConfig,
                  "calibrate": calibrate.CalibrateConfig}[args.command]
    prog = f"{PROG} {args.command}"
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "verbose", "quiet")}
    script = settings.get("script", [])
    if script[:1] == ["--"]:  # argparse keeps the separator
        settings["script"] = script[1:]
    elif "--" in script and script[0] != "-m" and not os.path.isfile(script[0]):
        # a stray value (`--profile 3`) started the script before the separator
        rest = " ".join(script[1:script.index("--")])
        print(f"{prog}: error: {script[0]!r} was taken as the script, before --" + (f", and {rest!r} as its arguments"
              if rest else "") + ": ddpscope's flags and their values go before --, the script after it",
              file=sys.stderr)
        return 2
    try:
        if args.verbose and args.quiet:
            raise ValueError("give either --verbose or --quiet, not both")
        cfg = config_cls(**settings)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return run_config(cfg, args.command, args.verbose, args.quiet)


def run_config(cfg, command: str, verbose: bool = False, quiet: bool = False) -> int:
    """Run a built config of ``command`` (run/ring/zero/calibrate) to its end, showing its
    progress and output; the exit code."""
    from ddpscope.tracer.launch import calibrate, own_jobs, runner

    run, describe = {
        "run": (runner.run_job, run_progress),
        "ring": (own_jobs.run_ring, ring_progress),
        "zero": (own_jobs.run_zero, zero_progress),
        "calibrate": (calibrate.run_calibrate, calibrate_progress),
    }[command]
    prog = f"{PROG} {command}"
    last, unsaid = [0.0], [None]

    def progress(rec: dict) -> None:
        if os.environ.get(PROGRESS_PASSTHROUGH_ENV) == "1":  # a node of an emulated run: its launcher shows it
            emit_progress(**rec)
            return
        line = describe(rec, cfg)
        now = time.monotonic()
        # a fast script makes hundreds of steps a second: a line per half second, and the last
        final = rec.get("event") != "step" or rec.get("step") == rec.get("steps")
        if line and (final or now - last[0] >= 0.5):
            last[0], unsaid[0] = now, None
            say(line)
        elif line:
            unsaid[0] = line

    output = OutputFilter(verbose, quiet, getattr(cfg, "node_rank", 0) * getattr(cfg, "nproc", 0))
    if command == "run":
        what = cfg.demo or " ".join(cfg.script)
        # only what this run overrides: whether the script is DDP or FSDP shows once it runs
        settings = ([f"bucket_cap_mb {cfg.bucket_cap_mb:g} MiB"] if cfg.bucket_cap_mb is not None else []) + \
            ([f"bucket_cap_mb_list {','.join(f'{c:g}' for c in cfg.bucket_cap_mb_list)} MiB"]
             if cfg.bucket_cap_mb_list is not None else []) + \
            [f"{k} {str(v).lower()}" for k, v in cfg.sharding.items() if v is not None]
        # whether the script sets its own value shows only once it builds its model (a rank says so then)
        overrides = f", with {', '.join(settings)} in place of the script's own" if settings else ""
        ranks = cfg.nproc * (cfg.emulate_nodes or cfg.nnodes)
        node = f" (node {cfg.node_rank} of {cfg.nnodes}: ranks {output.first_rank}..{output.first_rank + cfg.nproc - 1})" \
            if cfg.nnodes > 1 else ""
        if cfg.emulate_nodes:
            node = f" ({cfg.emulate_nodes} emulated nodes of {cfg.nproc} ranks, each over a {cfg.link} link)"
        say(f"tracing {what} on {ranks} rank{'' if ranks == 1 else 's'}{node}{overrides}")
        shown = ("ddpscope's lines only" if quiet else "every rank's output" if verbose else
                 "rank 0's output" if output.first_rank == 0 else "no rank's output (rank 0 is on node 0)")
        say(f"showing {shown}; every rank's stdout and stderr are kept in {cfg.out / 'logs'}")
    # SIGTERM (a scheduler, `kill`) ends the job like Ctrl-C does: stopped and reaped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        result = run(cfg, progress, output)
    except ValueError as e:  # the run folder could not be made: nothing was launched
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if unsaid[0]:
        say(unsaid[0])
    if getattr(result, "after_training", None):  # the trace is whole: said, kept, the failure's exit code
        print(f"{prog}: {result.after_training}: {cfg.out}", file=sys.stderr)
        if result.stderr_tail:
            print(f"--- rank {result.failed_rank} stderr (last lines) ---\n{result.stderr_tail}", file=sys.stderr)
        return 1
    if not result.ok:
        print(f"{prog}: run failed: {result.reason}", file=sys.stderr)
        for line in result.details:  # a hang: where every rank was
            print(f"  {line}", file=sys.stderr)
        for line in result.independent:
            print(f"  also failed on its own: {line}", file=sys.stderr)
        for line in result.consequences:
            print(f"  consequence: {line}", file=sys.stderr)
        if result.stderr_tail and not result.hung:
            print(f"--- rank {result.failed_rank} stderr (last lines) ---\n{result.stderr_tail}", file=sys.stderr)
        if command != "calibrate":  # run.json is node 0's (a node of several keeps its own record)
            says = "run.json says failed" if getattr(cfg, "node_rank", 0) == 0 else \
                f"nodes/node-{cfg.node_rank}.json says failed"
            # a rank file anywhere in the run folder (a node of several may keep its own below it)
            traced = cfg.out.is_dir() and any(fmt.RANK_FILE_RE.match(p.name) for p in cfg.out.rglob("rank-*"))
            print(f"partial trace kept in {cfg.out} ({says})" if traced else
                  f"nothing was traced; the run's logs are in {cfg.out / 'logs'} ({says})", file=sys.stderr)
        return 130 if result.interrupted else 1
    if getattr(result, "untraced", None):
        print(f"{prog}: {result.untraced}", file=sys.stderr)
        return result.returncode
    if getattr(result, "incomplete", None):  # training is fine: exit 0, and say what was lost
        print(f"{prog}: warning: {result.incomplete}; what was written is kept in {cfg.out}", file=sys.stderr)
    if getattr(result, "elsewhere", None):  # a multi-node job whose nodes each wrote their own folder
        say(result.elsewhere)
    if command == "run":
        _say_spawned(cfg)
    print(cfg.run / "calibration.json" if command == "calibrate" else cfg.out)
    return 0


def _say_spawned(cfg) -> None:
    """A script that starts its own ranks (``torch.multiprocessing.spawn``) makes a job
    larger than the ranks launched: say its real size, from run.json, once it is known."""
    from ddpscope.tracer import format as fmt
    from ddpscope.tracer.writer import read_json

    launched = cfg.nproc * (cfg.emulate_nodes or cfg.nnodes)
    try:
        world = int(read_json(cfg.out / fmt.RUN_FILE).get("world_size") or 0)
    except (OSError, ValueError, TypeError):
        return
    if world > launched:
        say(f"the job had {world} ranks: the script started them itself from the {launched} launched")


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def build_command() -> int:
    from ddpscope.tracer.launch.native import build_native

    result = build_native(lambda line: print(line, file=sys.stderr, flush=True))
    if not result["ok"]:
        return 1
    print(result["library"])
    return 0
