"""The compiled capture's build, from the launcher's side (torch-free): built in a
subprocess before any rank starts, so no traced step pays for it, and said in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Callable

from ddpscope.tracer.capture.native import build as native

BUILD_TIMEOUT_S = 900.0


def build_native(say: Callable[[str], None]) -> dict:
    """Build the extension unless it is built; ``say`` gets one line (what happened).
    Returns ``ensure_built``'s dict; never raises."""
    try:
        lib = native.built_library()
    except Exception as e:  # noqa: BLE001 - no torch installed, an unreadable cache
        return _not_built(say, f"{type(e).__name__}: {e}")
    if lib is not None:
        return {"ok": True, "built": False, "seconds": 0.0, "library": str(lib)}
    say(f"ddpscope: building the compiled capture for this torch, once (into {native.cache_root()}) ...")
    try:
        proc = subprocess.run([sys.executable, "-m", "ddpscope.tracer.capture.native.build"], capture_output=True,
                              text=True, timeout=BUILD_TIMEOUT_S)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as e:
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    if not result.get("ok"):
        return _not_built(say, result.get("error", "unknown error"))
    say(f"ddpscope: compiled capture built in {result['seconds']:.0f} s: {result['library']}")
    return result


def _not_built(say: Callable[[str], None], error: str) -> dict:
    say(f"ddpscope: the compiled capture could not be built ({error[:300]}); the Python hook times the buckets")
    return {"ok": False, "error": error}
