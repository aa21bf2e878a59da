"""Progress lines: how a job's rank 0 tells the launcher how far it is.

Rank 0 prints ``ddpscope-progress {json}`` lines on its stdout; the launcher (which
reads every rank's output) takes them out of the stream and hands the records on.
Torch-free: both sides import it.
"""

from __future__ import annotations

import json
import sys

PROGRESS_PREFIX = "ddpscope-progress "


def emit_progress(**fields) -> None:
    """One progress line for the launcher (rank 0 prints them). Never raises: a closed
    stdout must not take training down."""
    try:
        print(PROGRESS_PREFIX + json.dumps(fields), file=sys.stdout, flush=True)
    except (OSError, ValueError):
        pass


def parse_progress(line: str) -> dict | None:
    """The progress record in a line of output, or None."""
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        rec = json.loads(line[len(PROGRESS_PREFIX):])
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None
