"""The trace model: a run folder written by the tracer, loaded and aligned.

``load_run(path)`` reads ``run.json`` and every ``rank-<r>.json``, checks them, maps
every rank's timestamps onto rank 0's clock with the stored offsets, and returns
tables (pandas DataFrames). Times are µs on rank 0's clock (``*_us`` columns).
Bad input raises ``TraceError`` with a one-line message; nothing half-built is returned.
"""

from __future__ import annotations

import math
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
import pandas as pd

from ddpscope.tracer import format as fmt

MAX_FILE_BYTES = 512 * 2**20  # a rank file beyond this is not something we parse in memory


MAX_WORLD = 65536
MAX_INDEX = 10**9  # steps, buckets, parameters: beyond this a number is not one of ours


class TraceError(ValueError):
    """A trace that cannot be read; the message is one line, fit for a user: whatever the
    file held (a newline in a name, a lone surrogate) is folded into one printable line."""

    def __init__(self, message: object) -> None:
        text = " ".join(str(message).split())
        super().__init__(text.encode("utf-8", "backslashreplace").decode("utf-8")[:1000])


# What readers take from a rank's metadata and run.json, typed (msgspec checks them: a
# field of the wrong type is one TraceError line; fields not named here are not read).
class _Offset(msgspec.Struct):
    offset_us: float
    at_us: float


class _ClockOffsets(msgspec.Struct):
    start: _Offset | None = None
    end: _Offset | None = None


Count = Annotated[int, msgspec.Meta(ge=0, lt=MAX_INDEX)]  # steps, indices
Bytes = Annotated[int, msgspec.Meta(ge=0, le=2**50)]  # a parameter's or a bucket's bytes
World = Annotated[int, msgspec.Meta(ge=1, le=MAX_WORLD)]
Text = Annotated[str, msgspec.Meta(max_length=100_000)]


class _RankMeta(msgspec.Struct):
    rank: Count
    world_size: World
    param_names: list[Text] = []
    param_bytes: list[Bytes] = []
    param_dtypes: list[Text] = []
    clock_offset: _ClockOffsets | None = None
    status: Text | None = None
    error: Text | None = None
    steps: Count | None = None
    host: Text | None = None
    backend: Text | None = None


class _RunMeta(msgspec.Struct):
    world_size: World | None = None
    kind: Text | None = None
    status: Text | None = None
    error: Text | None = None
    bucket_cap_mb: Annotated[float, msgspec.Meta(gt=0, le=2**30)] | None = None
    bucket_cap_default: bool | None = None
    first_bucket_cap_bytes: Bytes | None = None
    bucket_layout: list[list[Count]] | None = None
    notes: list[Text] | None = None
    model: Text | int | None = None
    param_names: list[Text] | None = None
    param_bytes: list[Bytes] | None = None
    param_dtypes: list[Text] | None = None
    steps: Count | None = None
    backend: Text | None = None
    nproc_per_node: World | None = None


def check_meta(meta: dict, where: str, schema=_RankMeta) -> None:
    """``meta`` has the fields readers use, of the right types (a number written as text is
    not a number), finite and in range."""
    try:
        m = msgspec.convert(meta, schema)
    except msgspec.ValidationError as e:
        raise TraceError(f"{where}: {e}") from None
    world = getattr(m, "world_size", None)
    if world is not None and not 1 <= world <= MAX_WORLD:
        raise TraceError(f"{where}: world_size {world} is outside 1..{MAX_WORLD}")
    if isinstance(m, _RankMeta):
        if not 0 <= m.rank < m.world_size:
            raise TraceError(f"{where}: rank {m.rank} is outside a job of {m.world_size}")
        for o in (m.clock_offset.start, m.clock_offset.end) if m.clock_offset else ():
            if o is not None and not (math.isfinite(o.offset_us) and math.isfinite(o.at_us)
                                      and abs(o.offset_us) < 1e13 and abs(o.at_us) < 1e16):
                raise TraceError(f"{where}: its clock offset is not a finite, sensible number of µs")
    names, sizes, dtypes = m.param_names, m.param_bytes, m.param_dtypes
    given = [len(x) for x in (names, sizes, dtypes) if x]
    if len(set(given)) > 1:
        raise TraceError(f"{where}: it names {len(names or [])} parameters, with {len(sizes or [])} sizes and "
                         f"{len(dtypes or [])} dtypes")
    layout = getattr(m, "bucket_layout", None)
    if layout and given and max((i for b in layout for i in b), default=0) >= given[0]:
        raise TraceError(f"{where}: its bucket layout names a parameter beyond its {given[0]} parameters")


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
      written); optimizer_start_us, optimizer_end_us
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


def read_file_bytes(path: Path, what: str) -> bytes:
    """A regular file's bytes: links, FIFOs and devices are refused, never opened (a FIFO
    would block the reader; a link could point anywhere), and so is a file too big to parse."""
    try:
        st = path.lstat()
    except OSError as e:
        raise TraceError(f"cannot read {what} {path}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a link" if stat.S_ISLNK(st.st_mode) else "not a regular file (a FIFO or device?)"
        raise TraceError(f"{what} {path.name} is {kind}; refused")
    if st.st_size > MAX_FILE_BYTES:
        raise TraceError(f"{what} {path} is {st.st_size / 2**20:.0f} MiB, over the {MAX_FILE_BYTES // 2**20} MiB limit")
    try:
        with open(path, "rb") as f:
            return f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise TraceError(f"cannot read {what} {path}: {e.strerror}") from None


def _parse_json(raw: bytes, name: str, what: str):
    """JSON as a trace holds it. Decoded strictly (msgspec): text that is not UTF-8, a lone
    surrogate, NaN or infinities, numbers no 64-bit integer or double holds, and nesting
    deeper than Python's stack are each one ``TraceError`` line, never a value that fails
    later (a 5,000-digit integer, a string that cannot be printed)."""
    try:
        return msgspec.json.decode(raw)
    except UnicodeDecodeError:
        raise TraceError(f"{what} {name} is not UTF-8 text (not a trace?)") from None
    except RecursionError:
        raise TraceError(f"{what} {name} is nested too deeply to be a trace") from None
    except (msgspec.MsgspecError, ValueError) as e:
        try:
            raw[:4096].decode("utf-8")
        except UnicodeDecodeError as bad:
            if bad.start < 4090:  # not a character cut at the end of the sample: binary, not JSON
                raise TraceError(f"{what} {name} is not UTF-8 text (not a trace?)") from None
        raise TraceError(f"{what} {name} is not valid JSON (truncated, or numbers JSON cannot hold?): "
                         f"{str(e)[:120]}") from None


def read_json_file(path: Path, what: str) -> dict:
    """A JSON object from a regular file (see ``read_file_bytes``)."""
    data = _parse_json(read_file_bytes(path, what), path.name, what)
    if not isinstance(data, dict):
        raise TraceError(f"{what} {path.name} is not a JSON object")
    return data


def _parse_growing_array(raw: bytes, name: str) -> list:
    """A trace in the array form, which may be unterminated (its rank is running, or
    stopped): closed after its last whole line; a torn last line (a write cut short) is
    dropped."""
    body = raw.rstrip()
    before_last_line = body[:body.rfind(b"\n")].rstrip()
    # as it is (closed), closed after its last line, closed after the line before that
    error = None
    for text in (body, body.rstrip(b",") + b"]", before_last_line.rstrip(b",") + b"]"):
        try:
            return _parse_json(text, name, "rank file")
        except TraceError as e:
            error = error or e
    raise TraceError(f"{error}; not even read as an unfinished trace")


def read_rank_file(path: Path) -> tuple[dict, list[dict]]:
    """(metadata, events) of one rank file, checked to be ours: the array form the tracer
    writes (finished or not: its last metadata event; a rank still running counts its
    steps from its events) or the object form of version 1 (``otherData.ddpscope``)."""
    raw = read_file_bytes(path, "rank file")
    if raw.lstrip()[:1] == b"[":
        meta, events = None, []
        for e in _parse_growing_array(raw, path.name):
            if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == fmt.META_EVENT:
                meta = e.get("args")  # the last one counts
            else:
                events.append(e)
        if isinstance(meta, dict) and meta.get("status") == fmt.RUNNING:
            meta = {**meta, "steps": sum(1 for e in events if isinstance(e, dict) and e.get("cat") == fmt.CAT_STEP)}
    else:
        data = _parse_json(raw, path.name, "rank file")
        if not isinstance(data, dict):
            raise TraceError(f"rank file {path.name} is not a JSON object or array")
        other = data.get("otherData")
        meta = other.get("ddpscope") if isinstance(other, dict) else None
        events = data.get("traceEvents")
    if not isinstance(meta, dict) or meta.get("format") != fmt.FORMAT:
        raise TraceError(f"{path.name} is not a ddpscope trace (no ddpscope metadata; another tool's file?)")
    check_version(meta, path.name)
    if not isinstance(events, list):
        raise TraceError(f"{path.name} has no traceEvents list")
    check_meta(meta, path.name)
    if not all(isinstance(e, dict) for e in events):
        raise TraceError(f"{path.name}: an entry of traceEvents is not an event (JSON object)")
    return meta, events


def check_version(meta: dict, where: str) -> None:
    """A format version this reader knows: a whole number from 1 to ``fmt.VERSION``."""
    version = meta.get("version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise TraceError(f"{where}: its trace format version {version!r} is not a version number")
    if version > fmt.VERSION:
        raise TraceError(f"{where} has trace format version {version}; this ddpscope reads up to {fmt.VERSION}")


def run_kind(path: str | Path) -> str | None:
    """``"ddp"``, ``"ring"`` or ``"zero"`` for a run folder (from ``run.json``; ``"ddp"``
    when it has none or it cannot be read: the DDP pages then say what is wrong), or None
    when the folder holds no rank files."""
    path = Path(path)
    if not path.is_dir() or not any(fmt.RANK_FILE_RE.match(p.name) for p in path.iterdir()):
        return None
    try:
        run = read_json_file(path / fmt.RUN_FILE, "run metadata") if (path / fmt.RUN_FILE).exists() else {}
    except TraceError:  # listed as a DDP run: opening it says what is wrong
        return fmt.KIND_DDP
    kind = run.get("kind") if isinstance(run, dict) else None
    return kind if kind in (fmt.KIND_DDP, fmt.KIND_RING, fmt.KIND_ZERO) else fmt.KIND_DDP


def read_run_folder(path: str | Path, kind: str, *, allow_missing_ranks: bool = False
                    ) -> tuple[dict, dict[int, tuple[dict, list]], int]:
    """``(run.json, {rank: (metadata, events)}, world size)`` of a run folder of ``kind``,
    checked: every rank file ours and present (unless ``allow_missing_ranks``)."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"{path} is not a folder")
    run_path = path / fmt.RUN_FILE
    run = read_json_file(run_path, "run metadata") if run_path.exists() else {}
    if run and run.get("format") != fmt.FORMAT:
        raise TraceError(f"{run_path.name} in {path} is not ddpscope run metadata")
    if run:
        check_version(run, f"{path.name}/{run_path.name}")
        check_meta(run, f"{path.name}/{run_path.name}", _RunMeta)
    found = str(run.get("kind") or fmt.KIND_DDP)
    if found != kind:
        what = {fmt.KIND_RING: "a ring all-reduce run (see the Ring page)", fmt.KIND_DDP: "a DDP training run",
                fmt.KIND_ZERO: "a ZeRO memory run (see the Memory page)"}
        raise TraceError(f"{path.name} is {what.get(found, repr(found))}, not {what.get(kind, repr(kind))}")
    files = {int(m.group(1)): p for p in path.iterdir() if (m := fmt.RANK_FILE_RE.match(p.name))}
    if not files:
        raise TraceError(f"{path} holds no rank-<r>.json trace files")
    ranks = {}
    for rank in sorted(files):
        meta, events = read_rank_file(files[rank])
        if int(meta.get("rank", -1)) != rank:
            raise TraceError(f"{files[rank].name} says it is rank {meta.get('rank')}")
        ranks[rank] = (meta, events)
    world = int(run.get("world_size") or max(int(m.get("world_size", 0)) for m, _ in ranks.values()))
    if not 1 <= world <= MAX_WORLD or max(ranks) >= world:
        raise TraceError(f"{path}: world size {world} does not fit its rank files (ranks {min(ranks)}..{max(ranks)})")
    missing = sorted(set(range(world)) - set(ranks))
    if missing and not allow_missing_ranks:
        raise TraceError(f"{path}: rank file(s) for rank {', '.join(map(str, missing))} of {world} are missing")
    return run or {"world_size": world, "status": "unknown"}, ranks, world


def load_run(path: str | Path, *, allow_missing_ranks: bool = False) -> RunTrace:
    """Load a DDP run folder (``run.json`` + ``rank-*.json``)."""
    path = Path(path)
    run, files, _ = read_run_folder(path, fmt.KIND_DDP, allow_missing_ranks=allow_missing_ranks)
    ranks: dict[int, dict] = {}
    rows: dict[str, list] = {"steps": [], "passes": [], "buckets": [], "grads": [], "memory": []}
    for rank, (meta, events) in files.items():
        ranks[rank] = meta
        _parse_events(rank, meta, events, rows)
    return RunTrace(
        path=path, run=run, ranks=ranks,
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
                "backward_us", *_SPAN_COLUMNS, "optimizer_start_us", "optimizer_end_us"]
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
