"""Uploaded traces: a .zip or .tar(.gz) of a run folder, unpacked safely.

Nothing escapes the destination: members with absolute paths, ``..``, links or devices
are refused, as are archives whose contents exceed the size cap. Only trace files are
kept (``run.json``, ``rank-<r>.json``, and profiler traces ``*.json[.gz]``), from the
archive's root or one folder down (a profiled run's ``profile/`` folder too). A single profiler trace (``.json``/``.json.gz``, not an
archive) is kept as a folder of one rank.
"""

from __future__ import annotations

import io
import re
import tarfile
import zipfile
from pathlib import Path, PurePosixPath

from tracer import format as fmt
from viz.profile_check import PROFILE_DIR
from viz.sources.kineto_file import FILE_RE
from viz.trace import TraceError

MAX_UNPACKED_BYTES = 512 * 2**20
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(name: str, fallback: str = "upload") -> str:
    """A folder name made only of letters, digits, '.', '_' and '-' (no '..')."""
    cleaned = _SAFE.sub("-", name).strip(".-")[:80]
    return cleaned or fallback


def _wanted(member: str) -> str | None:
    p = PurePosixPath(member)
    if p.is_absolute() or ".." in p.parts:
        raise TraceError(f"the archive holds an unsafe path ({member}); refused")
    if len(p.parts) >= 2 and p.parts[-2] == PROFILE_DIR and len(p.parts) <= 3 and FILE_RE.match(p.name):
        return f"{PROFILE_DIR}/{p.name}"  # a profiled run's torch.profiler traces stay beside it
    if len(p.parts) > 2:
        return None
    return p.name if (p.name == fmt.RUN_FILE or fmt.RANK_FILE_RE.match(p.name) or FILE_RE.match(p.name)) else None


def extract_run_archive(data: bytes, filename: str, dest: Path) -> Path:
    """Unpack an uploaded archive's trace files into the new folder ``dest``."""
    files: dict[str, bytes] = {}
    total = 0
    if FILE_RE.match(filename) and not zipfile.is_zipfile(io.BytesIO(data)):  # one profiler trace file
        if len(data) > MAX_UNPACKED_BYTES:
            raise TraceError(f"{filename} is over {MAX_UNPACKED_BYTES // 2**20} MiB")
        dest.mkdir(parents=True, exist_ok=False)
        (dest / safe_name(PurePosixPath(filename).name)).write_bytes(data)
        return dest
    try:
        if zipfile.is_zipfile(io.BytesIO(data)):
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    name = _wanted(info.filename)
                    if name is None or info.is_dir():
                        continue
                    total += info.file_size
                    if total > MAX_UNPACKED_BYTES:
                        raise TraceError(f"{filename} unpacks to more than {MAX_UNPACKED_BYTES // 2**20} MiB")
                    files[name] = z.read(info)
        else:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as t:
                for m in t.getmembers():
                    name = _wanted(m.name)
                    if name is None:
                        continue
                    if not m.isfile():
                        raise TraceError(f"the archive's {m.name} is a link or device; refused")
                    total += m.size
                    if total > MAX_UNPACKED_BYTES:
                        raise TraceError(f"{filename} unpacks to more than {MAX_UNPACKED_BYTES // 2**20} MiB")
                    files[name] = t.extractfile(m).read()
    except (zipfile.BadZipFile, tarfile.TarError, EOFError, OSError):
        raise TraceError(f"{filename} is not a readable .zip or .tar(.gz) archive") from None
    if not any(fmt.RANK_FILE_RE.match(n) or (FILE_RE.match(n) and n != fmt.RUN_FILE) for n in files):
        raise TraceError(f"{filename} holds no rank-<r>.json trace files and no profiler traces")
    dest.mkdir(parents=True, exist_ok=False)
    for name, blob in files.items():
        (dest / name).parent.mkdir(exist_ok=True)
        (dest / name).write_bytes(blob)
    return dest
