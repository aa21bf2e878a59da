"""The ring trace model: a folder written by ``ddpscope ring``, loaded and aligned.

``load_ring(path)`` returns a ``RingTrace`` with three tables, times in µs on rank 0's
clock (ranks aligned with the stored clock offsets, as for DDP runs):

- ``rounds``: one row per rank and round of the ring: round, repeat (-1: warm-up),
  bytes (the tensor), calibration, warmup, start_us, end_us, max_abs_diff
- ``steps``: one row per rank, round and ring step: step (0 .. 2N-3), phase, phase_step,
  send_chunk, recv_chunk, send_to, recv_from, send_bytes, recv_bytes, start_us, end_us,
  comm_us (send and receive done), reduce_us (adding the received chunk in)
- ``refs``: one row per rank and round of ``dist.all_reduce`` on the same tensor
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from ddpscope.tracer import format as fmt
from ddpscope.viz.run_files import clock_alignment, read_run_folder
from ddpscope.viz.trace import TraceError, frame_of

_STEP_FIELDS = ("step", "phase", "phase_step", "send_chunk", "recv_chunk", "send_to", "recv_from",
                "send_bytes", "recv_bytes")
ROUND_COLUMNS = ["rank", "round", "repeat", "bytes", "calibration", "warmup", "start_us", "end_us", "max_abs_diff"]
STEP_COLUMNS = ["rank", "round", "size_bytes", *_STEP_FIELDS, "start_us", "end_us", "comm_us", "reduce_us"]
REF_COLUMNS = ["rank", "round", "bytes", "calibration", "warmup", "start_us", "end_us"]


@dataclass(frozen=True)
class RingTrace:
    path: Path
    run: dict
    ranks: dict[int, dict]
    rounds: pd.DataFrame
    steps: pd.DataFrame
    refs: pd.DataFrame

    @property
    def world_size(self) -> int:
        return int(self.run.get("world_size") or len(self.ranks))

    @property
    def size_bytes(self) -> int:
        """The requested tensor size (bytes per rank); calibration sizes are smaller."""
        return int(self.run["bytes"])

    def complete_rounds(self) -> list[int]:
        """Rounds that every rank finished and traced (a failed run may end mid-round)."""
        n = self.world_size
        per_round = self.rounds.groupby("round")["rank"].nunique()
        full = 2 * (n - 1) * n  # each of the 2(N-1) steps once on each rank, no more
        s = self.steps
        if len(s):
            valid = s["rank"].between(0, n - 1) & s["step"].between(0, 2 * (n - 1) - 1)
            rows = s.groupby("round").size()
            distinct = s[valid].drop_duplicates(["round", "rank", "step"]).groupby("round").size()
        else:
            rows = distinct = pd.Series(dtype=int)
        return sorted(int(r) for r, k in per_round.items()
                      if k == n and rows.get(r, 0) == full and distinct.get(r, 0) == full)

    def main_rounds(self) -> list[int]:
        """Timed rounds of the requested size (no warm-up, no calibration) that every rank
        finished, in order."""
        r = self.rounds
        keep = r[(r["bytes"] == self.size_bytes) & ~r["warmup"] & ~r["calibration"]]
        return sorted(set(int(x) for x in keep["round"].unique()) & set(self.complete_rounds()))


def load_ring(path: str | Path) -> RingTrace:
    """Load a ring run folder; ``TraceError`` (one line) if it is not one or is malformed."""
    path = Path(path)
    run, files, world = read_run_folder(path, fmt.KIND_RING)
    if "bytes" not in run:
        raise TraceError(f"{path.name}/run.json has no tensor size (the ring job never started?)")
    size = run["bytes"]
    if isinstance(size, bool) or not isinstance(size, (int, float)) or not math.isfinite(size) or size <= 0 \
            or size != int(size):
        raise TraceError(f"{path.name}/run.json: the tensor size (bytes) {str(size)[:40]!r} is not a positive "
                         "whole number")
    rows: dict[str, list] = {"rounds": [], "steps": [], "refs": []}
    for rank, (meta, events) in files.items():
        align = clock_alignment(meta)
        try:
            for e in events:
                if e.get("ph") != "X":
                    continue
                cat, args = e.get("cat"), e.get("args") or {}
                raw, dur = float(e["ts"]), float(e["dur"])
                if not (math.isfinite(raw) and math.isfinite(dur) and dur >= 0):
                    raise ValueError(f"ts {raw}, dur {dur} out of range")
                ts, te = align(raw), align(raw + dur)
                if cat == fmt.CAT_RING:
                    rows["rounds"].append({"rank": rank, "round": int(args["round"]), "repeat": int(args["repeat"]),
                                           "bytes": int(args["bytes"]), "calibration": bool(args["calibration"]),
                                           "warmup": bool(args["warmup"]), "start_us": ts, "end_us": te,
                                           "max_abs_diff": float(args.get("max_abs_diff", "nan"))})
                elif cat == fmt.CAT_RING_STEP:
                    row = {"rank": rank, "round": int(args["round"]), "size_bytes": int(args["size_bytes"])}
                    row.update({k: str(args[k]) if k == "phase" else int(args[k]) for k in _STEP_FIELDS})
                    if not 0 <= min(row["send_chunk"], row["recv_chunk"], row["send_to"], row["recv_from"]) or \
                            max(row["send_chunk"], row["recv_chunk"], row["send_to"], row["recv_from"]) >= world:
                        raise ValueError("a chunk or peer outside the ring")
                    row.update(start_us=ts, end_us=te, comm_us=float(args["comm_us"]),
                               reduce_us=float(args["reduce_us"]))
                    rows["steps"].append(row)
                elif cat == fmt.CAT_RING_REF:
                    rows["refs"].append({"rank": rank, "round": int(args["round"]), "bytes": int(args["bytes"]),
                                         "calibration": bool(args["calibration"]), "warmup": bool(args["warmup"]),
                                         "start_us": ts, "end_us": te})
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
            raise TraceError(f"rank {rank}: malformed ring trace event ({type(e).__name__}: {str(e)[:200]})") from None
    if not rows["rounds"]:
        raise TraceError(f"{path.name} holds no finished ring round")
    steps = frame_of(rows["steps"], ["rank", "round", "step"], STEP_COLUMNS)
    bad = steps[(steps["step"] < 0) | (steps["step"] > 2 * world - 3)]
    if len(bad):
        raise TraceError(f"{path.name}: step {int(bad['step'].iloc[0])} is outside 0..{2 * world - 3} "
                         f"for a ring of {world} ranks")
    return RingTrace(path=path, run=run, ranks={r: m for r, (m, _) in files.items()},
                     rounds=frame_of(rows["rounds"], ["rank", "round"], ROUND_COLUMNS), steps=steps,
                     refs=frame_of(rows["refs"], ["rank", "round"], REF_COLUMNS))
