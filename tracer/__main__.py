"""ddpscope tracer command line: ``python -m tracer run|ring|zero ...``.

Exit codes: 0 success, 1 the job failed (one-line reason and the failing rank's stderr
tail on stderr), 2 bad arguments (one line, nothing written).
"""

from __future__ import annotations

import argparse
import signal
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2 (argparse prints the usage too)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tracer", description="Trace real DistributedDataParallel runs.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="launch the demo job under torchrun and trace it",
                       description="Launch the bundled demo training job through torchrun and trace every rank.")
    r.add_argument("--nproc", type=int, default=2, help="processes (ranks) on this node (default 2)")
    r.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP bucket_cap_mb, in MiB (default 25)")
    r.add_argument("--model", default="mlp", help="demo model: mlp or gpt (default mlp)")
    r.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    r.add_argument("--out", required=True, help="new or empty folder for the trace")
    r.add_argument("--timeout", type=float, default=900.0, dest="timeout_s",
                   help="watchdog: stop the job after this many seconds (default 900)")
    r.add_argument("--gradient-as-bucket-view", action="store_true", help="DDP gradient_as_bucket_view=True")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--nnodes", type=int, default=1, help="torchrun --nnodes (multi-node)")
    r.add_argument("--node-rank", type=int, default=0, help="torchrun --node-rank")
    r.add_argument("--rdzv-endpoint", default=None, help="torchrun --rdzv-endpoint HOST:PORT (node 0 hosts it)")
    r.add_argument("-v", "--verbose", action="store_true", help="also show the workers' own output")

    g = sub.add_parser("ring", help="run a traced ring all-reduce beside dist.all_reduce",
                       description="Run a ring all-reduce built from send/recv on N local ranks, step by step "
                                   "traced, and PyTorch's dist.all_reduce on the same tensor for comparison.")
    g.add_argument("--nproc", type=int, default=4, help="ranks in the ring (default 4)")
    g.add_argument("--mb", type=float, default=4.0, help="tensor size per rank, in MiB (default 4)")
    g.add_argument("--repeat", type=int, default=5, help="timed rounds after one warm-up (default 5)")
    g.add_argument("--dtype", default="float32", help="float32, float64, bfloat16, float16, int64 or int32")
    g.add_argument("--no-calibration", action="store_false", dest="calibration",
                   help="skip the two small sizes used to fit latency and bandwidth")
    g.add_argument("--out", required=True, help="new or empty folder for the trace")
    g.add_argument("--timeout", type=float, default=600.0, dest="timeout_s",
                   help="watchdog: stop the job after this many seconds (default 600)")
    g.add_argument("-v", "--verbose", action="store_true", help="also show the workers' own output")

    z = sub.add_parser("zero", help="measure memory and communication per ZeRO stage",
                       description="Train the demo model a few steps under each ZeRO stage (0: DDP + Adam, "
                                   "1: ZeroRedundancyOptimizer, 2: FSDP without resharding after forward, "
                                   "3: FSDP full sharding) and measure what each rank holds and sends.")
    z.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    z.add_argument("--model", default="mlp", help="demo model: mlp or gpt (default mlp)")
    z.add_argument("--steps", type=int, default=3, help="steps per stage; the last is measured (default 3)")
    z.add_argument("--stages", default="0,1,2,3", help="comma-separated stages (default 0,1,2,3)")
    z.add_argument("--out", required=True, help="new or empty folder for the results")
    z.add_argument("--timeout", type=float, default=600.0, dest="timeout_s",
                   help="watchdog: stop the job after this many seconds (default 600)")
    z.add_argument("-v", "--verbose", action="store_true", help="also show the workers' own output")
    return p


def run_progress(rec: dict, cfg) -> str | None:
    """The line to print for a progress record of ``python -m tracer run`` (None: nothing)."""
    if rec.get("event") == "start":
        return (f"running {rec['model']} ({rec['params'] / 1e6:.1f} M params) on {rec['world_size']} ranks, "
                f"{rec['steps']} steps, bucket_cap_mb={cfg.bucket_cap_mb:g}")
    if rec.get("event") == "step":
        return f"step {rec['step']}/{rec['steps']}  loss {rec['loss']:.4f}  {rec['ms']:.0f} ms"
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


def launch_command(args: argparse.Namespace) -> int:
    """parse (config) -> run (the job, through its runner) -> report, for any subcommand."""
    from tracer.launch import runner

    config_cls, run, describe = {
        "run": (runner.RunConfig, runner.run_job, run_progress),
        "ring": (runner.RingConfig, runner.run_ring, ring_progress),
        "zero": (runner.ZeroConfig, runner.run_zero, zero_progress),
    }[args.command]
    prog = f"python -m tracer {args.command}"
    try:
        cfg = config_cls(**{k: v for k, v in vars(args).items() if k not in ("command", "verbose")})
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2

    def progress(rec: dict) -> None:
        line = describe(rec, cfg)
        if line:
            print(line, file=sys.stderr)

    def output(rank, line) -> None:
        if args.verbose:
            print(f"[rank {rank}] {line}" if rank is not None else line, file=sys.stderr)

    # SIGTERM (a scheduler, `kill`) ends the job like Ctrl-C does: stopped and reaped.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        result = run(cfg, progress, output)
    except ValueError as e:  # the run folder could not be made: nothing was launched
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if not result.ok:
        print(f"{prog}: run failed: {result.reason}", file=sys.stderr)
        if result.stderr_tail:
            print(f"--- rank {result.failed_rank} stderr (last lines) ---\n{result.stderr_tail}", file=sys.stderr)
        print(f"partial trace kept in {cfg.out} (run.json says failed)", file=sys.stderr)
        return 130 if result.interrupted else 1
    print(cfg.out)
    return 0


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    return launch_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
