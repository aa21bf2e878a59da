"""One Perfetto file for a whole run: every rank's trace on rank 0's clock.

Each ``rank-<r>.json`` opens in Perfetto on its own, on that rank's clock. ``merge_run``
puts all ranks into one Chrome trace (a process per rank, as written), with every
timestamp mapped onto rank 0's clock by the stored offsets (the same alignment the
dashboard uses), so cross-rank waits line up.
"""

from __future__ import annotations

import json
from pathlib import Path

from tracer.writer import write_bytes_atomic
from viz.trace import TraceError, clock_alignment, read_run_folder, run_kind


def merge_run(path: str | Path) -> dict:
    """The merged Chrome trace (object form) of a run folder of any kind."""
    path = Path(path)
    kind = run_kind(path)
    if kind is None:
        raise TraceError(f"{path} holds no readable ddpscope run (no rank-<r>.json, or bad run.json)")
    run, files, world = read_run_folder(path, kind)
    events = []
    for rank, (meta, rank_events) in files.items():
        align = clock_alignment(meta)
        for e in rank_events:
            e = dict(e)
            if isinstance(e.get("ts"), (int, float)):
                t = float(e["ts"])
                e["ts"] = align(t)
                if isinstance(e.get("dur"), (int, float)):
                    e["dur"] = max(0.0, align(t + float(e["dur"])) - e["ts"])
            events.append(e)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ddpscope_merged": {
        "run": str(path), "kind": kind, "world_size": world, "ranks": sorted(files),
        "clock": "rank 0's host clock (µs); other ranks shifted by their measured offsets",
        "status": run.get("status")}}}


def write_merged(path: str | Path, out: str | Path) -> int:
    """Write ``merge_run(path)`` to ``out`` atomically; its size in bytes. Refuses to
    overwrite an existing file."""
    out = Path(out)
    if out.exists():
        raise TraceError(f"{out} exists; choose a new file name")
    data = json.dumps(merge_run(path), separators=(",", ":")).encode()
    try:
        write_bytes_atomic(out, [data])
    except OSError as e:
        raise TraceError(f"cannot write {out}: {e.strerror or e}") from None
    return len(data)
