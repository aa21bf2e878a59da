"""What a job shows on the terminal while it runs: which ranks' lines reach it
(``OutputFilter``), ddpscope's own lines (``say``), and a line per progress record of
each command (``run``, ``ring``, ``zero``, ``calibrate``)."""

from __future__ import annotations

import sys

from ddpscope.tracer.progress import MESSAGE_PREFIX

PROG = "ddpscope"


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
