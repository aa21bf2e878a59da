"""``--steps N``: the job ends cleanly after N traced optimizer steps. The trace is closed
first (complete), then ``SystemExit(0)`` unwinds the script (its ``finally`` blocks run);
a timer ends the process after a grace period should the script swallow it or hang in
its teardown."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable


def end_job(finish: Callable[[], None], grace_s: float) -> None:
    """Close the trace (``finish``), arm the timer, and unwind the script."""
    finish()
    exit_soon(grace_s)
    raise SystemExit(0)  # unwinds the script; its finally blocks still run


def exit_soon(grace_s: float) -> None:
    """End the process after ``grace_s`` even if the script catches ``SystemExit`` or
    hangs in its teardown (the trace is already closed and complete)."""
    def end():
        time.sleep(grace_s)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)

    threading.Thread(target=end, name="ddpscope-exit", daemon=True).start()
