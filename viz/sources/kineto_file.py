"""One PyTorch profiler (Kineto) trace file, decoded into columns.

Kineto writes Chrome Trace Event JSON (often gzipped, one file per rank). Only the fields
ddpscope uses are decoded, with types checked by ``msgspec`` (a field of the wrong type
is one ``TraceError`` line, never a half-read file): events of phase ``X`` with their
category, name, thread, ``ts``/``dur`` (µs, floats: newer Kineto writes ns resolution)
and the few ``args`` that tie a GPU kernel to its launch (``correlation``, ``stream``) and
describe a collective (``Collective name``, ``In msg nelems``, ``dtype``, ``Group size``).
Everything else in a file is skipped while decoding, not built and thrown away: that is
where the speed and the memory of ``benchmarks/kineto.py`` come from.
"""

from __future__ import annotations

import gzip
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import msgspec
import numpy as np

from viz.trace import MAX_FILE_BYTES, TraceError

#: file names a Kineto trace folder may hold (torch.profiler's tensorboard_trace_handler
#: writes ``<worker>.<ts>.pt.trace.json[.gz]``; people rename them ``rank-0.json.gz``)
FILE_RE = re.compile(r".+\.json(\.gz)?$")
#: a rank in a file name: rank-3, rank_3, rank3, _r3, worker3 (only when the file does not say)
RANK_IN_NAME = re.compile(r"(?:rank|worker|_r)[-_]?(\d+)(?!.*(?:rank|worker|_r)[-_]?\d)", re.I)


class _Args(msgspec.Struct):
    stream: int | None = None
    correlation: int | None = None
    collective: str | None = msgspec.field(name="Collective name", default=None)
    in_nelems: int | None = msgspec.field(name="In msg nelems", default=None)
    group_size: int | None = msgspec.field(name="Group size", default=None)
    dtype: str | None = None
    pg: str | None = msgspec.field(name="Process Group Name", default=None)
    # decoded for collectives only (an empty Raw when absent)
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default_factory=msgspec.Raw)
    types: msgspec.Raw = msgspec.field(name="Input type", default_factory=msgspec.Raw)


class _Event(msgspec.Struct):
    ph: str = ""
    cat: str | None = None
    name: str = ""
    tid: int | str | None = None
    ts: float | None = None
    dur: float | None = None
    args: _Args | None = None


class _DistInfo(msgspec.Struct):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None


class _File(msgspec.Struct):
    traceEvents: list[_Event]
    distributedInfo: _DistInfo | None = None
    baseTimeNanoseconds: int | None = None
    deviceProperties: list[msgspec.Raw] | None = None


_DECODER = msgspec.json.Decoder(_File)
_SHAPES = msgspec.json.Decoder(list)
_TYPES = msgspec.json.Decoder(list)
#: CPU-side spans of a collective: ``gloo:all_reduce`` (the run on gloo's worker thread),
#: ``nccl:all_reduce`` (the enqueue on the CPU), ...
COMM_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:", "hccl:")


def _shapes(e: _Event) -> tuple[list, list] | None:
    """(Input Dims, Input type) of a CPU-side collective, or None when absent or odd."""
    a = e.args
    if a is None or not len(a.dims) or not len(a.types):
        return None
    try:
        return _SHAPES.decode(a.dims), _TYPES.decode(a.types)
    except msgspec.MsgspecError:
        return None


@dataclass(frozen=True)
class KinetoFile:
    """One rank's profile as columns. Times are µs as written (the file's own clock).

    - ``ops``: phase-X events that are not on a GPU stream (CPU ops, runtime calls,
      annotations): ``cat``, ``name``, ``tid``, ``ts``, ``dur``, ``correlation`` (-1 if none)
    - ``gpu``: events on a GPU stream with a correlation id (kernels, memcpy, memset):
      ``name``, ``stream``, ``ts``, ``dur``, ``correlation``, ``collective``, ``nelems``,
      ``dtype``, ``group_size``, ``pg``
    """

    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    base_time_ns: int | None
    devices: int
    ops: dict[str, np.ndarray]
    gpu: dict[str, np.ndarray]
    float_times: bool  # ns-resolution timestamps (HTA rounds these to whole µs)


def read_bytes(path: Path, cap: int | None = None) -> bytes:
    """The file's bytes, gunzipped when it is gzip; more than ``cap`` bytes (default
    ``MAX_FILE_BYTES``) once decompressed (the bytes actually produced, not a header's
    claim) is refused."""
    cap = MAX_FILE_BYTES if cap is None else cap
    try:
        with open(path, "rb") as f:
            head = f.read(2)
            f.seek(0)
            if head == b"\x1f\x8b":
                with gzip.GzipFile(fileobj=f) as g:
                    data = g.read(cap + 1)
            else:
                data = f.read(cap + 1)
    except (EOFError, zlib.error, gzip.BadGzipFile):
        raise TraceError(f"{path.name} is a truncated or corrupt gzip file") from None
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror or e}") from None
    if len(data) > cap:
        raise TraceError(f"{path.name} is over the {cap // 2**20} MiB limit once decompressed")
    return data


def decode(data: bytes, path: Path) -> KinetoFile:
    """Decode a Kineto trace's JSON; wrong types or no event list are one ``TraceError``."""
    try:
        f = _DECODER.decode(data)
    except msgspec.ValidationError as e:
        raise TraceError(f"{path.name} is not a profiler trace: {e}") from None
    except msgspec.DecodeError as e:
        raise TraceError(f"{path.name} is not valid JSON (truncated?): {e}") from None
    ev = [e for e in f.traceEvents if e.ph == "X" and e.ts is not None]
    on_gpu = [e for e in ev if e.args is not None and e.args.stream is not None and e.args.correlation is not None
              and e.args.stream >= 0 and e.args.correlation >= 0]
    gpu_ids = {id(e) for e in on_gpu}
    cpu = [e for e in ev if id(e) not in gpu_ids]
    nan = float("nan")
    ops = {
        "cat": np.array([e.cat or "" for e in cpu], dtype=object),
        "name": np.array([e.name for e in cpu], dtype=object),
        "tid": np.array([str(e.tid) for e in cpu], dtype=object),
        "ts": np.array([e.ts for e in cpu], dtype=float),
        "dur": np.array([e.dur if e.dur is not None else 0.0 for e in cpu], dtype=float),
        "correlation": np.array([(e.args.correlation if e.args is not None and e.args.correlation is not None
                                  else -1) for e in cpu], dtype=np.int64),
        # a CPU-side collective (gloo:all_reduce, nccl:all_reduce): its input shapes and types
        "shapes": np.array([_shapes(e) if e.name.startswith(COMM_PREFIXES) else None for e in cpu], dtype=object),
    }
    gpu = {
        "name": np.array([e.name for e in on_gpu], dtype=object),
        "stream": np.array([e.args.stream for e in on_gpu], dtype=np.int64),
        "ts": np.array([e.ts for e in on_gpu], dtype=float),
        "dur": np.array([e.dur if e.dur is not None else 0.0 for e in on_gpu], dtype=float),
        "correlation": np.array([e.args.correlation for e in on_gpu], dtype=np.int64),
        "collective": np.array([e.args.collective or "" for e in on_gpu], dtype=object),
        "nelems": np.array([e.args.in_nelems if e.args.in_nelems is not None else nan for e in on_gpu], dtype=float),
        "dtype": np.array([e.args.dtype or "" for e in on_gpu], dtype=object),
        "group_size": np.array([e.args.group_size if e.args.group_size is not None else nan for e in on_gpu],
                               dtype=float),
        "pg": np.array([e.args.pg or "" for e in on_gpu], dtype=object),
    }
    for table in (ops, gpu):
        if len(table["ts"]) and not (np.isfinite(table["ts"]).all() and np.isfinite(table["dur"]).all()):
            raise TraceError(f"{path.name} has events with a non-finite ts or dur")
        if (table["dur"] < 0).any():
            raise TraceError(f"{path.name} has events with a negative duration")
    d = f.distributedInfo
    float_times = bool(np.any(ops["ts"] % 1) or np.any(gpu["ts"] % 1))
    return KinetoFile(path=path, rank=d.rank if d else None, world_size=d.world_size if d else None,
                      backend=d.backend if d else None, base_time_ns=f.baseTimeNanoseconds,
                      devices=len(f.deviceProperties or []), ops=ops, gpu=gpu, float_times=float_times)


def read_kineto_file(path: Path, cap: int | None = None) -> KinetoFile:
    return decode(read_bytes(path, cap), path)


def rank_from_name(name: str) -> int | None:
    m = RANK_IN_NAME.search(name)
    return int(m.group(1)) if m else None


def peek_text(path: Path, n: int = 16384) -> str:
    """The first ``n`` characters of a (possibly gzipped) file, for telling formats
    apart: as much as can be read of a truncated or corrupt one; empty if unreadable."""
    try:
        with open(path, "rb") as f:
            raw = f.read(n if not path.name.endswith(".gz") else 4 * n)
    except OSError:
        return ""
    if raw[:2] == b"\x1f\x8b":
        try:  # a decompressor fed what there is: no error for a stream that stops early
            raw = zlib.decompressobj(wbits=31).decompress(raw, n)
        except zlib.error:
            return ""
    return raw[:n].decode("utf-8", "replace")
