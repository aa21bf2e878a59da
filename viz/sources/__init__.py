"""Trace sources: the one place that tells what a folder holds and loads it.

A folder is one of
- a ddpscope run (``run.json`` + ``rank-<r>.json`` written by the tracer): ``"ddp"``,
  ``"ring"`` or ``"zero"`` as its ``run.json`` says (``viz.trace``, ``viz.ring.trace``,
  ``viz.zero.trace``);
- PyTorch profiler (Kineto) traces, one file per rank (``*.json``, ``*.json.gz``,
  ``*.pt.trace.json[.gz]``): ``"kineto"`` (``viz.sources.kineto``);
- both at once: ``"mixed"``, which loads as one readable error.

``load_training_trace`` returns the ``RunTrace`` every DDP metric and figure takes, for
ddpscope's own runs and profiler traces alike (``trace.source`` says which).
"""

from __future__ import annotations

from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.viz.run_files import read_json_file, run_kind
from ddpscope.viz.sources.kineto import KIND as KINETO
from ddpscope.viz.sources.kineto import kineto_files, load_kineto
from ddpscope.viz.sources.kineto_file import peek_text
from ddpscope.viz.trace import RunTrace, TraceError, load_run

MIXED = "mixed"
#: JSON files a ddpscope run folder holds besides its rank files
OWN_FILES = {fmt.RUN_FILE, "calibration.json"}
#: what the top of a Kineto file shows (torch.profiler writes these first)
KINETO_MARKERS = ('"schemaVersion"', '"distributedInfo"', '"deviceProperties"', '"traceName"', "ProfilerStep#",
                  '"cpu_op"', '"kernel"')


def is_kineto_file(path: Path) -> bool:
    head = peek_text(path)
    return any(m in head for m in KINETO_MARKERS)


def folder_kind(path: str | Path) -> str | None:
    """``"ddp"``, ``"ring"``, ``"zero"``, ``"kineto"``, ``"mixed"``, or None when the
    folder holds nothing we read. Cheap: peeks at the first bytes of a file at most."""
    path = Path(path)
    try:
        if not path.is_dir():
            return None
        candidates = [p for p in kineto_files(path) if p.name not in OWN_FILES]
    except OSError:
        return None
    ours_rank = [p for p in candidates if fmt.RANK_FILE_RE.match(p.name)]
    others = [p for p in candidates if not fmt.RANK_FILE_RE.match(p.name)]
    has_run = (path / fmt.RUN_FILE).is_file()
    if ours_rank and not has_run and is_kineto_file(ours_rank[0]):  # a profiler trace named rank-0.json
        others, ours_rank = others + ours_rank, []
    kineto = bool(others) and is_kineto_file(others[0])
    summaries = has_run and any(fmt.SUMMARY_FILE_RE.match(p.name) for p in path.iterdir())  # events left behind
    ours = run_kind(path) if ours_rank or summaries else None
    if ours and kineto:
        return MIXED
    return ours or (KINETO if kineto else None)


def readable_kind(path: str | Path) -> str:
    """``folder_kind``, or a ``TraceError`` for a folder that holds nothing we read or
    mixes ours with profiler traces (a path that is not a folder: the loaders say so)."""
    path = Path(path)
    kind = folder_kind(path)
    if kind == MIXED:
        raise TraceError(f"{path.name} mixes ddpscope rank files and profiler traces; put them in separate folders")
    if kind is None and path.is_dir():
        why = _why_no_trace(path)
        if why:
            raise TraceError(f"{path} {why}")
        raise TraceError(f"{path} holds no readable ddpscope run (run.json + rank-<r>.json) and no profiler "
                         "traces (*.json, *.json.gz)")
    return kind or fmt.KIND_DDP


def load_training_trace(path: str | Path, events_for=None) -> RunTrace:
    """A DDP training trace from a ddpscope run folder (``events_for``: see ``load_run``)
    or a folder of profiler traces."""
    return load_kineto(path) if readable_kind(path) == KINETO else load_run(path, events_for=events_for)


def _why_no_trace(path: Path) -> str | None:
    """Why a run folder holds no trace, as its run.json says: ``status`` untraced (the
    launcher's one line), or failed before any rank wrote a step (the job's error); None
    otherwise."""
    try:
        run = read_json_file(path / fmt.RUN_FILE, "run metadata")
    except (TraceError, OSError):
        return None
    if not isinstance(run, dict):
        return None
    if run.get("status") == fmt.UNTRACED:
        return f"was run but not traced: {run.get('error') or 'nothing was traced'}"
    if run.get("status") == fmt.FAILED and run.get("error"):
        return f"failed before any step was traced: {run['error']}"
    return None
