"""Several nodes, one run folder: who may write into ``--out``, who owns what, and when
node 0 may call the job's trace finished. Torch-free (the launcher side).

On a cluster every node runs the same ``ddpscope run --nnodes N --node-rank K ...
--out /shared/runs/x``. Each node's launcher announces itself in
``RUN/nodes/node-<k>.json`` (the job's identity, its host, its ranks, its status) before
it starts its ranks and says how they ended there afterwards; each rank writes its own
``rank-<r>.json`` and ``live/rank-<r>.json``; each node keeps its torchrun logs in
``logs/node-<k>/``; node 0 alone owns ``run.json``. So no file has two writers.

The job's identity is a hash of what every node was asked to run (the command without
``--out`` and ``--node-rank``). A folder is accepted when it is new or empty, or when it
holds only this job's nodes, none of them this node, and no finished ``run.json``;
another job's folder is refused. When the folder is not shared (each node wrote its
own), node 0 says so instead of calling the other ranks lost: ``ddpscope merge`` joins
the folders.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.tracer.launch.lab import why_not
from ddpscope.tracer.writer import read_records, write_json_atomic

FINISH_WAIT_S = 30.0  # node 0 waits this long, at most, for the other nodes to say how they ended
#: a node that finds the folder already begun (made, its logs folder made) but no node's
#: record in it waits this long, at most, for one: the nodes of a job start together, and
#: another may be between making the folder and announcing itself
JOIN_WAIT_S = 10.0


def job_key(what: dict) -> str:
    """A short hash of what every node of one job was asked to run (JSON-able ``what``)."""
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def read_nodes(out: Path) -> dict[int, dict]:
    """Every node's record in the run folder ``out`` (unreadable ones left out)."""
    return read_records(Path(out) / fmt.NODES_DIR, "node-*.json", "node_rank")


def check_node_settings(cfg) -> None:
    """The node settings of a config with ``nnodes``, ``node_rank``, ``rdzv_endpoint``,
    ``emulate_nodes`` and ``link`` (``ValueError`` naming the flag); the default link."""
    if not 0 <= cfg.node_rank < cfg.nnodes:
        raise ValueError(f"--node-rank must be in 0..{cfg.nnodes - 1}, got {cfg.node_rank}")
    if cfg.nnodes > 1 and not cfg.rdzv_endpoint:
        raise ValueError("--rdzv-endpoint HOST:PORT is required with --nnodes > 1")
    if cfg.link is not None and cfg.emulate_nodes is None:
        raise ValueError("--link goes with --emulate-nodes N")
    if cfg.emulate_nodes is not None:
        if cfg.nnodes > 1 or cfg.rdzv_endpoint:
            raise ValueError("--emulate-nodes runs every node here: leave out --nnodes, --node-rank and "
                             "--rdzv-endpoint")
        cfg.link = (cfg.link or "1gbit").strip().lower()
        if (reason := why_not()) is not None:
            raise ValueError(f"--emulate-nodes: {reason}")


def check_out_dir(out: Path, job: str | None = None, node_rank: int = 0) -> None:
    """``--out`` must be a new or empty folder we can write to; with ``job`` (a multi-node
    run), also one that holds only other nodes of this job, still running. Nothing is
    created here; ``ValueError`` (one line, naming --out) otherwise."""
    if out.exists():
        if not out.is_dir():
            raise ValueError(f"--out {out} exists and is not a folder")
        if any(out.iterdir()) and not _joinable(out, job, node_rank):
            raise ValueError(f"--out {out} is not empty; choose a new folder (traces are never overwritten)")
        probe = out
    else:
        probe = out.parent
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir():
            raise ValueError(f"--out {out}: {probe} is not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out} is not writable ({probe} denies writing)")


def _joinable(out: Path, job: str | None, node_rank: int) -> bool:
    """``out`` holds another node of this very job, still running, and not this node."""
    if job is None:
        return False
    end = time.monotonic() + JOIN_WAIT_S
    while not (nodes := read_nodes(out)):
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)
    others = {n.get("job") for n in nodes.values()}
    if others != {job}:
        raise ValueError(f"--out {out} holds the trace of another job (its nodes ran another command); "
                         "choose a new folder")
    if node_rank in nodes:
        return False  # this node ran here already: a finished or earlier job
    try:
        run = json.loads((out / fmt.RUN_FILE).read_text())
    except (OSError, ValueError):
        run = {}
    return not (isinstance(run, dict) and run.get("status") not in (None, fmt.RUNNING))


def announce(out: Path, job: str, node_rank: int, nnodes: int, nproc: int) -> None:
    """This node's record, before its ranks start (``ValueError``, one line, if it cannot be written)."""
    path = out / fmt.node_file(node_rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {
            "job": job, "node_rank": node_rank, "nnodes": nnodes, "host": socket.gethostname(),
            "ranks": [node_rank * nproc + i for i in range(nproc)], "status": fmt.RUNNING, "started_unix": time.time()})
    except OSError as e:
        raise ValueError(f"--out {out} is not writable: {e.strerror or e}") from None


def finish(out: Path, node_rank: int, status: str, reason: str | None = None) -> None:
    """How this node's ranks ended (never raises: the folder may be gone)."""
    path = out / fmt.node_file(node_rank)
    try:
        record = json.loads(path.read_text())
        record.update(status=status, reason=reason, ended_unix=time.time())
        write_json_atomic(path, record)
    except (OSError, ValueError):
        pass


def wait_for_nodes(out: Path, nnodes: int, timeout_s: float = FINISH_WAIT_S, poll_s: float = 0.2
                   ) -> tuple[list[int], list[int]]:
    """Node 0, after its ranks ended: ``(absent, unfinished)`` other nodes. A node whose
    record never appeared wrote its own folder (the folder is not shared), and is not
    waited for; one that announced itself is waited for until it says how it ended, at
    most ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = read_nodes(out)
        absent = [k for k in range(1, nnodes) if k not in nodes]
        unfinished = [k for k in range(1, nnodes) if k in nodes and nodes[k].get("status") == fmt.RUNNING]
        if not unfinished or time.monotonic() >= deadline:
            return absent, unfinished
        time.sleep(poll_s)
