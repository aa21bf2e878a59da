"""Where the runs the pages list are: ddpscope's samples, the runs made here (the runs
folder) and uploads; their picker labels, the picker, the time stamp that renews a run's
cached load, and unpacking an upload."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import time
from pathlib import Path

import streamlit as st

from ddpscope.dashboard.environment import RUNS_DIR_ENV
from ddpscope.dashboard.page_guard import one_line
from ddpscope.tracer.format import LIVE_DIR, LOGS_DIR, MODELS_DIR, NODES_DIR, RUN_FILE
from ddpscope.viz.ring.trace import load_ring
from ddpscope.viz.sources import KINETO, MIXED, folder_kind, load_training_trace
from ddpscope.viz.sources.archive import extract_run_archive, safe_name
from ddpscope.viz.trace import TraceError
from ddpscope.viz.zero.trace import load_zero

#: folder kinds the training pages (Timeline, Compare, What-if, Run) list
TRAINING_KINDS = ("ddp", "sharded", KINETO, MIXED)

ROOT = Path(__file__).resolve().parents[1]
# a checkout (or pip install -e): beside the packages; pip install .: <prefix>/share/ddpscope
SAMPLES = next((p for p in (ROOT / "samples", Path(sys.prefix) / "share" / "ddpscope" / "samples") if p.is_dir()),
               ROOT / "samples")


def runs_dir() -> Path:
    """Where runs started here go (``$DDPSCOPE_RUNS_DIR``, set by ``ddpscope dashboard``)."""
    return Path(os.environ.get(RUNS_DIR_ENV, ROOT / "runs"))


def uploads_dir() -> Path:
    return runs_dir() / "uploads"


def list_runs() -> dict[str, tuple[Path, str]]:
    """Every run folder the page can show, by label, with its kind ("ddp", "ring",
    "zero", "kineto" for profiler traces, "mixed"): samples, runs made here, uploads.
    Read once per page run."""
    found = {}
    for prefix, folder in (("sample", SAMPLES), ("run", runs_dir()), ("upload", uploads_dir())):
        if folder.is_dir():
            for p in sorted(folder.iterdir(), reverse=prefix != "sample"):
                if p.name.startswith(".") or p.name in INTERNAL:  # an upload being unpacked; a run's own parts
                    continue
                kind = folder_kind(p)
                if kind is not None:
                    found[f"{prefix}: {p.name}"] = (p, kind)
                    for sub in _models(p):  # a job's further DDP models, each a run of its own
                        found[f"{prefix}: {p.name} · {sub.name}"] = (sub, kind)
    return found


#: folders inside a run folder (its live files, logs, nodes, further models) and the
#: uploads folder (listed on its own): never runs of their own in a listing
INTERNAL = frozenset({LIVE_DIR, LOGS_DIR, NODES_DIR, MODELS_DIR, "uploads"})


def runs_note() -> str | None:
    """One line when the runs folder holds no run of the user's: it is missing or empty
    (the page then shows the samples, and says so)."""
    folder = runs_dir()
    if not folder.is_dir():
        return f"{folder} does not exist: showing ddpscope's samples. Runs started from the Run page go there."
    if not any(label.startswith("run: ") for label in list_runs()):
        return f"{folder} holds no run yet: showing ddpscope's samples. Runs started from the Run page go there."
    return None


def _models(run: Path) -> list[Path]:
    """The run folders of a job's further DDP models (``models/<k>-<class>``), in order."""
    folder = run / MODELS_DIR
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and (p / RUN_FILE).is_file()]
    return sorted(found, key=lambda p: (int(p.name.split("-", 1)[0]) if p.name.split("-", 1)[0].isdigit() else 0,
                                        p.name))


def newest_run(runs: dict[str, Path]) -> str | None:
    """The label of the most recently written run of the user's (runs folder), if any."""
    mine = []
    for label, p in runs.items():
        if label.startswith("run: "):
            try:
                mine.append((stamp_of(p), label))
            except OSError:  # gone since it was listed
                continue
    return max(mine)[1] if mine else None


def of_kind(runs: dict[str, tuple[Path, str]], *kinds: str) -> dict[str, Path]:
    return {label: path for label, (path, k) in runs.items() if k in kinds}


def label_of(path: Path) -> str:
    """The picker label of a run folder."""
    for prefix, folder in (("upload", uploads_dir()), ("run", runs_dir()), ("sample", SAMPLES)):
        if path.parent == folder:
            return f"{prefix}: {path.name}"
        if path.parent.name == MODELS_DIR and path.parent.parent.parent == folder:
            return f"{prefix}: {path.parent.parent.name} · {path.name}"
    return str(path)


def pick_run(runs: dict[str, Path], label: str, key: str, loader, hint: str):
    """A picker over ``runs`` that keeps a valid selection; ``(path, loaded run)``, the
    run None (with the message on the page) if there is none or it cannot be read."""
    if not runs:
        st.info(hint)
        return None, None
    if st.session_state.get(key) not in runs:
        st.session_state[key] = next(iter(runs))
    path = runs[st.selectbox(label, list(runs), key=key)]
    try:
        return path, loader(str(path), stamp_of(path))
    except TraceError as e:
        st.error(str(e))
        return path, None


def stamp_of(path: Path) -> float:
    """The newest file time in a run folder (what renews its cached load); a dangling
    link counts by its own time, not its missing target's."""
    def mtime(p: Path) -> float:
        try:
            return p.stat().st_mtime
        except OSError:
            return p.lstat().st_mtime

    return max((mtime(p) for p in path.iterdir()), default=0.0)


def handle_upload(upload) -> None:
    """Unpack an uploaded archive into its own folder; one-line error, nothing kept, if bad."""
    if upload is None or st.session_state.get("upload_done") == upload.file_id:
        return
    st.session_state["upload_done"] = upload.file_id
    # a name of its own: two uploads of one file in one second (two tabs, two users) never meet
    dest = uploads_dir() / (f"{safe_name(Path(upload.name).stem)}-{time.strftime('%Y%m%d-%H%M%S')}-"
                            f"{secrets.token_hex(3)}")
    made = False
    try:
        extract_run_archive(upload.getvalue(), upload.name, dest)  # makes dest, or raises if it exists
        made = True
        kind = folder_kind(dest) or "ddp"
        # checked as the page opens it: summaries first (a many-rank run may hold only those)
        {"ring": load_ring, "zero": load_zero}.get(kind, lambda p: load_training_trace(p, events_for=()))(dest)
    except Exception as e:  # noqa: BLE001 - nothing that does not load stays in uploads/ (every page lists it)
        if made or not isinstance(e, FileExistsError):  # never what another upload made
            shutil.rmtree(dest, ignore_errors=True)
        st.session_state["upload_error"] = f"{upload.name}: {one_line(e)}"
        return
    st.session_state.pop("upload_error", None)
    st.session_state[{"ring": "ring_trace", "zero": "zero_trace"}.get(kind, "trace")] = f"upload: {dest.name}"
