"""One Perfetto file for a whole run: every rank's trace on rank 0's clock.

Each ``rank-<r>.json`` opens in Perfetto on its own, on that rank's clock. ``merge_run``
puts all ranks into one Chrome trace (a process per rank, as written), with every
timestamp mapped onto rank 0's clock by the stored offsets (the same alignment the
dashboard uses), so cross-rank waits line up.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from ddpscope.tracer.writer import write_bytes_atomic
from ddpscope.viz.run_files import clock_alignment, read_run_folder
from ddpscope.viz.sources import KINETO, readable_kind
from ddpscope.viz.sources.kineto import load_kineto
from ddpscope.viz.sources.kineto_file import read_bytes
from ddpscope.viz.trace import TraceError


def merge_run(path: str | Path) -> dict:
    """The merged Chrome trace (object form) of a run folder of any kind."""
    path = Path(path)
    kind = readable_kind(path)
    if kind == KINETO:
        return merge_kineto(path)
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


def merge_kineto(path: str | Path) -> dict:
    """Every rank's profiler trace in one Chrome trace, on the lowest rank's clock (the
    shifts ``load_kineto`` found). Process ids are renumbered per rank (every rank has a
    "GPU 0") and named ``rank r · ...``; flow ids are made unique per rank."""
    trace = load_kineto(path)
    events: list = []
    pids: dict[tuple[int, object], int] = {}
    for rank, meta in trace.ranks.items():
        f = Path(path) / meta["file"]
        try:
            data = msgspec.json.decode(read_bytes(f))
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as e:
            raise TraceError(f"{f.name} is not valid JSON: {e}") from None
        shift = float(meta["offset_us"])
        for e in data.get("traceEvents") or [] if isinstance(data, dict) else []:
            if not isinstance(e, dict):
                continue
            pid = e.get("pid")  # a number or a name ("GPU 0"); anything else is named by its text
            e["pid"] = pids.setdefault((rank, pid if isinstance(pid, (int, str)) else json.dumps(pid)), len(pids))
            if isinstance(e.get("ts"), (int, float)):
                e["ts"] = float(e["ts"]) + shift
            if "id" in e and e.get("ph") in ("s", "t", "f"):
                e["id"] = f"{rank}:{e['id']}"
            if e.get("ph") == "M" and e.get("name") == "process_name" and isinstance(e.get("args"), dict):
                e["args"] = {**e["args"], "name": f"rank {rank} · {e['args'].get('name', '')}"}
            events.append(e)
        for (r, pid), new in pids.items():
            if r == rank and not isinstance(pid, int):
                events.append({"ph": "M", "name": "process_name", "pid": new, "args": {"name": f"rank {r} · {pid}"}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ddpscope_merged": {
        "run": str(path), "kind": KINETO, "world_size": trace.world_size, "ranks": sorted(trace.ranks),
        "clock": trace.run["clock"]["note"], "status": "complete"}}}
