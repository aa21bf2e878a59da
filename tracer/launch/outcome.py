"""How a job that has ended left its trace: which ranks did not finish it, and whether a
failure came only after every rank had closed it (read from run.json and the live files,
small; never the rank files). Torch-free: the launcher's side."""

from __future__ import annotations

from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.tracer.launch.hangs import read_positions


def unfinished_ranks(out: Path, run: dict, skip: set[int] = frozenset()) -> str | None:
    """After a job that ended well: which ranks did not finish their trace ("rank 1
    stopped tracing at step 12"), from their live files (small: never the rank files), or None. A rank
    whose live file is missing or not ``complete`` never closed its trace; a run.json still
    ``running`` means rank 0 could not write its last one."""
    if run.get("kind", fmt.KIND_DDP) not in (fmt.KIND_DDP, fmt.KIND_SHARDED):  # ring and ZeRO jobs keep no live files
        return "run.json was not finished" if run.get("status") == fmt.RUNNING else None
    if not any(fmt.RANK_FILE_RE.match(p.name) for p in out.iterdir()):
        return None  # nothing was traced (no DDP model): run_job says so
    live = read_positions(out)
    world = int(run.get("world_size") or 0) or int(run.get("nproc_per_node") or 0) * int(run.get("nnodes") or 1)
    bad = [r for r in range(world) if r not in skip and live.get(r, {}).get("status") != fmt.COMPLETE]
    if not bad and run.get("status") != fmt.RUNNING:
        return None
    if not bad:
        return "rank 0 could not write run.json"
    return ", ".join(f"rank {r} stopped tracing at step {live[r].get('steps_done', '?')}" if r in live else
                     f"rank {r} wrote no live file" for r in bad)


def failed_after_training(result, out: Path, run: dict) -> bool:
    """The job failed, but only after every rank had closed its trace cleanly (run.json
    and every live file say complete): not a hang, not an interrupt, not a lost trace."""
    if result.ok or result.interrupted or result.hung or result.timed_out or not out.is_dir():
        return False
    if run.get("status") != fmt.COMPLETE or not any(fmt.RANK_FILE_RE.match(p.name) for p in out.iterdir()):
        return False
    return unfinished_ranks(out, run) is None
