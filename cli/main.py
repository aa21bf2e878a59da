"""The ``ddpscope`` command (also ``python -m ddpscope.cli``):

    ddpscope run [--nproc N] [--bucket-cap-mb X] [--steps S] --out DIR -- train.py [args]
    ddpscope run ... --out DIR -- -m package.module [args]
    ddpscope run --demo gpt --out DIR
    ddpscope ring | zero ...            ddpscope's own workloads
    ddpscope calibrate RUN               all-reduce sweep + contention, stored with the run
    ddpscope whatif RUN [--caps ...]     predicted step time at other bucket_cap_mb, the advisor
                                         (a sharded run: peak, step, states per setting)
    ddpscope whatif RUN --apply          ... and the run again with its recommendation, A/B
    ddpscope summary RUN | perfetto RUN --out FILE
    ddpscope dashboard [RUNS_DIR]

The parser of every subcommand, and the dispatch: jobs (``jobs.py``), the reading
commands (``reading.py``), ``whatif --apply`` (``whatif_apply.py``) and the dashboard
(``dashboard.py``). Parse -> build (a config; ``ValueError`` names the flag) -> run ->
report; bad arguments: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from ddpscope.cli.dashboard import dashboard_command
from ddpscope.cli.jobs import build_command, launch_command
from ddpscope.cli.output import PROG
from ddpscope.cli.whatif_apply import whatif_apply
from ddpscope.tracer import options as o


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from ddpscope.tracer.launch.calibrate import CalibrateConfig
    from ddpscope.tracer.launch.own_jobs import RingConfig, ZeroConfig
    from ddpscope.tracer.launch.runner import RunConfig

    p = _Parser(prog=PROG, description="See distributed data-parallel training: trace real DDP, FSDP2 and "
                                       "DeepSpeed runs, read them, open the dashboard.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser(
        "run", help="run a training script under torchrun and trace every rank (no change to the script)",
        description="Run a training script (or the bundled demo) under torchrun and trace what it builds: each "
                    "DDP model bucket by bucket, each FSDP2 model unit by unit, ZeroRedundancyOptimizer, "
                    "DeepSpeed's ZeRO engine. Everything after -- is the script and its arguments.",
        epilog="examples: ddpscope run --nproc 2 --bucket-cap-mb 4 --steps 20 --out runs/mine -- train.py --lr 3e-4"
               " | ddpscope run --out runs/m -- -m mypkg.train | ddpscope run --demo gpt --out runs/demo")
    o.add_arguments(r, RunConfig)
    o.add_arguments(r, _Output)
    r.add_argument("script", nargs=argparse.REMAINDER, help="the script and its arguments (after --)")
    g = sub.add_parser("ring", help="run a traced ring all-reduce beside dist.all_reduce",
                       description="Run a ring all-reduce built from send/recv on N local ranks, step by step "
                                   "traced, and PyTorch's dist.all_reduce on the same tensor for comparison.")
    o.add_arguments(g, RingConfig)
    o.add_arguments(g, _Output)
    z = sub.add_parser("zero", help="measure memory and communication per ZeRO stage",
                       description="Train the demo model a few steps under each ZeRO stage (0: DDP + Adam, "
                                   "1: ZeroRedundancyOptimizer, 2: FSDP without resharding after forward, "
                                   "3: FSDP full sharding) and measure what each rank holds and sends.")
    o.add_arguments(z, ZeroConfig)
    o.add_arguments(z, _Output)
    c = sub.add_parser("calibrate", help="measure all-reduce times and contention for a run's what-if",
                       description="On as many ranks as a traced run had, on its nodes: dist.all_reduce of 4 KiB "
                                   ".. --max-mb, then compute and all-reduces side by side. Stored as "
                                   "calibration.json in the run's folder; `ddpscope whatif` uses it. A run of "
                                   "emulated nodes is calibrated in a lab like its own; a run on several real "
                                   "nodes with one `calibrate RUN --nnodes N --node-rank K --rdzv-endpoint H:P` "
                                   "per node.")
    c.add_argument("run", help="a traced DDP or DeepSpeed run folder")
    o.add_arguments(c, CalibrateConfig)
    o.add_arguments(c, _Output)
    sub.add_parser("build", help="build the compiled capture (--capture compiled) once for this torch",
                   description="Build ddpscope's C++ extension for this torch and Python into the cache folder "
                               "($DDPSCOPE_CACHE, else ~/.cache/ddpscope): once, under a file lock. `ddpscope run "
                               "--capture compiled` builds it when missing; run this ahead on clusters whose nodes "
                               "share the cache.")
    d = sub.add_parser("dashboard", help="open the dashboard on a runs folder",
                       description="Open the ddpscope dashboard (Streamlit) on a runs folder.")
    d.add_argument("runs_dir", nargs="?", default="runs",
                   help="where runs started from the page go and are listed (default ./runs)")
    d.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    d.add_argument("--port", type=int, default=8501, help="port (default 8501)")
    d.add_argument("--allow-commands", action="store_true",
                   help="let the page start new training commands even when it listens beyond this machine")
    from ddpscope.cli.reading import add_viz_commands  # light: argparse only

    add_viz_commands(sub)
    return p


@dataclass
class _Output:
    """What of the job's output the command shows (``OutputFilter``)."""

    verbose: bool = o.VERBOSE.field()
    quiet: bool = o.QUIET.field()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("run", "ring", "zero", "calibrate"):
        return launch_command(args)
    if args.command == "dashboard":
        return dashboard_command(args)
    if args.command == "build":
        return build_command()
    if args.command == "whatif" and args.apply:
        return whatif_apply(args)
    from ddpscope.cli.reading import run_viz_command

    return run_viz_command(args, prog=f"{PROG} {args.command}")


if __name__ == "__main__":
    sys.exit(main())
