"""The hang watchdog: a job whose ranks stop moving is named, its stacks saved, and
stopped, long before the total ``--timeout``. Torch-free (the launcher side).

Each traced rank keeps ``RUN/live/rank-<r>.json`` current (``tracer/capture/live.py``):
its step, phase, buckets launched and in flight, and an activity signature that changes
whenever its training thread records anything. When no rank's activity changes for
``hang_timeout_s`` (plus ``first_step_grace_s`` until a first step is done), the watchdog

- names the rank(s) that stopped: a rank whose file is no longer refreshed (the whole
  process stopped: SIGSTOP, or frozen), else the rank(s) furthest behind (e.g. still in
  its forward while the others wait in an all-reduce);
- says what each rank last recorded: step, phase, the bucket in flight and which ranks
  launched it;
- asks every rank for its Python stacks (SIGUSR1: faulthandler writes them to
  ``RUN/logs/stacks-rank-<r>.txt``) and says where a stack could not be had.

Jobs with no live files (nothing traced yet, or a script without DDP) are left to the
total timeout, as are ranks whose tracing stopped (their live file says so: no longer
"running"), and so is the whole job when, at the moment it would be called hung, its live
files' folder cannot be written (a full disk: no rank can say so there).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.tracer.writer import read_records

STALE_S = 5.0  # a live file not rewritten for this long: that process is not running
PHASES = ["between steps", "forward", "after forward", "backward", "waiting for the all-reduces", "after backward",
          "optimizer"]


@dataclass
class Hang:
    stuck: list[int]
    reason: str  # one line
    details: list[str] = field(default_factory=list)  # one line per rank
    stacks: dict[int, str] = field(default_factory=dict)  # rank -> stacks file (relative to the run folder)


def read_positions(out: Path) -> dict[int, dict]:
    """Every rank's live file in the run folder ``out`` (unreadable ones left out)."""
    return read_records(Path(out) / fmt.LIVE_DIR, "rank-*.json", "rank")


class HangWatch:
    """Call ``poll()`` about once a second from the launcher's loop; it returns a
    ``Hang`` once, when the job stopped moving."""

    def __init__(self, out: Path, hang_timeout_s: float, first_step_grace_s: float = 120.0,
                 clock=time.monotonic) -> None:
        self.out = Path(out)
        self.hang_timeout_s = hang_timeout_s
        self.first_step_grace_s = first_step_grace_s
        self.clock = clock
        self._signature = None
        self._since: float | None = None
        self._stepped = False
        self._last_poll = 0.0
        self.fired = False
        self.stood_down = False  # the live files' folder could not be written: not watched

    def poll(self) -> Hang | None:
        now = self.clock()
        if self.fired or self.hang_timeout_s <= 0 or now - self._last_poll < 1.0:
            return None
        self._last_poll = now
        pos = read_positions(self.out)
        running = {r: p for r, p in pos.items() if p.get("status", "running") == "running"}
        if not running:
            self._since = None
            return None
        signature = sorted((r, json.dumps(p.get("activity"))) for r, p in running.items())
        self._stepped = self._stepped or any(int(p.get("steps_done", 0)) > 0 for p in pos.values())
        if signature != self._signature or self._since is None:
            self._signature, self._since = signature, now
            return None
        limit = self.hang_timeout_s + (0 if self._stepped else self.first_step_grace_s)
        if now - self._since < limit:
            return None
        if not _writable(self.out / fmt.LIVE_DIR):  # a full disk: no rank can refresh its file, all may train on
            self.fired = self.stood_down = True  # left to the total timeout from now on
            return None
        self.fired = True
        return diagnose(self.out, pos, now - self._since)


def _writable(folder: Path) -> bool:
    """Whether a byte can be written to ``folder`` now (a full or read-only disk: no)."""
    probe = folder / f".probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0")
            f.flush()
            os.fsync(f.fileno())
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


def _key(p: dict) -> tuple[int, int]:
    phase = p.get("phase", "")
    return int(p.get("step", 0)), PHASES.index(phase) if phase in PHASES else 0


def diagnose(out: Path, pos: dict[int, dict], still_s: float) -> Hang:
    """Which ranks stopped, what each last recorded, and their stacks."""
    now = time.time()
    stale = sorted(r for r, p in pos.items() if now - float(p.get("time_unix", now)) > STALE_S)
    running = {r: p for r, p in pos.items() if p.get("status", "running") == "running"}
    if stale:
        stuck = stale
    else:
        low = min(_key(p) for p in running.values())
        stuck = sorted(r for r, p in running.items() if _key(p) == low)
    details = [describe(r, p, pos, now) for r, p in sorted(pos.items())]
    stacks = request_stacks(out, pos)
    world = len(pos)
    who = ", ".join(map(str, stuck))
    if stale:
        how = "stopped running (no heartbeat: stopped with SIGSTOP, or frozen)"
    elif len(stuck) == world:
        how = "all stopped at the same point"
    else:
        how = "stopped progressing; the others wait for it"
    first = pos[stuck[0]]
    where = f"step {first.get('step')}, {first.get('phase')}"
    stack_note = "; ".join(f"rank {r}: {'stacks in ' + stacks[r] if r in stacks else 'no stack (the process did not run its handler: stopped?)'}"
                           for r in stuck)
    reason = (f"hang: no rank progressed for {still_s:.0f} s; rank{'s' if len(stuck) > 1 else ''} {who} {how} "
              f"(last at {where}); {stack_note}")
    return Hang(stuck=stuck, reason=reason, details=details, stacks=stacks)


def describe(rank: int, p: dict, pos: dict[int, dict], now: float) -> str:
    """One line: what ``rank`` last recorded, and who launched its bucket in flight."""
    text = f"rank {rank}: step {p.get('step')}, {p.get('phase')}"
    flight = p.get("buckets_in_flight") or []
    if flight:
        b = flight[0]
        launched = sorted(r for r, q in pos.items()
                          if q.get("step") == p.get("step") and b in (q.get("buckets_launched") or []))
        text += (f"; bucket {b} in flight, launched by rank{'s' if len(launched) > 1 else ''} "
                 f"{', '.join(map(str, launched))} of {len(pos)}")
    age = now - float(p.get("time_unix", now))
    if age > STALE_S:
        text += f"; no heartbeat for {age:.0f} s"
    return text


def drop_empty_stacks(out: Path, ranks: range | None = None) -> None:
    """Once the job has ended: remove the stack files no rank wrote to (each rank opens
    its own at start, for the watchdog's SIGUSR1; a run that never hung leaves them
    empty). ``ranks``: this node's (None: every file, for a job whose ranks were all here)."""
    for path in (Path(out) / "logs").glob("stacks-rank-*.txt"):
        try:
            rank = int(path.stem.rsplit("-", 1)[1])
            if (ranks is None or rank in ranks) and path.stat().st_size == 0:
                path.unlink()
        except (OSError, ValueError):
            continue


def request_stacks(out: Path, pos: dict[int, dict], wait_s: float = 3.0) -> dict[int, str]:
    """SIGUSR1 to every rank of this host (faulthandler dumps its stacks); the files that got written."""
    sig = getattr(signal, fmt.STACKS_SIGNAL_NAME)
    sizes = {}
    host = socket.gethostname()
    for r, p in pos.items():
        path = Path(out) / fmt.stacks_file(r)
        sizes[r] = path.stat().st_size if path.exists() else 0
        if p.get("host", host) != host:  # another node's rank (a shared folder): its pid means nothing here
            continue
        try:
            os.kill(int(p["pid"]), sig)
        except (ProcessLookupError, PermissionError, KeyError, ValueError, TypeError):
            continue
    deadline = time.monotonic() + wait_s
    got: dict[int, str] = {}
    while time.monotonic() < deadline and len(got) < len(pos):
        for r in pos:
            path = Path(out) / fmt.stacks_file(r)
            if r not in got and path.exists() and path.stat().st_size > sizes[r]:
                got[r] = fmt.stacks_file(r)
        time.sleep(0.2)
    return got
