"""The trace model: a run folder written by the tracer, loaded and aligned.

``load_run(path)`` reads ``run.json`` and every ``rank-<r>.json``, checks them, maps
every rank's timestamps onto rank 0's clock with the stored offsets, and returns
tables (pandas DataFrames). Times are µs on rank 0's clock (``*_us`` columns).
Bad input raises ``TraceError`` with a one-line message; nothing half-built is returned.

Summary first: ``load_run(path, events_for=ranks)`` reads every rank's per-step summary
(``rank-<r>.summary.jsonl``, a few KB a rank, written by the rank itself) and the
events of ``ranks`` only: the step table covers every rank, the per-event tables
(buckets, gradients, passes) the ranks asked for (``viz.sources.rank_events`` reads more ranks'
events into such a trace). Several rank files to parse are parsed on every core
(``viz.parallel``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import msgspec
import numpy as np
import pandas as pd

from ddpscope.tracer import format as fmt
from ddpscope.tracer.step_summary import COMM_FIELDS, DURATION_FIELDS, TIME_FIELDS, comm_fields, summarize_steps
from ddpscope.viz.parallel import map_on_cores
from ddpscope.viz.run_files import (
    MAX_INDEX,
    TraceError,
    clock_alignment,
    clock_params,
    open_run_folder,
    read_checked_rank_file,
    read_summary_file,
)

__all__ = ["RunTrace", "TraceError", "load_run", "run_status", "frame_of"]

@dataclass(frozen=True)
class RunTrace:
    """One run. DataFrames:

    - ``passes``: one row per forward and its backward in a step (a micro-batch under
      gradient accumulation): rank, step, micro, sync (DDP reduced this pass's
      gradients: it ran outside ``no_sync()``), forward_start_us, forward_end_us,
      backward_start_us, backward_end_us, sync_start_us, sync_end_us, compute_end_us
      (backward compute's end: its last gradient; the span may run on, waiting)
    - ``steps``: rank, step, warmup, incomplete, grad_marks (the step has a gradient-ready
      mark per parameter in ``grads``; False under ``--grad-marks-every``), start_us, end_us, micro_batches,
      forward_us and backward_us (compute summed over the step's passes), and the
      *syncing* pass's (the one whose backward launched the all-reduces; the last pass
      if none synced) forward_start_us, forward_end_us, backward_start_us,
      backward_end_us (backward compute), sync_start_us, sync_end_us (waiting for
      DDP's all-reduces after backward compute until every averaged gradient is
      written); optimizer_start_us, optimizer_end_us; under ZeroRedundancyOptimizer
      (ZeRO-1) its parameter broadcasts inside the optimizer step: param_sync_start_us,
      param_sync_end_us, param_sync_bytes (every rank's partition), param_sync_own_bytes
      (this rank's, which it sends); NaN otherwise; DDP's own collectives that are not
      buckets (its unused-parameter map's all-reduce): ddp_own_start_us, ddp_own_end_us,
      ddp_own_bytes, NaN where it issued none; DDP's broadcasts of the module's buffers
      before its syncing forwards (BatchNorm's statistics): buffer_sync_start_us,
      buffer_sync_end_us, buffer_sync_bytes, NaN where none; the other collectives DDP
      or the script issued in the step (a loss averaged for logging, the all-reduce of
      delay_all_reduce_named_params): other_comm_start_us, other_comm_end_us (the first's
      start, the last's end), other_comm_bytes, other_comm_count; and what the step's all-reduces
      did (``tracer.step_summary``): num_buckets, bucket_bytes, first_launch_us,
      last_done_us, comm_us (their union) and overlapped_us (its part inside backward
      compute), durations in µs
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
    #: (``viz.sharded.trace.ShardedTables``); None for DDP and profiler traces
    shards: object | None = None
    #: the ranks whose events were read (buckets, grads and passes hold these ranks
    #: only; ``steps`` and ``memory`` hold every rank); None: every rank's
    event_ranks: tuple[int, ...] | None = None
    #: derived tables that figures reuse across selections (filled by viz functions)
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def world_size(self) -> int:
        return int(self.run.get("world_size") or len(self.ranks))

    @property
    def all_events(self) -> bool:
        """Whether every rank's events were read (not only some ranks' summaries)."""
        return self.event_ranks is None or set(self.event_ranks) >= set(self.ranks)

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


def load_run(path: str | Path, *, allow_missing_ranks: bool = False, events_for: Iterable[int] | None = None
             ) -> RunTrace:
    """Load a training run folder (``run.json`` + ``rank-*.json``): DDP, or sharded
    (FSDP2: the same step tables, and its own in ``shards``).

    ``events_for``: the ranks whose events are read; every other rank's steps come from
    its summary (a rank without one, as traces before summaries: from its events). A
    folder may then hold only summaries for ranks not asked for. None: every rank's
    events. A sharded run's units need every rank's events: it reads them all."""
    path = Path(path)
    folder = open_run_folder(path, (fmt.KIND_DDP, fmt.KIND_SHARDED), allow_missing_ranks=allow_missing_ranks,
                             summaries=events_for is not None)
    run = folder.run
    sharded = run.get("kind") == fmt.KIND_SHARDED
    wanted = set(folder.ranks) if events_for is None or sharded else {int(r) for r in events_for}
    summaries: dict[int, tuple[dict, list]] = {}
    for rank in folder.ranks:
        if rank in folder.summary_files and not (rank in wanted and rank in folder.rank_files):
            try:
                summaries[rank] = read_summary_file(folder.summary_files[rank], rank)
            except TraceError:
                if rank not in folder.rank_files:
                    raise
                # a summary is a digest of the events: read them instead
    parse = [r for r in folder.ranks if r not in summaries]
    missing = [r for r in parse if r not in folder.rank_files]
    if missing:
        raise TraceError(f"{path.name}: rank {missing[0]} has neither events nor a summary that can be read")
    raw: dict[int, tuple[dict, list]] = {}
    if sharded:  # the units are parsed from every rank's events at once
        raw = {r: read_checked_rank_file(folder.rank_files[r], r) for r in parse}
        parsed = [_rank_tables(r, *raw[r]) for r in parse]
    else:
        sizes = [folder.rank_files[r].stat().st_size for r in parse]
        parsed = map_on_cores(read_rank_tables, [(r, folder.rank_files[r]) for r in parse], sizes)
    ranks = {r: t.meta for r, t in zip(parse, parsed)}
    ranks.update({r: m for r, (m, _) in summaries.items()})
    ranks = dict(sorted(ranks.items()))
    rows = [row for t in parsed for row in t.steps]
    rows += [{"rank": r, **msgspec.structs.asdict(line)} for r, (_, lines) in summaries.items() for line in lines]
    steps, memory = _step_tables(rows, ranks)
    twice = steps[steps.duplicated(["rank", "step"])]
    if len(twice):  # every per-step table is keyed by (rank, step): a repeat would be summed or fail later
        r, s = int(twice["rank"].iloc[0]), int(twice["step"].iloc[0])
        source = "summary" if r in summaries else "events"
        raise TraceError(f"{path.name}: rank {r} records step {s} more than once (in its {source}): "
                         "the folder was edited or two runs were written into it")
    shards = None
    if sharded:
        from ddpscope.viz.sharded.trace import parse_sharded

        try:
            shards = parse_sharded(run, raw, clock_alignment)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise TraceError(f"{path.name}: malformed sharded trace ({type(e).__name__}: {str(e)[:200]})") from None

    return RunTrace(
        path=path, run=run, ranks=ranks, shards=shards, steps=steps, memory=memory,
        **{name: join_tables([getattr(t, name) for t in parsed], name) for name in EVENT_TABLES},
        event_ranks=None if not summaries else tuple(parse),
    )


class RankTables(msgspec.Struct):
    """One rank's events, parsed (in a worker process when several are): its metadata,
    its step rows (``summarize_steps``, its own clock) and its aligned per-event tables."""

    meta: dict
    steps: list
    passes: pd.DataFrame
    buckets: pd.DataFrame
    grads: pd.DataFrame


def read_rank_tables(rank: int, path: Path) -> RankTables:
    """One rank's file, read and parsed (a module-level function: a worker process runs it)."""
    return _rank_tables(rank, *read_checked_rank_file(path, rank))


def _rank_tables(rank: int, meta: dict, events: list) -> RankTables:
    rows: dict[str, list] = {"passes": [], "buckets": [], "grads": []}
    _parse_events(rank, meta, events, rows)  # checks every event first
    try:
        steps = [{"rank": rank, **row} for row in summarize_steps(events)]
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise TraceError(f"rank {rank}: malformed trace event ({type(e).__name__}: {str(e)[:200]})") from None
    return RankTables(meta=meta, steps=steps,
                       passes=frame_of(rows["passes"], ["rank", "step", "micro"], PASS_COLUMNS),
                       buckets=frame_of(rows["buckets"], ["rank", "step", "bucket"], BUCKET_COLUMNS),
                       grads=frame_of(rows["grads"], ["rank", "step", "ready_us"], GRAD_COLUMNS))


def _step_tables(rows: list[dict], metas: dict[int, dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The steps and memory tables from step rows (``summarize_steps``, with their rank),
    their times aligned to rank 0's clock, one vectorised pass for every rank."""
    if not rows:
        return frame_of([], ["rank", "step"], STEP_COLUMNS), frame_of([], ["rank", "step"], ["rank", "step"])
    df = pd.DataFrame(rows)
    for c in STEP_COLUMNS:
        if c not in df:
            df[c] = np.nan
    params = {r: clock_params(m) for r, m in metas.items()}
    rank = df["rank"].to_numpy()
    offset, slope, at = (np.array([params[r][k] for r in rank], dtype=float) for k in range(3))
    for c in TIME_FIELDS:  # the same arithmetic as clock_alignment's
        t = df[c].to_numpy(dtype=float)
        df[c] = t + offset + slope * (t - at)
    for c in DURATION_FIELDS:  # the alignment is affine: a length on rank 0's clock is (1 + slope) times it
        df[c] = df[c].to_numpy(dtype=float) * (1.0 + slope)
    if "memory" not in df:
        df["memory"] = None
    memory = df[["rank", "step", "memory"]].dropna(subset=["memory"])
    memory = frame_of([{"rank": r, "step": s, **_byte_counts(m)} for r, s, m in memory.itertuples(index=False)],
                      ["rank", "step"], ["rank", "step"])
    ints = {"rank", "step", "micro_batches", "num_buckets", "bucket_bytes"}
    df["grad_marks"] = df["grad_marks"].fillna(True)  # a summary from before --grad-marks-every: every step
    steps = df[STEP_COLUMNS].astype({c: bool if c in ("warmup", "incomplete", "grad_marks") else "int64" if c in ints
                                     else float for c in STEP_COLUMNS})
    return steps.sort_values(["rank", "step"], kind="stable").reset_index(drop=True), memory


def has_marks(steps: pd.DataFrame) -> pd.Series:
    """Per row of ``steps``: the step has a gradient-ready mark per parameter (False: traced
    under ``--grad-marks-every`` without them; a table without the column, or NaN: True)."""
    if "grad_marks" not in steps:
        return pd.Series(True, index=steps.index)
    return steps["grad_marks"].fillna(True).astype(bool)


def compute_end(df: pd.DataFrame) -> pd.Series:
    """Backward compute's end per row (steps or passes): ``compute_end_us`` (the last
    gradient), else, where a trace does not say it, the backward span's end."""
    if "compute_end_us" not in df:
        return df["backward_end_us"]
    return df["compute_end_us"].fillna(df["backward_end_us"])


def fill_comm_columns(steps: pd.DataFrame, buckets: pd.DataFrame, passes: pd.DataFrame) -> pd.DataFrame:
    """``steps`` with its ``COMM_FIELDS`` computed from the bucket and pass tables where
    they are missing (NaN, or no column): a prediction's steps, a table built by hand.
    The same definition as a summary's (``tracer.step_summary.comm_fields``)."""
    need = steps["comm_us"].isna() if "comm_us" in steps else pd.Series(True, index=steps.index)
    if not need.any():
        return steps
    steps = steps.assign(**{c: np.nan for c in COMM_FIELDS if c not in steps})  # a copy
    # grouped once, not filtered per row (a sweep fills every predicted step of every cap)
    by_bucket = ({k: list(zip(g["launch_us"], g["done_us"], g["bytes"])) for k, g in buckets.groupby(["rank", "step"])}
                 if len(buckets) else {})
    by_pass: dict = {}
    if len(passes) and "backward_start_us" in passes:
        by_pass = {k: [] for k in passes.groupby(["rank", "step"]).groups}  # a step whose passes have no span: none
        timed = passes.dropna(subset=["backward_start_us", "backward_end_us"])
        timed = timed.assign(_compute_end=compute_end(timed))
        for k, g in timed.groupby(["rank", "step"]):
            by_pass[k] = list(zip(g["backward_start_us"], g["_compute_end"]))
    rows = steps.index[need]
    filled: dict[str, list] = {c: [] for c in COMM_FIELDS}
    for i in rows:
        key = (steps.at[i, "rank"], steps.at[i, "step"])
        backwards = by_pass.get(key)
        if backwards is None:
            lo, hi = steps.at[i, "backward_start_us"], steps.at[i, "backward_end_us"]
            backwards = [(lo, hi)] if pd.notna(lo) and pd.notna(hi) else []
        fields = comm_fields(by_bucket.get(key, []), backwards)
        for c in COMM_FIELDS:
            filled[c].append(fields[c] if c in fields else steps.at[i, c])
    for c in COMM_FIELDS:
        steps.loc[rows, c] = pd.Series(filled[c], index=rows)
    return steps


# Every table has its columns whatever the trace held (a trace without backward spans
# has NaN backward times, not a table without the column); see ``RunTrace``.
_SPAN_COLUMNS = [f"{phase}_{end}_us" for phase in ("forward", "backward", "sync") for end in ("start", "end")]
STEP_COLUMNS = ["rank", "step", "warmup", "incomplete", "grad_marks", "start_us", "end_us", "micro_batches", "forward_us",
                "backward_us", *_SPAN_COLUMNS, "compute_end_us", "optimizer_start_us", "optimizer_end_us",
                "param_sync_start_us", "param_sync_end_us", "param_sync_bytes", "param_sync_own_bytes", "ddp_own_start_us", "ddp_own_end_us",
                "ddp_own_bytes", "buffer_sync_start_us", "buffer_sync_end_us", "buffer_sync_bytes",
                "other_comm_start_us", "other_comm_end_us", "other_comm_bytes", "other_comm_count", *COMM_FIELDS]
PASS_COLUMNS = ["rank", "step", "micro", "sync", *_SPAN_COLUMNS, "compute_end_us"]
BUCKET_COLUMNS = ["rank", "step", "bucket", "bytes", "num_params", "params", "launch_us", "done_us", "incomplete"]
GRAD_COLUMNS = ["rank", "step", "micro", "param", "name", "ready_us"]
_INT_COLUMNS = {"rank", "step", "micro", "bucket", "bytes", "num_params", "param", "micro_batches"}
_BOOL_COLUMNS = {"warmup", "incomplete", "grad_marks", "sync"}
#: the per-event tables of a rank (what ``events_for`` leaves out): name -> (sort order, columns)
EVENT_TABLES = {"buckets": (["rank", "step", "bucket"], BUCKET_COLUMNS),
                "grads": (["rank", "step", "ready_us"], GRAD_COLUMNS),
                "passes": (["rank", "step", "micro"], PASS_COLUMNS)}


def join_tables(frames: list[pd.DataFrame], name: str) -> pd.DataFrame:
    """Ranks' ``name`` tables (one of ``EVENT_TABLES``) as one, sorted as ``load_run``'s."""
    order, columns = EVENT_TABLES[name]
    frames = [f for f in frames if len(f)]
    if not frames:
        return frame_of([], order, columns)
    return pd.concat(frames, ignore_index=True).sort_values(order, kind="stable").reset_index(drop=True)


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


def _kernel_us(value) -> float:
    """A bucket's kernel time as the backend timed it (µs, ``nccl_kernel_us``)."""
    us = float(value)
    if not (math.isfinite(us) and 0 <= us < 2**40):
        raise ValueError(f"nccl_kernel_us {value!r} is not a duration")
    return us


_PHASES = {fmt.CAT_FORWARD: "forward", fmt.CAT_BACKWARD: "backward", fmt.CAT_GRAD_SYNC: "sync"}


def _byte_counts(memory: dict) -> dict:
    """A step's memory record: names -> finite byte counts (anything else is malformed)."""
    for k, v in memory.items():
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) < 2**62):
            raise ValueError(f"memory[{k!r}] is not a byte count")
    return memory


def _parse_events(rank: int, meta: dict, events: list, rows: dict[str, list]) -> None:
    """Every event checked (step, finite times, non-negative durations), and the passes,
    gradient marks and bucket all-reduces of ``events`` as rows, aligned (the steps are
    ``summarize_steps``'s)."""
    align = clock_alignment(meta)
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
            if cat == fmt.CAT_STEP and isinstance(args.get("memory"), dict):
                _byte_counts(args["memory"])
            elif cat in _PHASES:
                key = _PHASES[cat]
                n = seen[(step, key)] = seen.get((step, key), -1) + 1
                micro = int(args.get("micro", n))
                p = passes.setdefault((step, micro), {"rank": rank, "step": step, "micro": micro, "sync": True})
                if "sync" in args:
                    p["sync"] = bool(args["sync"])
                p[f"{key}_start_us"], p[f"{key}_end_us"] = ts, te
                if key == "backward":  # compute to its last gradient (step_summary's definition)
                    p["compute_end_us"] = min(te, max(ts, align(raw + float(args["compute_us"])))) \
                        if "compute_us" in args else te
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
                                        "incomplete": bool(args.get("incomplete", False)),
                                        **({"kernel_us": _kernel_us(args["nccl_kernel_us"])}
                                           if "nccl_kernel_us" in args else {})})
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise TraceError(f"rank {rank}: malformed trace event ({type(e).__name__}: {str(e)[:200]})") from None
    rows["passes"] += [p for _, p in sorted(passes.items())]
