"""``python -m viz summary PATH [--json]``: per-rank figures of a traced run.

Per rank, medians over non-warm-up steps: step, forward, backward compute, optimizer,
all-reduce busy time, overlapped and exposed communication (ms) and overlap %.
Exit 2 with a one-line message on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def main(argv: list[str] | None = None) -> int:
    p = _Parser(prog="python -m viz", description="Summaries of ddpscope traces.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    s = sub.add_parser("summary", help="per-rank medians over non-warm-up steps")
    s.add_argument("path", help="a run folder (run.json + rank-<r>.json)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)

    from viz.overlap import compute_rank_medians
    from viz.trace import TraceError, load_run

    try:
        trace = load_run(args.path)
    except TraceError as e:
        print(f"python -m viz summary: error: {e}", file=sys.stderr)
        return 2
    med = compute_rank_medians(trace)
    if args.json:
        ranks = {str(int(r["rank"])): {k: (None if isinstance(v, float) and math.isnan(v) else v)
                                       for k, v in r.items() if k != "rank"}
                 for r in med.astype(object).to_dict("records")}
        print(json.dumps({"path": str(trace.path), "status": trace.status, "world_size": trace.world_size,
                          "bucket_cap_mb": trace.run.get("bucket_cap_mb"), "ranks": ranks}, indent=1, default=float))
    else:
        print(f"{trace.path}  status={trace.status}  ranks={trace.world_size}  "
              f"bucket_cap_mb={trace.run.get('bucket_cap_mb')}  (medians over non-warm-up steps, ms)")
        print(med.round(2).to_string(index=False) if len(med) else "no finished non-warm-up steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
