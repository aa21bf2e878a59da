"""``ddpscope whatif RUN --apply``: the advisor's recommendation run for real, and A
(the traced run) against B (the rerun)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ddpscope.cli.jobs import run_config
from ddpscope.cli.output import PROG, say


def whatif_apply(args: argparse.Namespace) -> int:
    """``ddpscope whatif RUN --apply``: the advisor's report, then, when it recommends a
    change, the run again with it (same script, ranks, steps, emulated nodes), then A
    (the traced run) against B (the rerun): predicted against measured, bucket by bucket."""
    from ddpscope.tracer.format import RUN_FILE
    from ddpscope.tracer.launch.rerun import rerun_settings, script_changed
    from ddpscope.tracer.launch.runner import RunConfig
    from ddpscope.tracer.writer import update_run_json
    from ddpscope.viz.run_files import read_json_file
    from ddpscope.viz.trace import TraceError
    from ddpscope.viz.whatif.advisor import setting_text
    from ddpscope.viz.whatif.report import cap_argument, print_ab, whatif_report

    prog = f"{PROG} whatif"
    if args.json:
        print(f"{prog}: error: --apply prints tables: leave out --json", file=sys.stderr)
        return 2
    try:  # what cannot be rerun is said before the search (seconds), from run.json alone
        early = read_json_file(Path(args.path) / RUN_FILE, "run metadata")
    except (TraceError, OSError):
        early = None  # the report says what is wrong with the folder
    if isinstance(early, dict) and early.get("kind") == "sharded":
        from ddpscope.cli.sharded_whatif import apply_refusal

        sharding = early.get("sharding")
        framework = sharding.get("framework") if isinstance(sharding, dict) else None
        print(f"{prog}: error: {apply_refusal(framework, early)}", file=sys.stderr)
        return 2
    if isinstance(early, dict) and early.get("kind") in (None, "ddp"):
        try:
            rerun_settings(early)
        except ValueError as e:
            print(f"{prog}: error: --apply: {e}", file=sys.stderr)
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
