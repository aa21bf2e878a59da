"""How a job's ranks talk to the launcher through their output.

- Progress: rank 0 prints ``ddpscope-progress {json}`` lines on its stdout; the launcher
  (which reads every rank's output) takes them out of the stream and hands the records on.
- Messages: what the capture has to tell the user (``say``) is one line on stderr that
  starts with ``ddpscope: ``; the launcher shows those lines apart from the script's own
  output, and the dashboard lists them.

Torch-free: both sides import it.
"""

from __future__ import annotations

import json
import sys

PROGRESS_PREFIX = "ddpscope-progress "
MESSAGE_PREFIX = "ddpscope: "
#: set for ``ddpscope run`` as one node of an emulated run: it hands its progress records
#: on as progress lines (the emulated run's launcher shows them), not as text
PROGRESS_PASSTHROUGH_ENV = "DDPSCOPE_PROGRESS_PASSTHROUGH"


def say(text: str) -> None:
    """One line for the user on stderr (never raises: a closed stream must not take
    training down). Newlines in ``text`` are folded: a message is one line."""
    try:
        print(MESSAGE_PREFIX + " ".join(str(text).split("\n")), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


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
