"""The ``ddpscope`` command (also ``python -m ddpscope.tracer``):

    ddpscope run [--nproc N] [--bucket-cap-mb X] [--steps S] --out DIR -- train.py [args]
    ddpscope run ... --out DIR -- -m package.module [args]
    ddpscope run --demo gpt --out DIR
    ddpscope ring | zero ...            ddpscope's own workloads
    ddpscope calibrate RUN               all-reduce sweep + contention, stored with the run
    ddpscope whatif RUN [--caps ...]     predicted step time at other bucket_cap_mb, the advisor
    ddpscope whatif RUN --apply          ... and the run again with its recommendation, A/B
    ddpscope summary RUN | perfetto RUN --out FILE
    ddpscope dashboard [RUNS_DIR]

Parse -> build (a config; ``ValueError`` names the flag) -> run -> report. Exit codes:
0 success, 1 the job failed (one-line reason and the failing rank's stderr tail on
stderr), 2 bad arguments (one line, nothing written), 130 interrupted. Torch-free: the
parent never imports torch.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ddpscope.tracer import options as o
from ddpscope.tracer.progress import MESSAGE_PREFIX, PROGRESS_PASSTHROUGH_ENV, emit_progress

PROG = "ddpscope"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from ddpscope.tracer.launch.calibrate import CalibrateConfig
    from ddpscope.tracer.launch.own_jobs import RingConfig, ZeroConfig
    from ddpscope.tracer.launch.runner import RunConfig

    p = _Parser(prog=PROG, description="See distributed data-parallel training: trace real DDP runs, "
                                       "read them, open the dashboard.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser(
        "run", help="run a training script under torchrun and trace every rank (no change to the script)",
        description="Run a training script (or the bundled demo) under torchrun and trace every DDP model it "
                    "builds, bucket by bucket. Everything after -- is the script and its arguments.",
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
    c.add_argument("run", help="a traced DDP run folder")
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
    from ddpscope.viz.cli import add_viz_commands  # light: argparse only

    add_viz_commands(sub)
    return p


@dataclass
class _Output:
    """What of the job's output the command shows (``OutputFilter``)."""

    verbose: bool = o.VERBOSE.field()
    quiet: bool = o.QUIET.field()


class OutputFilter:
    """Which lines of a job's output reach the terminal, and where.

    Default: rank 0's own output as it comes (its stdout to stdout, its stderr to stderr,
    as under torchrun), ddpscope's lines from any rank (they start with ``ddpscope: ``),
    nothing of the other ranks (their output is in the run's logs). ``verbose``: every
    rank's, marked ``[rank r]``, and torchrun's own. ``quiet``: ddpscope's lines only.
    ``first_rank``: the global rank of this node's local rank 0."""

    def __init__(self, verbose: bool, quiet: bool, first_rank: int = 0) -> None:
        self.verbose, self.quiet, self.first_rank = verbose, quiet, first_rank
        self.lost = False  # the terminal went away (a closed pipe): the job goes on, its output is in the logs

    def __call__(self, rank: int | None, line: str, err: bool) -> None:
        if self.lost:
            return
        try:
            self._show(rank, line, err)
        except (OSError, ValueError):  # BrokenPipeError, a closed stream: never the job's end
            self.lost = True

    def _show(self, rank: int | None, line: str, err: bool) -> None:
        if self.verbose:
            text = line if rank is None else f"[rank {self.first_rank + rank}] {line}"
            print(text, file=sys.stderr if err or rank is None else sys.stdout, flush=True)
        elif line.startswith(MESSAGE_PREFIX):  # the capture's own line (a note, a warning)
            print(line, file=sys.stderr, flush=True)
        elif not self.quiet and rank == 0 and self.first_rank == 0:
            print(line, file=sys.stderr if err else sys.stdout, flush=True)


def say(text: str) -> None:
    """One of ddpscope's own lines on the terminal, marked as the capture's are (a closed
    stream loses the line, never the job)."""
    try:
        print(MESSAGE_PREFIX + text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def run_progress(rec: dict, cfg) -> str | None:
    """The line to print for a progress record of ``ddpscope run`` (None: nothing)."""
    if rec.get("event") == "step":
        total = f"/{rec['steps']}" if rec.get("steps") else ""
        return f"step {rec['step']}{total}  {rec['ms']:.0f} ms"
    return None


def ring_progress(rec: dict, cfg) -> str | None:
    if rec.get("event") == "start":
        return (f"ring all-reduce of {rec['bytes'] / 2**20:g} MiB ({rec['dtype']}) on {rec['world_size']} ranks, "
                f"{rec['repeat']} rounds")
    if rec.get("event") == "round":
        return f"round {rec['round']}/{rec['repeat']}  ring {rec['ring_ms']:.2f} ms  dist.all_reduce {rec['ref_ms']:.2f} ms"
    return None


def zero_progress(rec: dict, cfg) -> str | None:
    if rec.get("event") == "start":
        return f"ZeRO stages {','.join(map(str, rec['stages']))} of {rec['model']} on {rec['world_size']} ranks"
    if rec.get("event") == "stage":
        return (f"stage {rec['stage']} ({rec['name']}): model states {rec['model_state_mib']:.2f} MiB, "
                f"peak {rec['peak_mib']:.2f} MiB, sent {rec['comm_mib']:.2f} MiB per step (rank 0)")
    return None


def calibrate_progress(rec: dict, cfg) -> str | None:
    if rec.get("event") == "start":
        return f"calibrating on {rec['world_size']} ranks ({rec['backend']})"
    if rec.get("event") == "size":
        return f"all-reduce {rec['bytes'] / 2**20:g} MiB: {rec['us'] / 1e3:.2f} ms"
    if rec.get("event") == "done":
        return (f"contention: compute {1 + rec['compute_slowdown']:.2f}x as long beside all-reduces, "
                f"all-reduces {1 + rec['comm_slowdown']:.2f}x beside compute")
    return None


def launch_command(args: argparse.Namespace) -> int:
    """parse (config) -> run (the job, through its runner) -> report, for run/ring/zero/calibrate."""
    from ddpscope.tracer.launch import calibrate, own_jobs, runner

    config_cls = {"run": runner.RunConfig, "ring": own_jobs.RingConfig, "zero": own_jobs.ZeroConfig,
                  "calibrate": calibrate.CalibrateConfig}[args.command]
    prog = f"{PROG} {args.command}"
    settings = {k: v for k, v in vars(args).items() if k not in ("command", "verbose", "quiet")}
    if settings.get("script", [])[:1] == ["--"]:  # argparse keeps the separator
        settings["script"] = settings["script"][1:]
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
        overrides = f", overriding the script's {', '.join(settings)}" if settings else ""
        ranks = cfg.nproc * (cfg.emulate_nodes or cfg.nnodes)
        node = f" (node {cfg.node_rank} of {cfg.nnodes}: ranks {output.first_rank}..{output.first_rank + cfg.nproc - 1})" \
            if cfg.nnodes > 1 else ""
        if cfg.emulate_nodes:
            node = f" ({cfg.emulate_nodes} emulated nodes of {cfg.nproc} ranks, each over a {cfg.link} link)"
        say(f"tracing {what} on {ranks} ranks{node}{overrides}")
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
    if not result.ok:
        print(f"{prog}: run failed: {result.reason}", file=sys.stderr)
        for line in result.details:  # a hang: where every rank was
            print(f"  {line}", file=sys.stderr)
        for line in result.consequences:
            print(f"  consequence: {line}", file=sys.stderr)
        if result.stderr_tail and not result.hung:
            print(f"--- rank {result.failed_rank} stderr (last lines) ---\n{result.stderr_tail}", file=sys.stderr)
        if command != "calibrate":  # run.json is node 0's (a node of several keeps its own record)
            says = "run.json says failed" if getattr(cfg, "node_rank", 0) == 0 else \
                f"nodes/node-{cfg.node_rank}.json says failed"
            print(f"partial trace kept in {cfg.out} ({says})", file=sys.stderr)
        return 130 if result.interrupted else 1
    if getattr(result, "untraced", None):
        print(f"{prog}: {result.untraced}", file=sys.stderr)
        return result.returncode
    if getattr(result, "incomplete", None):  # training is fine: exit 0, and say what was lost
        print(f"{prog}: warning: {result.incomplete}; what was written is kept in {cfg.out}", file=sys.stderr)
    if getattr(result, "elsewhere", None):  # a multi-node job whose nodes each wrote their own folder
        say(result.elsewhere)
    print(cfg.run / "calibration.json" if command == "calibrate" else cfg.out)
    return 0


def whatif_apply(args: argparse.Namespace) -> int:
    """``ddpscope whatif RUN --apply``: the advisor's report, then, when it recommends a
    change, the run again with it (same script, ranks, steps, emulated nodes), then A
    (the traced run) against B (the rerun): predicted against measured, bucket by bucket."""
    from ddpscope.tracer.launch.rerun import rerun_settings, script_changed
    from ddpscope.tracer.launch.runner import RunConfig
    from ddpscope.tracer.writer import update_run_json
    from ddpscope.viz.trace import TraceError
    from ddpscope.viz.whatif.advisor import setting_text
    from ddpscope.viz.whatif.report import cap_argument, print_ab, whatif_report

    prog = f"{PROG} whatif"
    if args.json:
        print(f"{prog}: error: --apply prints tables: leave out --json", file=sys.stderr)
        return 2
    try:
        _, (trace, advice) = whatif_report(args.path, args.caps, False, args.cap_list)
    except (TraceError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if not advice.change:
        print("--apply: nothing rerun")
        return 0
    out = Path(args.apply_out) if args.apply_out else _beside(Path(args.path))
    try:
        cfg = RunConfig(out=out, **rerun_settings(trace.run), **cap_argument(advice.setting))
    except ValueError as e:
        print(f"{prog}: error: --apply: {e}", file=sys.stderr)
        return 2
    if script_changed(trace.run):
        say("the script's file changed since the traced run: A and B are two versions of it")
    say(f"applying {setting_text(advice.setting)}: the same run again, into {out}")
    code = run_config(cfg, "run", quiet=True)
    if code != 0:
        return code
    update_run_json(out, {"advice": {"from": str(trace.path.resolve()), "predicted_step_ms": advice.step_ms,
                                     "predicted_exposed_ms": advice.exposed_ms, "gain_ms": advice.gain_ms,
                                     "gain_interval_ms": list(advice.interval_ms)}})
    try:
        print_ab(trace, advice, out)
    except (TraceError, ValueError) as e:  # the rerun finished but cannot be compared: say why, keep it
        print(f"{prog}: the rerun in {out} cannot be compared: {e}", file=sys.stderr)
        return 1
    return 0


def _beside(run: Path) -> Path:
    """``RUN-advised`` (``-2``, ``-3``... when taken) beside the run folder."""
    base = run.resolve()
    out, n = base.with_name(f"{base.name}-advised"), 2
    while out.exists():
        out, n = base.with_name(f"{base.name}-advised-{n}"), n + 1
    return out


def dashboard_command(args: argparse.Namespace) -> int:
    """Replace this process with ``streamlit run app.py`` on ``runs_dir``."""
    app = app_path()
    if app is None:
        print(f"{PROG} dashboard: error: cannot find ddpscope's app.py next to the tracer package", file=sys.stderr)
        return 2
    runs = Path(args.runs_dir).resolve()
    if runs.exists() and not runs.is_dir():
        print(f"{PROG} dashboard: error: {runs} is not a folder", file=sys.stderr)
        return 2
    if not 1 <= args.port <= 65535:
        print(f"{PROG} dashboard: error: --port must be in 1..65535, got {args.port}", file=sys.stderr)
        return 2
    env = {**os.environ, "DDPSCOPE_RUNS_DIR": str(runs)}
    if args.allow_commands:
        env["DDPSCOPE_ALLOW_COMMANDS"] = "1"
    cmd = [sys.executable, "-m", "streamlit", "run", str(app), "--server.address", args.host,
           "--server.port", str(args.port), "--browser.gatherUsageStats", "false",
           "--server.maxUploadSize", "200", "--server.showEmailPrompt", "false"]
    print(f"ddpscope dashboard on http://{args.host}:{args.port} (runs in {runs})", file=sys.stderr)
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def app_path() -> Path | None:
    """``app.py``: beside the packages (a source checkout or ``pip install -e``), or in
    ``<prefix>/share/ddpscope`` (``pip install .``)."""
    for candidate in (Path(__file__).resolve().parents[1] / "app.py", Path(sys.prefix) / "share" / "ddpscope" / "app.py"):
        if candidate.is_file():
            return candidate
    return None


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def build_command() -> int:
    from ddpscope.tracer.launch.native import build_native

    result = build_native(lambda line: print(line, file=sys.stderr, flush=True))
    if not result["ok"]:
        return 1
    print(result["library"])
    return 0


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
    from ddpscope.viz.cli import run_viz_command

    return run_viz_command(args, prog=f"{PROG} {args.command}")


if __name__ == "__main__":
    sys.exit(main())
