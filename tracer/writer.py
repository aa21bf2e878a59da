"""Writing traces: atomically (temporary file, then rename), off the training thread.

``TraceWriter`` keeps one rank's Chrome trace on disk, complete and valid after every
step: the training thread encodes each finished step's events once (between steps); a
background thread rewrites the file atomically (I/O only, which releases the GIL). A run that
dies therefore leaves every step that was handed over readable, with ``status`` still
``running`` (or ``failed``) in the metadata.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Iterable

from tracer import format as fmt

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


def update_run_json(out: str | os.PathLike, fields: dict) -> None:
    """Merge ``fields`` into the run folder's ``run.json`` (others may have written facts),
    atomically; the folder is made if needed."""
    os.makedirs(out, exist_ok=True)
    path = Path(out) / fmt.RUN_FILE
    run = read_json(path) if path.exists() else {"format": fmt.FORMAT, "version": fmt.VERSION}
    run.update(fields)
    write_json_atomic(path, run)


class TraceWriter:
    """One rank's trace file, rewritten atomically in a background thread.

    ``add`` and ``set_meta`` never block on I/O. ``close`` writes the final version in
    the caller's thread and raises ``OSError`` if any write failed.
    """

    def __init__(self, path: Path, meta: dict, min_interval_s: float = 0.05) -> None:
        self.path = Path(path)
        self._meta = dict(meta)
        self._pending: list[bytes] = []
        self._encoded: list[bytes] = []
        self._dirty = True
        self._closed = False
        self._error: OSError | None = None
        self._min_interval_s = min_interval_s
        self._cond = threading.Condition()
        self._io_lock = threading.Lock()  # one writer of the file at a time
        self._flush()  # the file exists (empty, status running) before training starts
        self._thread = threading.Thread(target=self._loop, name="ddpscope-writer", daemon=True)
        self._thread.start()

    def add(self, events: Iterable[dict]) -> None:
        """Hand over finished events. They are encoded here, on the caller's thread, between
        steps: encoding on the writer's thread would compete with the next step for the
        GIL and the CPU, and distort the very timings being traced. Only I/O is deferred."""
        encoded = [json.dumps(e, separators=_SEP).encode() for e in events]
        with self._cond:
            self._pending.extend(encoded)
            self._dirty = True
            self._cond.notify()

    @property
    def error(self) -> OSError | None:
        """The write that failed (then the file on disk is the last one written whole)."""
        return self._error

    def set_meta(self, **fields) -> None:
        with self._cond:
            self._meta.update(fields)
            self._dirty = True
            self._cond.notify()

    def close(self, **final_meta) -> None:
        with self._cond:
            self._meta.update(final_meta)
            self._closed = True
            self._dirty = True
            self._cond.notify()
        self._thread.join()
        try:
            self._flush()
        except OSError as e:
            self._error = e
        if self._error is not None:
            raise OSError(f"could not write trace {self.path}: {self._error}") from self._error

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._dirty and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                self._flush()
            except OSError as e:  # never raise into training; the tracer stops at its next step
                if self._error is None:
                    print(f"ddpscope: cannot write {self.path} ({e.strerror or e}): tracing stops here, "
                          "training goes on", file=sys.stderr, flush=True)
                self._error = e
                return
            with self._cond:
                self._cond.wait(self._min_interval_s)  # coalesce bursts of steps

    def _flush(self) -> None:
        with self._io_lock:
            with self._cond:
                events, self._pending = self._pending, []
                meta = json.dumps(self._meta, separators=_SEP).encode()
                self._dirty = False
            self._encoded.extend(events)
            write_bytes_atomic(
                self.path,
                [
                    b'{"traceEvents":[\n',
                    b",\n".join(self._encoded),
                    b'\n],"displayTimeUnit":"ms","otherData":{"ddpscope":',
                    meta,
                    b"}}\n",
                ],
            )
