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

import queue
import re
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Union

import msgspec
import numpy as np
import pandas as pd

from ddpscope.viz.run_files import MAX_FILE_BYTES
from ddpscope.viz.trace import TraceError

#: file names a Kineto trace folder may hold (torch.profiler's tensorboard_trace_handler
#: writes ``<worker>.<ts>.pt.trace.json[.gz]``; people rename them ``rank-0.json.gz``)
FILE_RE = re.compile(r".+\.json(\.gz)?$")
#: a rank in a file name: rank-3, rank_3, rank3, _r3, worker3 (only when the file does not say)
RANK_IN_NAME = re.compile(r"(?:rank|worker|_r)[-_]?(\d+)(?!.*(?:rank|worker|_r)[-_]?\d)", re.I)


# gc=False: these hold no reference cycles, and a trace is hundreds of thousands of them
# (the collector walking them while they are built doubled the decoding time)
class _Args(msgspec.Struct, gc=False):
    stream: int = -1  # -1: not on a GPU stream (HTA's convention)
    correlation: int = -1
    collective: str = msgspec.field(name="Collective name", default="")
    in_nelems: int | None = msgspec.field(name="In msg nelems", default=None)
    group_size: int | None = msgspec.field(name="Group size", default=None)
    dtype: str = ""
    pg: str = msgspec.field(name="Process Group Name", default="")
    # decoded for collectives only (an empty Raw when absent)
    dims: msgspec.Raw = msgspec.field(name="Input Dims", default_factory=msgspec.Raw)
    types: msgspec.Raw = msgspec.field(name="Input type", default_factory=msgspec.Raw)


#: categories of the GPU-side copies of ``record_function`` ranges (Kineto's spelling
#: has varied between versions)
_GPU_ANNOTATIONS = frozenset({"gpu_user_annotation", "gpu_user_Annotation"})


class _Event(msgspec.Struct, gc=False, tag_field="ph", tag="X"):
    """A complete event (phase ``X``), the only kind read."""

    cat: str = ""
    name: str = ""
    tid: int | str | None = None
    ts: float = float("nan")  # a timed event without ts is refused below
    dur: float = 0.0
    args: _Args | None = None


class _DistInfo(msgspec.Struct, gc=False):
    rank: int | None = None
    world_size: int | None = None
    backend: str | None = None


#: every other phase of the Trace Event Format, decoded to an empty struct: flow arrows and
#: metadata (a third of a profiler trace) cost no strings
_SKIPPED = tuple(msgspec.defstruct(f"_Phase{ord(c)}", [], tag_field="ph", tag=c, gc=False)
                 for c in "BEiIbneSTpFstfPCONDMVvRc()")
_AnyEvent = Union[(_Event, *_SKIPPED)]


class _File(msgspec.Struct, gc=False):
    traceEvents: list[_AnyEvent]
    distributedInfo: _DistInfo | None = None
    baseTimeNanoseconds: int | None = None
    deviceProperties: list[msgspec.Raw] | None = None


_DECODER = msgspec.json.Decoder(_File)
_EVENTS = msgspec.json.Decoder(list[_AnyEvent])
_SHAPES = msgspec.json.Decoder(list)
_TYPES = msgspec.json.Decoder(list)
#: CPU-side spans of a collective: ``gloo:all_reduce`` (the run on gloo's worker thread),
#: ``nccl:all_reduce`` (the enqueue on the CPU), ...
COMM_PREFIXES = ("gloo:", "nccl:", "mpi:", "ucc:", "hccl:")
#: decompressed bytes decoded at a time: memory stays near this, not the file's size
CHUNK_BYTES = 2**20
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')
#: between two events of the list (``}, {``); inside an event only within a string, and
#: a cut there leaves JSON that does not decode: the piece then waits for more bytes
_BETWEEN = re.compile(rb"\}\s*,\s*(?=\{)")
#: HTA 0.5.0 rounds a file's times when pandas makes its ``ts`` column float64: some event's
#: ts is written as a float (``1000.0`` too: JSON keeps it a float) or an event has none
_TS_KEY = re.compile(rb'"ts"\s*:')
_TS_FLOAT = re.compile(rb'"ts"\s*:\s*-?\d*(?:\.|[eE])')


class _TsColumn:
    """What HTA's ``ts`` column would be: events seen, ``"ts"`` keys among them, a float."""

    def __init__(self) -> None:
        self.events = self.keys = 0
        self.floats = False

    def add(self, raw: bytes, events: int) -> None:
        self.events += events
        self.keys += len(_TS_KEY.findall(raw))
        self.floats = self.floats or _TS_FLOAT.search(raw) is not None

    @property
    def float64(self) -> bool:
        return self.floats or self.keys < self.events


def _shapes_of(a: _Args | None) -> tuple[list, list] | None:
    """(Input Dims, Input type) of a CPU-side collective, or None when absent or odd."""
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
      annotations): ``cpu_op`` (its category is ``cpu_op``), ``name``, ``tid`` (a code per
      thread), ``ts``, ``dur``, ``correlation`` (-1 if none), ``shapes`` (op index ->
      input dims and types, for CPU-side collectives)
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
    hta_rounds: bool  # HTA 0.5.0 rounds this file's times to whole µs (``_TsColumn``: its ts column is float64)


def _inflate(path: Path, cap: int) -> Iterator[bytes]:
    """The file's bytes in pieces of at most ``CHUNK_BYTES``, gunzipped when it is gzip
    (several members too); more than ``cap`` bytes once decompressed (the bytes actually
    produced, not a header's claim) is refused."""
    total = 0
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
            f.seek(0)
            d = zlib.decompressobj(wbits=31) if gz else None
            while raw := f.read(CHUNK_BYTES):
                while raw:
                    if d is None:
                        out, raw = raw, b""
                    else:
                        if d.eof:  # the next gzip member
                            d = zlib.decompressobj(wbits=31)
                        out = d.decompress(raw, CHUNK_BYTES)  # bounded: a small bomb stays small
                        raw = d.unconsumed_tail or d.unused_data
                    total += len(out)
                    if total > cap:
                        raise TraceError(f"{path.name} is over the {cap // 2**20} MiB limit once decompressed")
                    if out:
                        yield out
            if d is not None and not d.eof:
                raise TraceError(f"{path.name} is a truncated or corrupt gzip file")
    except zlib.error:
        raise TraceError(f"{path.name} is a truncated or corrupt gzip file") from None
    except OSError as e:
        raise TraceError(f"cannot read {path}: {e.strerror or e}") from None


def _pieces(path: Path, cap: int) -> Iterator[bytes]:
    """``_inflate`` run one piece ahead in a thread: zlib lets go of the GIL while it
    inflates, so decompressing overlaps decoding. The thread ends with the generator."""
    q: queue.Queue = queue.Queue(maxsize=2)
    stop = threading.Event()

    def produce():
        try:
            for piece in _inflate(path, cap):
                while not stop.is_set():
                    try:
                        q.put(piece, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(None)
        except TraceError as e:
            q.put(e)

    worker = threading.Thread(target=produce, name="ddpscope-inflate", daemon=True)
    worker.start()
    try:
        while True:
            item = q.get()
            if item is None:
                return
            if isinstance(item, TraceError):
                raise item
            yield item
    finally:
        stop.set()
        worker.join()


def read_bytes(path: Path, cap: int | None = None) -> bytes:
    """The whole file (gunzipped), within the size cap (default ``MAX_FILE_BYTES``)."""
    return b"".join(_pieces(path, MAX_FILE_BYTES if cap is None else cap))


class _Vocab:
    """Strings (or thread ids) as codes into one list: a trace names a few thousand kernels
    and ops hundreds of thousands of times, and each decoded name is a new string."""

    def __init__(self, flag=None):
        self.index: dict = {}
        self.flag = flag  # a test on each new word, kept in ``flagged`` (by code)
        self._flagged: list[bool] = []

    @property
    def flagged(self) -> np.ndarray:
        return np.array(self._flagged, bool)

    def codes(self, values) -> np.ndarray:
        codes, uniques = pd.factorize(np.array(values, dtype=object))
        remap = np.empty(len(uniques), np.int64)
        for n, u in enumerate(uniques):
            code = self.index.get(u)
            if code is None:
                code = self.index[u] = len(self.index)
                self._flagged.append(bool(self.flag and isinstance(u, str) and self.flag(u)))
            remap[n] = code
        return remap[codes] if len(codes) else np.empty(0, np.int64)

    def categorical(self, codes: list[np.ndarray]) -> pd.Categorical:
        flat = np.concatenate(codes) if codes else np.empty(0, np.int64)
        return pd.Categorical.from_codes(flat, categories=pd.Index(list(self.index), dtype=object), validate=False)


class _Columns:
    """Events decoded piece by piece, kept as columns (numbers as arrays, strings as codes)."""

    def __init__(self):
        self.ops: dict[str, list] = {k: [] for k in ("cpu_op", "name", "tid", "ts", "dur", "correlation")}
        self.gpu: dict[str, list] = {k: [] for k in ("name", "stream", "ts", "dur", "correlation", "collective",
                                                     "nelems", "dtype", "group_size", "pg")}
        self.shapes: dict[int, tuple | None] = {}  # op index -> (dims, types): CPU-side collectives only
        self.n_ops = 0
        self.words, self.tids = _Vocab(flag=lambda w: w.startswith(COMM_PREFIXES)), _Vocab()

    def add(self, events: list[_Event]) -> None:
        # one comprehension per field: transposing a list of row tuples (zip(*rows)) cost
        # twice as much as all of these together
        # GPU-side copies of record_function ranges (newer Kineto on CUDA: a
        # ProfilerStep#N on each stream that ran its kernels) are neither CPU ops nor
        # kernels: read, they would give each step twice or count as compute (HTA's
        # analyses leave them out too)
        x = [e for e in events if type(e) is _Event and e.cat not in _GPU_ANNOTATIONS]
        if not x:
            return
        n = len(x)
        args = [e.args for e in x]
        ids = np.column_stack([np.fromiter((-1 if a is None else a.stream for a in args), np.int64, n),
                               np.fromiter((-1 if a is None else a.correlation for a in args), np.int64, n)])
        ts = np.fromiter((e.ts for e in x), float, n)
        dur = np.fromiter((e.dur for e in x), float, n)
        names = self.words.codes([e.name for e in x])
        on_gpu = (ids[:, 0] >= 0) & (ids[:, 1] >= 0)  # HTA's GPU events: a stream and a correlation id
        on_cpu = ~on_gpu
        if on_cpu.any():
            o = self.ops
            cpu = x if not on_gpu.any() else [x[i] for i in np.flatnonzero(on_cpu)]
            o["cpu_op"].append(np.fromiter((e.cat == "cpu_op" for e in cpu), bool, len(cpu)))
            o["name"].append(names[on_cpu])
            o["tid"].append(self.tids.codes([e.tid for e in cpu]))
            o["ts"].append(ts[on_cpu])
            o["dur"].append(dur[on_cpu])
            o["correlation"].append(ids[on_cpu, 1])
            cpu_at = np.flatnonzero(on_cpu)
            for i in np.flatnonzero(self.words.flagged[o["name"][-1]]):  # few: the CPU-side collectives
                self.shapes[self.n_ops + int(i)] = _shapes_of(args[cpu_at[i]])
            self.n_ops += len(cpu_at)
        if on_gpu.any():
            at = np.flatnonzero(on_gpu)
            g = self.gpu
            g["name"].append(names[at])
            g["stream"].append(ids[at, 0])
            g["ts"].append(ts[at])
            g["dur"].append(dur[at])
            g["correlation"].append(ids[at, 1])
            gargs = [args[i] for i in at]
            g["collective"].append(self.words.codes([a.collective for a in gargs]))
            g["nelems"].append(np.array([a.in_nelems for a in gargs], float))  # None -> NaN
            g["dtype"].append(self.words.codes([a.dtype for a in gargs]))
            g["group_size"].append(np.array([a.group_size for a in gargs], float))
            g["pg"].append(self.words.codes([a.pg for a in gargs]))

    def arrays(self) -> tuple[dict, dict]:
        """(ops, gpu): numbers as arrays, strings as ``pd.Categorical``, thread ids as codes,
        ``ops["shapes"]`` a dict from op index to its (dims, types)."""
        def numbers(parts, dtype):
            return np.concatenate(parts) if parts else np.empty(0, dtype)

        ops = {k: numbers(self.ops[k], t) for k, t in (("ts", float), ("dur", float), ("correlation", np.int64),
                                                        ("tid", np.int64), ("cpu_op", bool))}
        ops["name"] = self.words.categorical(self.ops["name"])
        ops["shapes"] = self.shapes
        gpu = {k: numbers(self.gpu[k], t) for k, t in (("stream", np.int64), ("ts", float), ("dur", float),
                                                        ("correlation", np.int64), ("nelems", float),
                                                        ("group_size", float))}
        for k in ("name", "collective", "dtype", "pg"):
            gpu[k] = self.words.categorical(self.gpu[k])
        return ops, gpu


def read_kineto_file(path: Path, cap: int | None = None) -> KinetoFile:
    """Decode a Kineto trace, a piece of its event list at a time; wrong types, bad JSON
    or no event list are one ``TraceError``."""
    cap = MAX_FILE_BYTES if cap is None else cap
    cols = _Columns()
    ts_column = _TsColumn()
    buf = b""
    header: bytes | None = None
    try:
        for piece in _pieces(path, cap):
            buf += piece
            if header is None:
                m = _EVENTS_KEY.search(buf)
                if m is None:
                    continue
                header, buf = buf[:m.start()], buf[m.end():]
            cut = None
            for cut in _BETWEEN.finditer(buf, max(0, len(buf) - 2**16)):
                pass
            if cut is None:
                continue
            try:
                events = _EVENTS.decode(b"[" + buf[:cut.start() + 1] + b"]")
            except msgspec.DecodeError:
                continue  # cut inside a string: decode it with the next piece
            ts_column.add(buf[:cut.start() + 1], len(events))
            cols.add(events)
            del events
            buf = buf[cut.end():]
        if header is None:  # no event list found: decode it all, for the error (or an odd layout)
            f = head = _DECODER.decode(buf)
        else:
            f = _DECODER.decode(b'{"traceEvents":[' + buf)  # the last events and what follows them
            head = _DECODER.decode(header + b'"traceEvents":[]}')  # the fields before the event list
        ts_column.add(buf, len(f.traceEvents))  # what follows the list holds no "ts" of its own
        cols.add(f.traceEvents)
        ops, gpu = cols.arrays()
    except msgspec.ValidationError as e:
        raise TraceError(f"{path.name} is not a profiler trace: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise TraceError(f"{path.name} is not valid JSON (truncated, or not UTF-8 text?): {e}") from None
    except RecursionError:
        raise TraceError(f"{path.name} is nested too deeply to be a profiler trace") from None
    except OverflowError as e:  # an id or a count past 64 bits
        raise TraceError(f"{path.name} holds a number no 64-bit integer holds: {e}") from None
    for table in (ops, gpu):
        if len(table["ts"]) and not (np.isfinite(table["ts"]).all() and np.isfinite(table["dur"]).all()):
            raise TraceError(f"{path.name} has events with a non-finite ts or dur")
        if (table["dur"] < 0).any():
            raise TraceError(f"{path.name} has events with a negative duration")
    d = head.distributedInfo or f.distributedInfo
    return KinetoFile(path=path, rank=d.rank if d else None, world_size=d.world_size if d else None,
                      backend=d.backend if d else None,
                      base_time_ns=head.baseTimeNanoseconds or f.baseTimeNanoseconds,
                      devices=len(head.deviceProperties or f.deviceProperties or []), ops=ops, gpu=gpu,
                      hta_rounds=ts_column.float64)


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
