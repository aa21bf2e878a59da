"""A ddpscope run folder's files, read and checked: the one place where what a file
holds becomes values the readers trust.

Files are read as regular files only (a link, a FIFO or a device is refused, never
opened), within a size limit, and decoded strictly (msgspec): text that is not UTF-8,
lone surrogates, NaN and infinities, numbers no 64-bit integer or double holds, and
nesting deeper than the stack are each one ``TraceError`` line. Every metadata field a
reader uses is typed, with its range (``check_meta``); a rank file may be unfinished
(its rank is running, or stopped): it is read up to its last whole line. A rank's clock
offsets, once checked, are read as its clock on rank 0's axis (``clock_alignment``).
"""

from __future__ import annotations

import math
import stat
from pathlib import Path
from typing import Annotated

import msgspec

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
    rtt_us: float = 0.0  # the round trip of the sample: the offset is exact to half of it


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
                                      and abs(o.offset_us) < 1e13 and abs(o.at_us) < 1e16
                                      and math.isfinite(o.rtt_us) and 0 <= o.rtt_us < 1e13):
                raise TraceError(f"{where}: its clock offset is not a finite, sensible number of µs")
    names, sizes, dtypes = m.param_names, m.param_bytes, m.param_dtypes
    given = [len(x) for x in (names, sizes, dtypes) if x]
    if len(set(given)) > 1:
        raise TraceError(f"{where}: it names {len(names or [])} parameters, with {len(sizes or [])} sizes and "
                         f"{len(dtypes or [])} dtypes")
    layout = getattr(m, "bucket_layout", None)
    if layout and given and max((i for b in layout for i in b), default=0) >= given[0]:
        raise TraceError(f"{where}: its bucket layout names a parameter beyond its {given[0]} parameters")


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
    if not path.is_dir() or not any(fmt.RANK_FILE_RE.match(p.name) or fmt.SUMMARY_FILE_RE.match(p.name)
                                    for p in path.iterdir()):
        return None
    try:
        run = read_json_file(path / fmt.RUN_FILE, "run metadata") if (path / fmt.RUN_FILE).exists() else {}
    except TraceError:  # listed as a DDP run: opening it says what is wrong
        return fmt.KIND_DDP
    kind = run.get("kind") if isinstance(run, dict) else None
    return kind if kind in (fmt.KIND_DDP, fmt.KIND_RING, fmt.KIND_ZERO, fmt.KIND_SHARDED) else fmt.KIND_DDP


class RunFolder(msgspec.Struct, frozen=True):
    """A run folder, listed and its run.json checked; nothing else read yet.
    ``rank_files`` / ``summary_files``: rank -> path of its events / of its summary."""

    path: Path
    run: dict
    world: int
    rank_files: dict
    summary_files: dict

    @property
    def ranks(self) -> list[int]:
        return sorted(set(self.rank_files) | set(self.summary_files))


def open_run_folder(path: str | Path, kind: str | tuple[str, ...], *, allow_missing_ranks: bool = False,
                    summaries: bool = False) -> RunFolder:
    """The run folder of ``kind`` (or one of several) at ``path``, its run.json checked
    and its files listed: every rank's events present (unless ``allow_missing_ranks``),
    or with ``summaries``, its events or its summary (a folder may hold only summaries:
    a job's traces gathered from its nodes without their events)."""
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
    kinds = (kind,) if isinstance(kind, str) else kind
    if found not in kinds:
        what = {fmt.KIND_RING: "a ring all-reduce run (see the Ring page)", fmt.KIND_DDP: "a DDP training run",
                fmt.KIND_ZERO: "a ZeRO memory run (see the Memory page)",
                fmt.KIND_SHARDED: "a sharded (FSDP2) training run"}
        raise TraceError(f"{path.name} is {what.get(found, repr(found))}, not {what.get(kinds[0], repr(kinds[0]))}")
    names = [p.name for p in path.iterdir()]
    files = {int(m.group(1)): path / n for n in names if (m := fmt.RANK_FILE_RE.match(n))}
    sums = {int(m.group(1)): path / n for n in names if (m := fmt.SUMMARY_FILE_RE.match(n))} if summaries else {}
    present = set(files) | set(sums)
    if not present:
        raise TraceError(f"{path} holds no rank-<r>.json trace files")
    world = int(run.get("world_size") or 0)
    if not world:  # no run.json: a rank's own metadata says
        world = int(read_rank_file(files[min(files)])[0]["world_size"]) if files else max(present) + 1
    if not 1 <= world <= MAX_WORLD or max(present) >= world:
        raise TraceError(f"{path}: world size {world} does not fit its rank files "
                         f"(ranks {min(present)}..{max(present)})")
    missing = sorted(set(range(world)) - present)
    if missing and not allow_missing_ranks:
        raise TraceError(f"{path}: rank file(s) for rank {', '.join(map(str, missing))} of {world} are missing")
    return RunFolder(path=path, run=run or {"world_size": world, "status": "unknown"}, world=world,
                     rank_files=files, summary_files=sums)


def read_checked_rank_file(path: Path, rank: int) -> tuple[dict, list[dict]]:
    """``read_rank_file``, and the file is of the rank its name says."""
    meta, events = read_rank_file(path)
    if int(meta.get("rank", -1)) != rank:
        raise TraceError(f"{path.name} says it is rank {meta.get('rank')}")
    return meta, events


def read_run_folder(path: str | Path, kind: str | tuple[str, ...], *, allow_missing_ranks: bool = False
                    ) -> tuple[dict, dict[int, tuple[dict, list]], int]:
    """``(run.json, {rank: (metadata, events)}, world size)`` of a run folder of ``kind``
    (or one of several), checked: every rank file ours and present (unless
    ``allow_missing_ranks``)."""
    folder = open_run_folder(path, kind, allow_missing_ranks=allow_missing_ranks)
    ranks = {rank: read_checked_rank_file(p, rank) for rank, p in sorted(folder.rank_files.items())}
    return folder.run, ranks, folder.world


# A summary's lines (``tracer/step_summary.py``), typed: a field of the wrong type, a
# number out of range, a line that is neither a step nor metadata is one TraceError.
Us = Annotated[float, msgspec.Meta(ge=-1e16, le=1e16)]  # a time or a duration, µs
Big = Annotated[int, msgspec.Meta(ge=0, le=2**62)]
Name = Annotated[str, msgspec.Meta(max_length=200)]


class SummaryLine(msgspec.Struct):
    """A summary line: ``{"meta": ...}``, or a step's row (``summarize_steps``)."""

    meta: dict | None = None
    step: Count | None = None
    start_us: Us | None = None
    end_us: Us | None = None
    warmup: bool = False
    incomplete: bool = False
    micro_batches: Count = 0
    forward_us: Us = 0.0
    backward_us: Us = 0.0
    forward_start_us: Us | None = None
    forward_end_us: Us | None = None
    backward_start_us: Us | None = None
    backward_end_us: Us | None = None
    compute_end_us: Us | None = None
    sync_start_us: Us | None = None
    sync_end_us: Us | None = None
    optimizer_start_us: Us | None = None
    optimizer_end_us: Us | None = None
    param_sync_start_us: Us | None = None
    param_sync_end_us: Us | None = None
    param_sync_bytes: Big | None = None
    param_sync_own_bytes: Big | None = None
    ddp_own_start_us: Us | None = None
    ddp_own_end_us: Us | None = None
    ddp_own_bytes: Big | None = None
    buffer_sync_start_us: Us | None = None
    buffer_sync_end_us: Us | None = None
    buffer_sync_bytes: Big | None = None
    other_comm_start_us: Us | None = None
    other_comm_end_us: Us | None = None
    other_comm_bytes: Big | None = None
    other_comm_count: Count | None = None
    memory: dict[Name, Annotated[int, msgspec.Meta(ge=-2**62, le=2**62)] | Us] | None = None
    num_buckets: Count = 0
    bucket_bytes: Big = 0
    first_launch_us: Us | None = None
    last_done_us: Us | None = None
    comm_us: Us = 0.0
    overlapped_us: Us = 0.0


_SUMMARY_DECODER = msgspec.json.Decoder(list[SummaryLine])


def read_summary_file(path: Path, rank: int) -> tuple[dict, list[SummaryLine]]:
    """(metadata, step rows) of one rank's summary, checked to be ours and of ``rank``;
    unfinished (its rank running, or stopped), it is read up to its last whole line."""
    raw = read_file_bytes(path, "summary file")
    body = raw[:raw.rfind(b"\n") + 1].rstrip(b"\n")  # a torn last line (a write cut short) is dropped
    try:  # one JSON object a line (msgspec escapes a newline inside a string)
        lines = _SUMMARY_DECODER.decode(b"[" + body.replace(b"\n", b",") + b"]")
    except msgspec.ValidationError as e:
        raise TraceError(f"{path.name}: {e}") from None
    except (msgspec.MsgspecError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TraceError(f"summary file {path.name} is not JSON lines ({str(e)[:120]})") from None
    meta, rows = None, []
    for line in lines:
        if line.meta is not None:
            meta = line.meta  # the last one counts
        elif line.step is None or line.start_us is None or line.end_us is None:
            raise TraceError(f"{path.name}: a line is neither a step (step, start_us, end_us) nor metadata")
        else:
            rows.append(line)
    if not isinstance(meta, dict) or meta.get("format") != fmt.FORMAT:
        raise TraceError(f"{path.name} is not a ddpscope summary (no ddpscope metadata)")
    check_version(meta, path.name)
    version = meta.get("summary_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= fmt.SUMMARY_VERSION:
        raise TraceError(f"{path.name} has summary version {version!r}; this ddpscope reads up to "
                         f"{fmt.SUMMARY_VERSION}")
    check_meta(meta, path.name)
    if int(meta["rank"]) != rank:
        raise TraceError(f"{path.name} says it is rank {meta.get('rank')}")
    if meta.get("status") == fmt.RUNNING:
        meta = {**meta, "steps": len(rows)}
    return meta, rows


def clock_params(meta: dict) -> tuple[float, float, float]:
    """``(offset, slope, at)``: t on this rank's clock is ``t + offset + slope * (t - at)``
    on rank 0's (µs), from the start and end estimates of the offset. Each is exact to half
    its round trip (``rtt_us``), so a drift (the slope between them) is taken only where
    the offset moved by more than those bounds together allow. Where it did not (ranks on
    one host, whose clock is one; a short run, whose estimates' noise would be read as
    drift: a 5-step run on a loaded machine read a slope of ~2e-3, every span stretched by
    it), the offset is the middle of the range both estimates allow, and no slope."""
    co = meta.get("clock_offset") or {}
    start, end = co.get("start"), co.get("end")
    if not start:
        return 0.0, 0.0, 0.0
    o0, at0 = float(start["offset_us"]), float(start["at_us"])
    if not end or end["at_us"] == start["at_us"]:
        return o0, 0.0, at0
    o1 = float(end["offset_us"])
    h0, h1 = (float(e.get("rtt_us") or 0.0) / 2 for e in (start, end))
    if abs(o1 - o0) <= h0 + h1:  # no drift measurable: both bounds hold one offset
        return (max(o0 - h0, o1 - h1) + min(o0 + h0, o1 + h1)) / 2, 0.0, at0
    return o0, (o1 - o0) / (float(end["at_us"]) - at0), at0


def clock_alignment(meta: dict):
    """t (this rank's µs) -> t on rank 0's clock (``clock_params``); works on arrays too."""
    offset, slope, at = clock_params(meta)
    return lambda t: t + offset + slope * (t - at)
