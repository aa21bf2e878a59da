"""Writing traces: appended off the training thread; small files atomically.

``TraceWriter`` keeps one rank's Chrome trace on disk, readable after every flush. The
file is the trace format's *array* form (``tracer/format.py``), which may stay
unterminated while it grows: ``[``, then each flush's events on one line, and a
metadata event whenever the metadata changed; ``close`` appends the final metadata and
``]``. A flush appends only what is new, so it costs what the steps since the last one
cost, however long the run (rewriting the whole file, as version 1 did, cost a flush
O(run length): seconds of a core per flush after some thousand steps).

The training thread encodes each finished step's events once, between steps (msgspec:
~0.4 µs an event, 20x ``json.dumps``); a background thread appends them (I/O, which
releases the GIL). A run that dies leaves every flush before readable (a torn last line
is dropped by the reader), its metadata saying ``running``.

Beside the events, a writer given a ``summary_path`` keeps the rank's *summary*
(``rank-<r>.summary.jsonl``): one JSON line per step, folded from the step's events
as they are added (``tracer/step_summary.py``), and a ``{"meta": ...}`` line whenever
the metadata changed (without the per-parameter lists, which ``run.json`` holds). It
is appended at the same flushes, so a viewer of a thousand ranks reads a few KB a rank
instead of every event (see docs/many-ranks.md).
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Iterable

import msgspec

from ddpscope.tracer import format as fmt
from ddpscope.tracer.step_summary import summarize_steps

_SEP = (",", ":")


def write_bytes_atomic(path: Path, chunks: Iterable[bytes]) -> None:
    """Write ``chunks`` to ``path`` so readers see the old file or the new one, never half."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json_atomic(path: Path, obj: object) -> None:
    write_bytes_atomic(path, [json.dumps(obj, indent=1).encode()])


def read_json(path: Path) -> dict:
    with open(path, "rb") as f:
        return json.load(f)


def read_records(folder: Path, pattern: str, key: str) -> dict[int, dict]:
    """The JSON objects in ``folder``'s files matching ``pattern``, by their integer field
    ``key`` (live files by rank, node records by node); unreadable ones left out: their
    writers replace them atomically, so a bad one is another tool's, or being made."""
    found: dict[int, dict] = {}
    if not Path(folder).is_dir():
        return found
    for p in Path(folder).glob(pattern):
        try:
            data = json.loads(p.read_text())
            found[int(data[key])] = data
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def update_run_json(out: str | os.PathLike, fields: dict) -> None:
    """Merge ``fields`` into the run folder's ``run.json`` (others may have written facts),
    atomically; the folder is made if needed."""
    os.makedirs(out, exist_ok=True)
    path = Path(out) / fmt.RUN_FILE
    run = read_json(path) if path.exists() else {"format": fmt.FORMAT, "version": fmt.VERSION}
    run.update(fields)
    write_json_atomic(path, run)


class TraceWriter:
    """One rank's trace file, appended to by a background thread.

    ``add`` and ``set_meta`` never block on I/O. ``close`` writes the end in the caller's
    thread and raises ``OSError`` if any write failed (then nothing more is written: the
    file keeps what was appended whole before).
    """

    def __init__(self, path: Path, meta: dict, min_interval_s: float = 0.05, summary_path: Path | None = None
                 ) -> None:
        self.path = Path(path)
        self.summary_path = Path(summary_path) if summary_path is not None else None
        self._meta = dict(meta)
        self._pid = int(meta.get("rank", 0) or 0)
        self._pending: list[bytes] = []  # each: events "e1,e2,..." of one add(), encoded
        self._pending_summary: list[bytes] = []  # each: the summary lines of one add(), encoded
        self._meta_changed = False
        self._closed = False
        self._closing = threading.Event()  # set by close(): ends the writer's interval sleep
        self._error: OSError | None = None
        self._min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._io_lock = threading.Lock()  # one writer of the file at a time
        # the file exists (no events, status running) before training starts: made whole, then renamed
        write_bytes_atomic(self.path, [b"[\n", self._meta_line()])
        if self.summary_path is not None:
            try:
                write_bytes_atomic(self.summary_path, [self._summary_meta_line()])
            except BaseException:
                self.path.unlink(missing_ok=True)
                raise
        self._thread = threading.Thread(target=self._loop, name="ddpscope-writer", daemon=True)
        self._thread.start()

    def add(self, events: Iterable[dict]) -> None:
        """Hand over finished events. They are encoded here, on the caller's thread, between
        steps: encoding on the writer's thread would compete with the next step for the
        GIL and the CPU, and distort the very timings being traced. Only I/O is deferred."""
        events = list(events)
        encoded = _ENCODER.encode(events)[1:-1]  # "[e1,e2]" -> "e1,e2"
        if not encoded:
            return
        summary = self._summarize(events) if self.summary_path is not None else b""
        with self._cond:
            self._pending.append(encoded)
            if summary:
                self._pending_summary.append(summary)
            self._cond.notify()

    def _summarize(self, events: list) -> bytes:
        """The summary lines of ``events`` (whole steps: what the recorders hand over). A
        fold that fails (a bug of ours) ends the summary, said once; the events go on."""
        try:
            return b"".join(_ENCODER.encode(row) + b"\n" for row in summarize_steps(events))
        except (KeyError, TypeError, ValueError) as e:
            print(f"ddpscope: cannot summarise the steps of {self.path.name} ({type(e).__name__}: {e}); "
                  f"{self.summary_path.name} is removed, the events go on", file=sys.stderr, flush=True)
            with self._io_lock:
                self.summary_path.unlink(missing_ok=True)
                self.summary_path = None
            return b""

    def unlink(self) -> None:
        """Remove the files (a trace that holds no step: no file says otherwise)."""
        self.path.unlink(missing_ok=True)
        if self.summary_path is not None:
            self.summary_path.unlink(missing_ok=True)

    @property
    def error(self) -> OSError | None:
        """The write that failed (then the file on disk is the last one written whole)."""
        return self._error

    def set_meta(self, **fields) -> None:
        """Update the metadata; appended (whole, as a metadata event) at the next flush."""
        with self._cond:
            self._meta.update(fields)
            self._meta_changed = True
            self._cond.notify()

    def close(self, **final_meta) -> None:
        with self._cond:
            self._meta.update(final_meta)
            self._meta_changed = True
            self._closed = True
            self._cond.notify()
        self._closing.set()
        self._thread.join()
        if self._error is None:  # after a failed write nothing more: the file may end in a torn line
            try:
                self._flush(final=True)
            except OSError as e:
                self._error = e
        if self._error is not None:
            raise OSError(f"could not write trace {self.path}: {self._error}") from self._error

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._meta_changed) and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                self._flush()
            except OSError as e:  # never raise into training; the tracer stops at its next step
                print(f"ddpscope: cannot write {self.path} ({e.strerror or e}): tracing stops here, "
                      "training goes on", file=sys.stderr, flush=True)
                self._error = e
                return
            # Coalesce steps: sleep the interval out whatever add() says meanwhile (waking
            # at each step's notify would cost the training thread a flush a step).
            self._closing.wait(self._min_interval_s)

    def _meta_line(self) -> bytes:
        return _ENCODER.encode({"name": fmt.META_EVENT, "ph": "M", "pid": self._pid, "args": self._meta})

    def _summary_meta_line(self) -> bytes:
        meta = {k: v for k, v in self._meta.items() if k not in fmt.SUMMARY_META_LEFT_OUT}
        return _ENCODER.encode({"meta": {**meta, "summary_version": fmt.SUMMARY_VERSION}}) + b"\n"

    def _flush(self, final: bool = False) -> None:
        with self._io_lock:
            with self._cond:
                chunks, self._pending = self._pending, []
                summary, self._pending_summary = self._pending_summary, []
                if self._meta_changed:
                    chunks.append(self._meta_line())
                    if self.summary_path is not None:
                        summary.append(self._summary_meta_line())
                    self._meta_changed = False
            data = b"".join(b",\n" + c for c in chunks) + (b"\n]\n" if final else b"")
            if data:
                _append(self.path, data)
            if summary and self.summary_path is not None:  # after the events: a summary never runs ahead
                _append(self.summary_path, b"".join(summary))


def _encodable(obj):
    """What msgspec does not encode itself, as ``json.dumps`` would have it: subclasses of
    str (``torch.__version__``), paths, numpy scalars."""
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot write a {type(obj).__name__} into a trace")


_ENCODER = msgspec.json.Encoder(enc_hook=_encodable)


def _append(path: Path, data: bytes) -> None:
    """Append ``data`` to the existing file ``path``: a file removed (or its folder) is an
    error here, not recreated with only this piece in it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
