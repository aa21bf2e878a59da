"""A rank's steps in one row each: the summary a viewer of many ranks reads instead of
every event.

``summarize_steps(events)`` folds the trace events of whole steps into one row per
step: the step, pass and optimizer spans a viewer tables (``viz.trace``'s ``steps``),
the memory measured, and what the step's bucket all-reduces did, already reduced:
how many, their bytes, the first launch, the last completion, the union of their
intervals (communication time) and the part of it inside backward compute.

It is the one definition of those rows: the tracer's writer runs it on the training
node for every step it writes (``rank-<r>.summary.jsonl``, beside the events), and a
viewer that parses a rank's events runs it on them, so a row read from a summary and
one folded from the events are the same row. Light on purpose (no torch, no numpy):
it runs between training steps, ~10 events a step that are not gradient marks.

Times are µs on the rank's own clock (readers align them as they align events:
``TIME_FIELDS``), and so are the lengths of time (``DURATION_FIELDS``, which readers
scale by the clock's drift).
"""

from __future__ import annotations

from typing import Iterable

from ddpscope.tracer import format as fmt

_PHASES = {fmt.CAT_FORWARD: "forward", fmt.CAT_BACKWARD: "backward", fmt.CAT_GRAD_SYNC: "sync"}
#: the collectives outside the buckets that have fields of their own; any other is "other_comm"
_OWN_KINDS = {fmt.UNUSED_MAP: "ddp_own", fmt.BUFFER_BROADCAST: "buffer_sync"}
#: the absolute times of a row (µs on the rank's clock): what a reader aligns to rank 0's
TIME_FIELDS = ("start_us", "end_us", "forward_start_us", "forward_end_us", "backward_start_us", "backward_end_us",
               "sync_start_us", "sync_end_us", "optimizer_start_us", "optimizer_end_us", "param_sync_start_us",
               "param_sync_end_us", "ddp_own_start_us", "ddp_own_end_us", "buffer_sync_start_us", "buffer_sync_end_us",
               "other_comm_start_us", "other_comm_end_us", "first_launch_us", "last_done_us", "compute_end_us")
#: the lengths of time of a row (µs)
DURATION_FIELDS = ("forward_us", "backward_us", "comm_us", "overlapped_us")
#: the communication fields of a row (see ``summarize_steps``)
COMM_FIELDS = ("num_buckets", "bucket_bytes", "first_launch_us", "last_done_us", "comm_us", "overlapped_us")


def summarize_steps(events: Iterable) -> list[dict]:
    """One row per step of ``events`` (the complete events of whole steps, as the
    tracer writes them; anything else, such as gradient marks, is skipped), sorted by
    step. A row: step, warmup, incomplete, grad_marks (False: a step traced without a
    gradient-ready mark per parameter, ``--grad-marks-every``), start_us, end_us, micro_batches, forward_us
    and backward_us (compute summed over the step's passes: a backward to its last gradient,
    ``compute_us``, where the trace says it), the syncing pass's (the one
    whose backward launched the all-reduces; the last pass if none synced)
    forward/backward/sync start and end, optimizer start and end, ZeRO-1's param_sync
    start, end, bytes and own_bytes, DDP's own collectives that are not buckets (the
    unused-parameter map's all-reduce: ddp_own_start_us, ddp_own_end_us from the first start
    to the last end, ddp_own_bytes summed; DDP's buffer broadcasts before its forwards apart,
    as buffer_sync_start_us, buffer_sync_end_us, buffer_sync_bytes; the other collectives DDP or the script
    issued in the step, outside the buckets, as other_comm_start_us, other_comm_end_us, other_comm_bytes and
    other_comm_count), ``memory`` (byte counts by name) when measured, and
    ``COMM_FIELDS``: num_buckets, bucket_bytes, first_launch_us, last_done_us, comm_us
    (the union of the all-reduce intervals) and overlapped_us (the part of it inside
    backward compute, every pass's), compute_end_us (the syncing pass's backward compute
    end: its last gradient ready, when the trace says it, ``compute_us`` on the backward
    span; else the span's end). Backward compute ends at the pass's last gradient: what
    follows within the span is autograd finishing, where DDP's finalize can wait for a
    late rank's all-reduce; counting that as compute made one rank's all-reduce
    "overlapped" and the other's exposed in the same step. Raises ``KeyError`` / ``TypeError`` /
    ``ValueError`` on an event that is not one of ours."""
    steps: dict[int, dict] = {}
    passes: dict[int, dict[int, dict]] = {}
    seen: dict[tuple[int, str], int] = {}  # (step, phase) -> spans so far (traces without "micro")
    comm: dict[int, list[tuple[float, float, int]]] = {}
    for e in events:
        if type(e) is not dict or e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat not in _FOLDED:
            continue
        args = e["args"]
        step = int(args["step"])
        ts = float(e["ts"])
        te = ts + float(e.get("dur", 0.0))
        if cat == fmt.CAT_ALLREDUCE:
            comm.setdefault(step, []).append((ts, te, int(args["bytes"])))
        elif cat == fmt.CAT_STEP:
            row = steps.setdefault(step, {"step": step})
            row.update(start_us=ts, end_us=te, warmup=bool(args.get("warmup", False)),
                       incomplete=bool(args.get("incomplete", False)), grad_marks=bool(args.get("grad_marks", True)))
            if isinstance(args.get("memory"), dict):
                row["memory"] = args["memory"]
        elif cat in _PHASES:
            key = _PHASES[cat]
            n = seen[(step, key)] = seen.get((step, key), -1) + 1
            micro = int(args.get("micro", n))
            p = passes.setdefault(step, {}).setdefault(micro, {"synced": True})  # DDP reduced its gradients
            if "sync" in args:
                p["synced"] = bool(args["sync"])
            p[key] = (ts, te)
            if key == "backward" and "compute_us" in args:  # its compute ends at its last gradient
                p["compute"] = (ts, min(te, ts + float(args["compute_us"])))
        elif cat == fmt.CAT_OPTIMIZER:
            steps.setdefault(step, {"step": step}).update(optimizer_start_us=ts, optimizer_end_us=te)
        elif cat == fmt.CAT_DDP_OWN:  # never a bucket: apart from COMM_FIELDS
            row = steps.setdefault(step, {"step": step})
            kind = _OWN_KINDS.get(e.get("name"), "other_comm")
            row[f"{kind}_start_us"] = min(ts, row.get(f"{kind}_start_us", ts))
            row[f"{kind}_end_us"] = max(te, row.get(f"{kind}_end_us", te))
            row[f"{kind}_bytes"] = row.get(f"{kind}_bytes", 0) + int(args["bytes"])
            if kind == "other_comm":
                row["other_comm_count"] = row.get("other_comm_count", 0) + 1
        else:  # fmt.CAT_PARAM_SYNC: ZeRO-1's parameters broadcast after the update
            steps.setdefault(step, {"step": step}).update(
                param_sync_start_us=ts, param_sync_end_us=te, param_sync_bytes=int(args["bytes"]),
                param_sync_own_bytes=int(args.get("own_bytes", 0)))
    for step, row in steps.items():
        if "start_us" not in row:
            raise ValueError(f"step {step} has events but no step span")
        mine = [p for _, p in sorted(passes.get(step, {}).items())]
        row["micro_batches"] = len(mine)
        row["forward_us"] = sum(p["forward"][1] - p["forward"][0] for p in mine if "forward" in p)
        # compute only: a backward span runs on past its last gradient while DDP's finalize
        # waits for the all-reduces, which the row counts as exposed communication
        row["backward_us"] = sum(c[1] - c[0] for c in (p.get("compute", p.get("backward")) for p in mine) if c)
        syncing = [p for p in mine if p["synced"]] or mine
        if syncing:
            for key in ("forward", "backward", "sync"):
                if key in syncing[-1]:
                    row[f"{key}_start_us"], row[f"{key}_end_us"] = syncing[-1][key]
        if syncing and "backward" in syncing[-1]:
            row["compute_end_us"] = syncing[-1].get("compute", syncing[-1]["backward"])[1]
        row.update(comm_fields(comm.get(step, []), [p.get("compute", p["backward"]) for p in mine if "backward" in p]))
    return [steps[s] for s in sorted(steps)]


_FOLDED = {fmt.CAT_STEP, fmt.CAT_OPTIMIZER, fmt.CAT_PARAM_SYNC, fmt.CAT_DDP_OWN, fmt.CAT_ALLREDUCE, *_PHASES}


def comm_fields(allreduces: list[tuple[float, float, int]], backwards: list[tuple[float, float]]) -> dict:
    """A step's all-reduces ``(launch, done, bytes)`` reduced against its backward
    passes ``(start, end)`` (see ``COMM_FIELDS``)."""
    out = {"num_buckets": len(allreduces), "bucket_bytes": sum(b for _, _, b in allreduces)}
    if not allreduces:
        return {**out, "comm_us": 0.0, "overlapped_us": 0.0}
    merged = union([(a, b) for a, b, _ in allreduces])
    compute = union(backwards)
    overlapped = 0.0
    for lo, hi in compute:
        for a, b in merged:
            overlapped += max(0.0, min(b, hi) - max(a, lo))
    return {**out, "first_launch_us": min(a for a, _, _ in allreduces),
            "last_done_us": max(b for _, b, _ in allreduces),
            "comm_us": sum(b - a for a, b in merged), "overlapped_us": overlapped}


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same time as ``intervals``."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]
