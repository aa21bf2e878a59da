"""What every tracer of a rank (DDP's, FSDP2's) does with its trace file and its own
process group, the same way: open the file only if every rank can (agreed over the
tracer's gloo group), write the same header (process and lane names for Perfetto), and
destroy that group as soon as its last collective is done."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from ddpscope.tracer import format as fmt
from ddpscope.tracer.writer import TraceWriter


def open_rank_trace(out_dir: Path, rank: int, world: int, meta: dict, header: list[dict], flush_interval_s: float,
                    group, *, on_opened: Callable[[], None] = lambda: None, injected: str | None = None
                    ) -> TraceWriter:
    """This rank's trace writer, its header written and ``on_opened()`` run (rank 0's
    run.json). Every rank must succeed, or none traces: a half-traced job would wait on
    the silent rank at the end. So the ranks share their problems (a collective over
    ``group``) and each raises ``RuntimeError`` with the first one, its own file removed.
    Traces are never overwritten. ``injected``: a test's reason for this rank to fail."""
    problem, writer = None, None
    try:
        if injected:
            raise OSError(injected)
        out_dir.mkdir(parents=True, exist_ok=True)
        if (out_dir / fmt.rank_file(rank)).exists():
            raise FileExistsError(f"{out_dir} already holds rank {rank}'s trace of an earlier job (a script that "
                                  "runs several, or a folder used twice): it is kept, this job is not traced")
        writer = TraceWriter(out_dir / fmt.rank_file(rank), meta, flush_interval_s,
                             summary_path=out_dir / fmt.summary_file(rank))
        writer.add(header)
        on_opened()
    except FileExistsError as e:
        problem = str(e)
    except OSError as e:
        problem = f"rank {rank} cannot write its trace in {out_dir}: {e.strerror or e}"
    problems: list[Any] = [None] * world
    dist.all_gather_object(problems, problem, group=group)
    first = next((p for p in problems if p), None)
    if first:
        if writer is not None:  # it holds no step: leave no file that says otherwise
            try:
                writer.close(status=fmt.FAILED, error="the tracer could not start")
            except OSError:
                pass
            writer.unlink()
        raise RuntimeError(first)
    return writer


def release_group(group) -> None:
    """Destroy a tracer's own gloo group now, not at interpreter exit.

    Its destructor (run here, the GIL released by torch's holder) joins gloo's worker
    threads. Left alive (a tracer sits in reference cycles), a worker still dropping the
    last all_gather's tensors wants the GIL while Python finalizes, and the rank aborts:
    "terminate called without an active exception" (a script that exits right after such
    a collective aborted 10 times in 20 two-rank runs; 0 in 20 so)."""
    if group is None:
        return
    try:
        dist.destroy_process_group(group)
    except Exception:  # noqa: BLE001 - gone with the default group already: our reference is the last
        pass


def thread_meta(pid: int, tid: int, name: str) -> list[dict]:
    return [
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}},
        {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}},
    ]


def header_events(rank: int, host: str) -> list[dict]:
    """Process and lane names for Perfetto."""
    return [
        {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank} ({host})"}},
        {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
        *thread_meta(rank, fmt.TID_COMPUTE, "compute (step / forward / backward / optimizer)"),
        *thread_meta(rank, fmt.TID_GRADS, "gradient ready"),
    ]
