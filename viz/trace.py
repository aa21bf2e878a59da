"""The trace model: a run folder written by the tracer, loaded and aligned.

``load_run(path)`` reads ``run.json`` and every ``rank-<r>.json``, checks them, maps
every rank's timestamps onto rank 0's clock with the stored offsets, and returns
tables (pandas DataFrames). Times are µs on rank 0's clock (``*_us`` columns).
Bad input raises ``TraceError`` with a one-line message; nothing half-built is returned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ddpscope.tracer import format as fmt
from ddpscope.viz.run_files import MAX_INDEX, TraceError, read_run_folder

__all__ = ["RunTrace", "TraceError", "load_run", "run_status", "clock_alignment", "frame_of"]

@dataclass(frozen=True)
class RunTrace:
    """One run. DataFrames:

    - ``passes``: one row per forward and its backward in a step (a micro-batch under
      gradient accumulation): rank, step, micro, sync (DDP reduced this pass's
      gradients: it ran outside ``no_sync()``), forward_start_us, forward_end_us,
      backward_start_us, backward_end_us, sync_start_us, sync_end_us
    - ``steps``: rank, step, warmup, incomplete, start_us, end_us, micro_batches,
      forward_us and backward_us (compute summed over the step's passes), and the
      *syncing* pass's (the one whose backward launched the all-reduces; the last pass
      if none synced) forward_start_us, forward_end_us, backward_start_us,
      backward_end_us (backward compute), sync_start_us, sync_end_us (waiting for
      DDP's all-reduces after backward compute until every averaged gradient is
      written); optimizer_start_us, optimizer_end_us; under ZeroRedundancyOptimizer
      (ZeRO-1) its parameter broadcasts inside the optimizer step: param_sync_start_us,
      param_sync_end_us, param_sync_bytes (every rank's partition), param_sync_own_bytes
      (this rank's, which it sends); NaN otherwise
    - ``buckets``: rank, step, bucket, bytes, num_params, params (names), launch_us,
      done_us, incomplete
    - ``grads``: rank, step, micro, param, name, ready_us
    - ``memory``: rank, step and the byte counts the tracer measured
    """

    path: Path
    run: dict
    ranks: dict[int, dict]
    steps: pd.DataFrame
    buckets: pd.DataFrame
    grads: pd.DataFrame
    memory: pd.DataFrame
    passes: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: GPU (or, in a CPU-only profile, CPU) events of a profiler trace: rank, step, stream,
    #: name, kind (compute / comm / memory / other), start_us, end_us, launch_us,
    #: collective, bytes, dtype, group_size (see ``viz.sources.kineto``); empty for ours
    kernels: pd.DataFrame = field(default_factory=pd.DataFrame)
    #: where the trace came from: "ddpscope" (the tracer) or "kineto" (torch.profiler)
    source: str = "ddpscope"
    #: a sharded (FSDP2) run's units, per-unit compute, collectives and memory samples
    #: (``viz.sharded_trace.ShardedTables``); None for DDP and profiler traces
    shards: object | None = None
    #: derived tables that figures reuse across selections (filled by viz functions)
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return int(self.run.get("world_size") or len(self.ranks))

    @property
    def status(self) -> str:
        """What the files say of the run: ``complete`` only when run.json and every rank's
        own file say so; ``failed``; ``incomplete`` (see ``unfinished``); or run.json's."""
        return run_status(self)[0]

    @property
    def unfinished(self) -> str | None:
        """Why the run is failed or incomplete, one line; None if it is complete."""
        return run_status(self)[1]


def run_status(trace: RunTrace) -> tuple[str, str | None]:
    """``(status, reason)`` from run.json and the ranks' own metadata. Each rank file's
    metadata says ``status: running`` until its rank closes it: one still ``running``
    when read was never finished (the run is going on, or was
    stopped, or its trace could not be written: a full disk, a removed folder)."""
    said = str(trace.run.get("status", "unknown"))
    if said == fmt.FAILED:
        return said, str(trace.run.get("error") or "the run failed")
    if trace.source != "ddpscope":
        return said, None
    by = {s: sorted(r for r, m in trace.ranks.items() if m.get("status") == s) for s in (fmt.FAILED, fmt.RUNNING)}
    if by[fmt.FAILED]:
        r = by[fmt.FAILED][0]
        return fmt.FAILED, f"rank {r} failed: {trace.ranks[r].get('error') or 'no reason recorded'}"
    if by[fmt.RUNNING]:
        where = ", ".join(f"rank {r} after step {int(trace.ranks[r].get('steps') or 0)}" for r in by[fmt.RUNNING])
        return fmt.INCOMPLETE, (f"the trace was not finished ({where}): the run is still going, was stopped, "
                                "or its trace could not be written")
    missing = sorted(set(range(trace.world_size)) - set(trace.ranks))
    if missing:
        return fmt.INCOMPLETE, f"rank file(s) of rank {', '.join(map(str, missing))} are missing"
    if said == fmt.RUNNING:
        return fmt.INCOMPLETE, "run.json was not finished: the run is still going, or its launcher was stopped"
    if said == fmt.INCOMPLETE:
        return said, str(trace.run.get("error") or "the launcher found the trace unfinished")
    return said, None


def clock_alignment(meta: dict):
    """t (this rank's µs) -> t on rank 0's clock, interpolating start/end estimates."""
    co = meta.get("clock_offset") or {}
    start, end = co.get("start"), co.get("end")
    if not start:
        return lambda t: t
    if not end or end["at_us"] == start["at_us"]:
        return lambda t: t + start["offset_us"]
    slope = (end["offset_us"] - start["offset_us"]) / (end["at_us"] - start["at_us"])
    return lambda t: t + start["offset_us"] + slope * (t - start["at_us"])


def load_run(path: str | Path, *, allow_missing_ranks: bool = False) -> RunTrace:
    """Load a training run folder (``run.json`` + ``rank-*.json``): DDP, or sharded
    (FSDP2: the same step tables, and its own in ``shards``)."""
    path = Path(path)
    run, files, _ = read_run_folder(path, (fmt.KIND_DDP, fmt.KIND_SHARDED), allow_missing_ranks=allow_missing_ranks)
    ranks: dict[int, dict] = {}
    rows: dict[str, list] = {"steps": [], "passes": [], "buckets": [], "grads": [], "memory": []}
    for rank, (meta, events) in files.items():
        ranks[rank] = meta
        _parse_events(rank, meta, events, rows)
    shards = None
    if run.get("kind") == fmt.KIND_SHARDED:
        from ddpscope.viz.sharded_trace import parse_sharded

        try:
            shards = parse_sharded(run, files, clock_alignment)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"{path.name}: malformed sharded trace ({type(e).__name__}: {str(e)[:200]})") from None
    return RunTrace(
        path=path, run=run, ranks=ranks, shards=shards,
        steps=frame_of(rows["steps"], ["rank", "step"], STEP_COLUMNS),
        buckets=frame_of(rows["buckets"], ["rank", "step", "bucket"], BUCKET_COLUMNS),
        grads=frame_of(rows["grads"], ["rank", "step", "ready_us"], GRAD_COLUMNS),
        memory=frame_of(rows["memory"], ["rank", "step"], ["rank", "step"]),
        passes=frame_of(rows["passes"], ["rank", "step", "micro"], PASS_COLUMNS),
    )


# Every table has its columns whatever the trace held (a trace without backward spans
# has NaN backward times, not a table without the column); see ``RunTrace``.
_SPAN_COLUMNS = [f"{phase}_{end}_us" for phase in ("forward", "backward", "sync") for end in ("start", "end")]
STEP_COLUMNS = ["rank", "step", "warmup", "incomplete", "start_us", "end_us", "micro_batches", "forward_us",
                "backward_us", *_SPAN_COLUMNS, "optimizer_start_us", "optimizer_end_us", "param_sync_start_us",
                "param_sync_end_us", "param_sync_bytes", "param_sync_own_bytes"]
PASS_COLUMNS = ["rank", "step", "micro", "sync", *_SPAN_COLUMNS]
BUCKET_COLUMNS = ["rank", "step", "bucket", "bytes", "num_params", "params", "launch_us", "done_us", "incomplete"]
GRAD_COLUMNS = ["rank", "step", "micro", "param", "name", "ready_us"]
_INT_COLUMNS = {"rank", "step", "micro", "bucket", "bytes", "num_params", "param", "micro_batches"}
_BOOL_COLUMNS = {"warmup", "incomplete", "sync"}


def frame_of(rows: list[dict], order: list[str], columns: list[str] | None = None) -> pd.DataFrame:
    """The rows as a table sorted by ``order``, with at least ``columns`` (NaN where a row
    has none; an empty table keeps them too, typed)."""
    columns = columns or []
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype="int64" if c in _INT_COLUMNS else "bool" if c in _BOOL_COLUMNS
                                          else "object" if c in ("params", "name") else "float64") for c in columns})
    df = pd.DataFrame(rows)
    for c in columns:
        if c not in df:
            df[c] = float("nan")
    return df.sort_values(order, kind="stable").reset_index(drop=True)


_PHASES = {fmt.CAT_FORWARD: "forward", fmt.CAT_BACKWARD: "backward", fmt.CAT_GRAD_SYNC: "sync"}


def _byte_counts(memory: dict) -> dict:
    """A step's memory record: names -> finite byte counts (anything else is malformed)."""
    for k, v in memory.items():
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 2**62):
            raise ValueError(f"memory[{k!r}] is not a byte count")
    return memory
_STEP_PHASES = ("forward", "backward", "sync")


def _parse_events(rank: int, meta: dict, events: list, rows: dict[str, list]) -> None:
    align = clock_alignment(meta)
    steps: dict[int, dict] = {}
    passes: dict[tuple[int, int], dict] = {}
    seen: dict[tuple[int, str], int] = {}  # (step, phase) -> spans so far (traces without "micro")
    names = meta.get("param_names") or []
    try:
        for e in events:
            ph, cat = e.get("ph"), e.get("cat")
            if ph not in ("X", "i"):
                continue
            args = e.get("args") or {}
            step = int(args["step"])
            raw, dur = float(e["ts"]), float(e.get("dur", 0.0))
            if not (0 <= step < MAX_INDEX and math.isfinite(raw) and math.isfinite(dur) and dur >= 0):
                raise ValueError(f"step {step}, ts {raw}, dur {dur} out of range")
            ts, te = align(raw), align(raw + dur)  # both ends: drift applies
            if cat == fmt.CAT_STEP:
                row = steps.setdefault(step, {"rank": rank, "step": step})
                row.update(start_us=ts, end_us=te, warmup=bool(args.get("warmup", False)),
                           incomplete=bool(args.get("incomplete", False)))
                if isinstance(args.get("memory"), dict):
                    rows["memory"].append({"rank": rank, "step": step, **_byte_counts(args["memory"])})
            elif cat in _PHASES:
                key = _PHASES[cat]
                n = seen[(step, key)] = seen.get((step, key), -1) + 1
                micro = int(args.get("micro", n))
                p = passes.setdefault((step, micro), {"rank": rank, "step": step, "micro": micro, "sync": True})
                if "sync" in args:
                    p["sync"] = bool(args["sync"])
                p[f"{key}_start_us"], p[f"{key}_end_us"] = ts, te
            elif cat == fmt.CAT_OPTIMIZER:
                row = steps.setdefault(step, {"rank": rank, "step": step})
                row["optimizer_start_us"], row["optimizer_end_us"] = ts, te
            elif cat == fmt.CAT_PARAM_SYNC:  # ZeRO-1: the parameters broadcast after the update
                row = steps.setdefault(step, {"rank": rank, "step": step})
                row.update(param_sync_start_us=ts, param_sync_end_us=te, param_sync_bytes=int(args["bytes"]),
                           param_sync_own_bytes=int(args.get("own_bytes", 0)))
            elif cat == fmt.CAT_GRAD:
                p = int(args["param"])
                if not 0 <= p < (len(names) if names else MAX_INDEX):
                    raise ValueError(f"parameter index {p} is not one of the {len(names)} parameters")
                rows["grads"].append({"rank": rank, "step": step, "micro": int(args.get("micro", 0)), "param": p,
                                      "name": names[p] if names else str(e.get("name")), "ready_us": ts})
            elif cat == fmt.CAT_ALLREDUCE:
                params = list(args.get("params") or [])
                if not all(isinstance(x, str) for x in params) or not 0 <= int(args["bucket"]) < MAX_INDEX:
                    raise ValueError(f"bucket {args.get('bucket')!r} with parameters that are not names")
                rows["buckets"].append({"rank": rank, "step": step, "bucket": int(args["bucket"]),
                                        "bytes": int(args["bytes"]), "num_params": len(params), "params": params,
                                        "launch_us": ts, "done_us": te,
                                        "incomplete": bool(args.get("incomplete", False))})
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise TraceError(f"rank {rank}: malformed trace event ({type(e).__name__}: {str(e)[:200]})") from None
    by_step: dict[int, list[dict]] = {}
    for (step, _), p in sorted(passes.items()):
        by_step.setdefault(step, []).append(p)
        rows["passes"].append(p)
    for row in steps.values():
        if "start_us" not in row:
            raise TraceError(f"rank {rank}: step {row['step']} has events but no step span")
        mine = by_step.get(row["step"], [])
        row["micro_batches"] = len(mine)
        row["forward_us"] = sum(p["forward_end_us"] - p["forward_start_us"] for p in mine if "forward_start_us" in p)
        row["backward_us"] = sum(p["backward_end_us"] - p["backward_start_us"] for p in mine
                                 if "backward_start_us" in p)
        syncing = [p for p in mine if p["sync"]] or mine
        if syncing:  # the pass whose backward launched the all-reduces
            for key in _STEP_PHASES:
                for end in ("start_us", "end_us"):
                    if f"{key}_{end}" in syncing[-1]:
                        row[f"{key}_{end}"] = syncing[-1][f"{key}_{end}"]
        rows["steps"].append(row)
