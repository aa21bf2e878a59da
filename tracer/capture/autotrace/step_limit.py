"""``--steps N``: the job ends cleanly after N traced optimizer steps. The trace is closed
first (complete), then ``SystemExit(0)`` unwinds the script (its ``finally`` blocks run).

A script may catch that ``SystemExit`` (a training loop's ``except BaseException``, a
framework's wrapper) and train on. The limit holds all the same: the next optimizer step
says so once and raises it again, and a timer ends the process after a grace period should
the script swallow it every time or hang in its teardown (said once too)."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

from ddpscope.tracer.progress import say


def end_job(finish: Callable[[], None], grace_s: float, steps: int, note: Callable[[str], None],
            rank: int) -> None:
    """Close the trace (``finish``), arm the limit's second and third lines (a step after
    it, the timer), and unwind the script."""
    finish()
    exit_soon(grace_s, steps, rank)
    _raise_on_later_steps(steps, grace_s, note)
    raise SystemExit(0)  # unwinds the script; its finally blocks still run


def _raise_on_later_steps(steps: int, grace_s: float, note: Callable[[str], None]) -> None:
    """Every optimizer step after the limit raises ``SystemExit(0)`` again: the script
    caught the first one and trained on. Said once (``note``: stderr and run.json)."""
    import torch.optim.optimizer as optim

    said: list[bool] = []

    def after_limit(optimizer, args, kwargs) -> None:
        if not said:
            said.append(True)
            note(f"the script caught the SystemExit that ends the job after --steps {steps} and trained on; "
                 f"the trace holds the {steps} steps; ddpscope raises it again at each step and ends the "
                 f"process {grace_s:g} s after the limit if the script still runs")
        raise SystemExit(0)

    optim.register_optimizer_step_post_hook(after_limit)


def exit_soon(grace_s: float, steps: int | None = None, rank: int = 0) -> None:
    """End the process after ``grace_s`` even if the script catches ``SystemExit`` or
    hangs in its teardown (the trace is already closed and complete); rank 0 says so."""
    def end():
        time.sleep(grace_s)
        if rank == 0:
            limit = f"--steps {steps}" if steps is not None else "the step limit"
            say(f"the script still ran {grace_s:g} s after {limit} (it caught SystemExit, or its teardown hung): "
                "its processes are ended; the trace was complete")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(0)

    threading.Thread(target=end, name="ddpscope-exit", daemon=True).start()
