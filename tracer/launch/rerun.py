"""A traced run again, with another bucket setting: what ``run.json`` says it was (the
demo or the script, its folder, ranks, steps, emulated nodes and link, capture path),
and how often it marked gradients, as ``RunConfig`` settings. Torch-free.

Used by ``ddpscope whatif RUN --apply`` and the What-if page's "apply" button.
"""

from __future__ import annotations

from pathlib import Path

from ddpscope.tracer.launch.runner import file_sha256
from ddpscope.tracer.options import DEMO_MODELS


def rerun_settings(run: dict) -> dict:
    """``RunConfig`` keyword arguments (all but ``out`` and the bucket settings) that rerun
    the DDP run ``run.json`` describes. ``ValueError``, one line, when it cannot be rerun
    here: not a DDP run, no script recorded, a run of real nodes, a script since removed."""
    kind = run.get("kind")
    if kind not in (None, "ddp"):
        raise ValueError(f"a {kind} run is not rerun with another bucket setting")
    nodes = whole_number(run.get("nnodes")) or 1
    emulation = run.get("emulation") if isinstance(run.get("emulation"), dict) else None
    if nodes > 1 and emulation is None:
        raise ValueError(f"this run had {nodes} real nodes: rerun it on them with the `ddpscope run` line printed")
    nproc = whole_number(run.get("nproc_per_node")) or (whole_number(run.get("world_size")) or 2) // nodes
    out: dict = {"nproc": max(nproc, 1)}
    steps = whole_number(run.get("steps_requested"))
    if steps:
        out["steps"] = steps
    if emulation is not None:
        if not whole_number(emulation.get("nodes")) or not isinstance(emulation.get("link"), str):
            raise ValueError("run.json's emulation record is malformed (nodes, link)")
        out.update(emulate_nodes=emulation["nodes"], link=emulation["link"])
    if run.get("capture_path_requested") in ("python", "compiled"):
        out["capture"] = run["capture_path_requested"]
    if whole_number(run.get("grad_marks_every")):  # a rerun compares like with like
        out["grad_marks_every"] = run["grad_marks_every"]
    script = run.get("script")
    if run.get("demo") in DEMO_MODELS or (not isinstance(script, dict) and run.get("model") in DEMO_MODELS):
        return {**out, "demo": run.get("demo") or run["model"]}
    if not (isinstance(script, dict) and isinstance(script.get("argv"), list) and script.get("cwd")):
        raise ValueError("run.json does not say which script ran (a run from an older ddpscope, or not from "
                         "`ddpscope run`): rerun it yourself with the setting printed")
    cwd = Path(str(script["cwd"]))
    if not cwd.is_dir():
        raise ValueError(f"the script's folder {cwd} is gone: rerun it yourself with the setting printed")
    return {**out, "script": [str(a) for a in script["argv"]], "cwd": cwd}


def whole_number(v) -> int | None:
    """A whole number > 0 from run.json, else None (a hand-edited file may hold anything)."""
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def script_changed(run: dict) -> bool:
    """Whether the traced script's file differs now from when it ran (its sha256)."""
    script = run.get("script")
    if not isinstance(script, dict) or not script.get("path") or not script.get("sha256"):
        return False
    path = Path(str(script["path"]))
    return not path.is_file() or file_sha256(path) != script["sha256"]
