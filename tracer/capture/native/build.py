"""ddpscope's C++ extension (``timed_group.cpp``): built once per torch version and
source, into the user's cache folder, under a file lock; loaded by ranks without building.

    python -m ddpscope.tracer.capture.native.build      # what ``ddpscope build`` runs

The launcher builds it before any rank starts (``ensure_built`` in a subprocess: it
imports torch, the launcher does not), so a build (35-60 s on 2 cores) is never charged
to training; a rank only ``load_built()``s it (about 0.1 s) and, if it is not there,
traces through the Python path instead. Where it is built: ``$DDPSCOPE_CACHE`` or
``$XDG_CACHE_HOME/ddpscope`` or ``~/.cache/ddpscope``, then ``native/<key>/`` with the key
made of the torch version, the Python version and the source's hash: nodes that share a
home share one build.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

NAME = "ddpscope_timed_group"
SOURCE = Path(__file__).with_name("timed_group.cpp")
STAMP = "built.json"  # written last: the build is whole


def cache_root() -> Path:
    if os.environ.get("DDPSCOPE_CACHE"):
        return Path(os.environ["DDPSCOPE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ddpscope"


def build_dir() -> Path:
    """This torch's, this Python's and this source's build folder (torch not imported)."""
    torch_version = importlib.metadata.version("torch")
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return cache_root() / "native" / f"torch-{torch_version}-py{sys.version_info[0]}{sys.version_info[1]}-{digest}"


def built_library() -> Path | None:
    """The built extension's file, if a whole build is there (torch not imported)."""
    folder = build_dir()
    try:
        stamp = json.loads((folder / STAMP).read_text())
        lib = folder / stamp["library"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return lib if lib.is_file() else None


def load_built():
    """The extension module if it was built (import torch first); None if it was not."""
    lib = built_library()
    if lib is None:
        return None
    importlib.import_module("torch.distributed")  # the extension's types live there

    loader = importlib.machinery.ExtensionFileLoader(NAME, str(lib))
    spec = importlib.util.spec_from_file_location(NAME, lib, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def ensure_built(verbose: bool = False) -> dict:
    """Build unless built: ``{"ok", "built" (now), "seconds", "library"}`` or
    ``{"ok": False, "error": one line}``. Concurrent callers wait on one lock; the
    first builds, the others find it built."""
    try:
        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, even if we die
            lib = built_library()
            if lib is not None:
                return {"ok": True, "built": False, "seconds": round(time.monotonic() - t0, 2), "library": str(lib)}
            importlib.import_module("torch.distributed")
            from torch.utils import cpp_extension

            module = cpp_extension.load(NAME, sources=[str(SOURCE)], build_directory=str(folder),
                                        extra_cflags=["-O2"], verbose=verbose)
            lib = Path(module.__file__)
            tmp = folder / f".{STAMP}.{os.getpid()}"
            tmp.write_text(json.dumps({"library": lib.name, "torch": importlib.metadata.version("torch"),
                                       "seconds": round(time.monotonic() - t0, 1)}))
            os.replace(tmp, folder / STAMP)
            return {"ok": True, "built": True, "seconds": round(time.monotonic() - t0, 1), "library": str(lib)}
    except Exception as e:  # noqa: BLE001 - no compiler, a compile error, a read-only cache: one line
        text = " ".join(str(e).split())
        return {"ok": False, "error": f"{type(e).__name__}: {text[:300]}"}


def main() -> int:
    result = ensure_built(verbose="--verbose" in sys.argv)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
