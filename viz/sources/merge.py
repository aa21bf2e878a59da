"""``ddpscope merge FOLDER... --out MERGED``: one run folder from the folders that the
nodes of one multi-node job wrote apart (each node given its own ``--out``, on a disk
of its own).

Every folder must be a node's folder of the same job (``nodes/node-<k>.json`` carries
the job's identity; see ``tracer/launch/nodes.py``), every node and every rank must come
from exactly one of them, and node 0's folder brings ``run.json``. The merged folder is
built beside ``--out`` and renamed into place whole: a merge that fails leaves nothing.
Rank files are checked (they must load as ddpscope rank files) and copied unchanged:
their clock offsets to rank 0 were measured during the run, across the nodes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.viz.run_files import read_json_file, read_rank_file
from ddpscope.viz.trace import TraceError


def _nodes_of(folder: Path) -> dict[int, dict]:
    """The node records in ``folder`` (``TraceError`` if it has none, or a bad one)."""
    found = {}
    for p in sorted((folder / fmt.NODES_DIR).glob("node-*.json")) if (folder / fmt.NODES_DIR).is_dir() else []:
        record = read_json_file(p, "node record")
        k = record.get("node_rank")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k < 10_000 or not isinstance(record.get("job"), str):
            raise TraceError(f"{folder.name}/{fmt.NODES_DIR}/{p.name} is not a ddpscope node record")
        found[k] = record
    if not found:
        raise TraceError(f"{folder} is not a node's folder of a multi-node `ddpscope run` (it has no "
                         f"{fmt.NODES_DIR}/node-<k>.json)")
    return found


def plan_merge(folders: list[Path]) -> tuple[dict, dict[int, Path], dict[int, Path]]:
    """``(run.json, {node: folder}, {rank: rank file})`` of a valid merge, or ``TraceError``."""
    if len(folders) < 2:
        raise TraceError("give the folders of at least two nodes to merge")
    seen = [f.resolve() for f in folders]
    if len(set(seen)) < len(seen):
        twice = next(f for f in folders if seen.count(f.resolve()) > 1)
        raise TraceError(f"{twice} is given twice")
    node_folder: dict[int, Path] = {}
    jobs, counts = set(), set()
    for folder in folders:
        if not folder.is_dir():
            raise TraceError(f"{folder} is not a folder")
        for k, record in _nodes_of(folder).items():
            if k in node_folder and node_folder[k] != folder:
                raise TraceError(f"node {k} is in both {node_folder[k]} and {folder}")
            node_folder[k] = folder
            jobs.add(record["job"])
            counts.add(record.get("nnodes"))
    if len(jobs) > 1:
        raise TraceError("these folders hold different jobs (their nodes ran different commands); merge one job's")
    nnodes = next(iter(counts)) if len(counts) == 1 and isinstance(next(iter(counts)), int) else None
    if nnodes is None or sorted(node_folder) != list(range(nnodes)):
        missing = sorted(set(range(nnodes or 0)) - set(node_folder))
        raise TraceError(f"the job ran on {nnodes} nodes; the folders hold nodes {sorted(node_folder)}"
                         + (f" (node {', '.join(map(str, missing))} missing)" if missing else ""))
    run = read_json_file(node_folder[0] / fmt.RUN_FILE, "run metadata")
    ranks: dict[int, Path] = {}
    for folder in dict.fromkeys(node_folder.values()):
        for p in sorted(folder.iterdir()):
            m = fmt.RANK_FILE_RE.match(p.name)
            if not m:
                continue
            r = int(m.group(1))
            if r in ranks:
                raise TraceError(f"rank {r} is in both {ranks[r].parent} and {folder}")
            meta, _ = read_rank_file(p)
            if meta.get("rank") != r:
                raise TraceError(f"{folder.name}/{p.name} says it is rank {meta.get('rank')}")
            ranks[r] = p
    return run, node_folder, ranks


def merge_runs(folders: list[str | Path], out: str | Path) -> Path:
    """Merge the node folders into ``out`` (a new folder); ``TraceError`` on bad input."""
    folders = [Path(f) for f in folders]
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise TraceError(f"--out {out} exists and is not an empty folder; choose a new one")
    run, node_folder, ranks = plan_merge(folders)
    tmp = out.parent / f".{out.name}.merging-{os.getpid()}"
    try:
        tmp.mkdir(parents=True)
        for r, p in ranks.items():
            shutil.copy2(p, tmp / p.name)
        for k, folder in node_folder.items():
            for sub in (fmt.NODES_DIR, fmt.LIVE_DIR, fmt.PROFILE_DIR, fmt.LOGS_DIR):
                if (folder / sub).is_dir():
                    shutil.copytree(folder / sub, tmp / sub, dirs_exist_ok=True, symlinks=True)
        run.pop("nodes_elsewhere", None)
        run["merged_from"] = [str(f.resolve()) for f in dict.fromkeys(node_folder.values())]
        (tmp / fmt.RUN_FILE).write_text(json.dumps(run, indent=1))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
