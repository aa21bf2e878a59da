"""Uploaded traces: a .zip or .tar(.gz) of a run folder, unpacked safely.

Nothing escapes the destination: members with absolute paths, ``..``, links or devices
are refused, as are archives whose contents exceed the size cap. Only trace files are
kept (``run.json``, ``rank-<r>.json``, and profiler traces ``*.json[.gz]``), from the
archive's root or one folder down (a profiled run's ``profile/`` folder too). A single profiler trace (``.json``/``.json.gz``, not an
archive) is kept as a folder of one rank.
"""

from __future__ import annotations

import io
import lzma
import re
import shutil
import tarfile
import zipfile
import zlib
from pathlib import Path, PurePosixPath

from ddpscope.tracer import format as fmt
from ddpscope.viz.sources.kineto_file import FILE_RE
from ddpscope.viz.trace import TraceError

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
    if len(p.parts) >= 2 and p.parts[-2] == fmt.PROFILE_DIR and len(p.parts) <= 3 and FILE_RE.match(p.name):
        return f"{fmt.PROFILE_DIR}/{p.name}"  # a profiled run's torch.profiler traces stay beside it
    if len(p.parts) > 2:
        return None
    return p.name if (p.name == fmt.RUN_FILE or fmt.RANK_FILE_RE.match(p.name) or fmt.SUMMARY_FILE_RE.match(p.name)
                      or FILE_RE.match(p.name)) else None


def extract_run_archive(data: bytes, filename: str, dest: Path) -> Path:
    """Unpack an uploaded archive's trace files into the new folder ``dest``."""
    files: dict[str, bytes] = {}
    if FILE_RE.match(filename) and not zipfile.is_zipfile(io.BytesIO(data)):  # one profiler trace file
        if len(data) > MAX_UNPACKED_BYTES:
            raise TraceError(f"{filename} is over {MAX_UNPACKED_BYTES // 2**20} MiB")
        dest.mkdir(parents=True, exist_ok=False)
        (dest / safe_name(PurePosixPath(filename).name)).write_bytes(data)
        return dest
    budget = [MAX_UNPACKED_BYTES]

    def read(stream) -> bytes:
        """A member's bytes, counted as they are inflated against the cap (an archive's
        own size fields are never trusted)."""
        parts = []
        while chunk := stream.read(1 << 20):
            budget[0] -= len(chunk)
            if budget[0] < 0:
                raise TraceError(f"{filename} unpacks to more than {MAX_UNPACKED_BYTES // 2**20} MiB")
            parts.append(chunk)
        return b"".join(parts)

    try:
        if zipfile.is_zipfile(io.BytesIO(data)):
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    name = _wanted(info.filename)
                    if name is None or info.is_dir():
                        continue
                    with z.open(info) as member:
                        files[name] = read(member)
        else:
            # stream mode: one pass, no seeking back through a compressed stream
            with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as t:
                for m in t:
                    name = _wanted(m.name)
                    if name is None:
                        continue
                    if not m.isfile():
                        raise TraceError(f"the archive's {m.name} is a link or device; refused")
                    files[name] = read(t.extractfile(m))
    except TraceError:
        raise
    except (zipfile.BadZipFile, zipfile.LargeZipFile, tarfile.TarError, EOFError, OSError, zlib.error, lzma.LZMAError,
            ValueError, NotImplementedError):
        raise TraceError(f"{filename} is not a readable .zip or .tar(.gz) archive (corrupt or truncated)") from None
    except RuntimeError as e:  # zipfile: an encrypted member
        raise TraceError(f"{filename} cannot be unpacked: {str(e).splitlines()[0][:120]}") from None
    if not any(fmt.RANK_FILE_RE.match(n) or fmt.SUMMARY_FILE_RE.match(n) or (FILE_RE.match(n) and n != fmt.RUN_FILE)
               for n in files):
        raise TraceError(f"{filename} holds no rank-<r>.json trace files and no profiler traces")
    # unpacked beside, then renamed: a folder in the runs list is always whole
    tmp = dest.with_name(f".{dest.name}.unpacking")
    try:
        tmp.mkdir(parents=True, exist_ok=False)
        for name, blob in files.items():
            (tmp / name).parent.mkdir(exist_ok=True)
            (tmp / name).write_bytes(blob)
        tmp.rename(dest)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise TraceError(f"cannot store {filename}: {e.strerror or e}") from None
    return dest
