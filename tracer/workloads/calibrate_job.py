"""The calibration job: what the what-if model cannot read off one trace, measured on the
same ranks and backend (started by torchrun; see ``runner.run_calibrate``).

1. ``dist.all_reduce`` of 4 KiB, 16 KiB, ... up to ``--max-mb`` (x4 each), one warm-up
   then repeats (as many as fit ``--budget-s`` per size, 3 to 50), every repeat started
   together (a barrier) and timed on rank 0: median µs per size;
2. contention: a compute loop (matmuls) alone, a train of 1 MiB all-reduces alone, and
   both at once (the all-reduces from a second thread, as DDP's reducer issues them
   during backward): the extra time each takes beside the other, as a fraction.

Rank 0 writes ``calibration.json`` (atomically) in ``--out``, the traced run's folder;
nothing else there changes. Rank 0 prints ``ddpscope-progress {json}`` lines.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from tracer.progress import emit_progress as progress
from tracer.workloads.worker import init_worker
from tracer.writer import write_json_atomic

FORMAT = "ddpscope-calibration"
FILE = "calibration.json"
MIN_BYTES = 4096
CONTENTION_MSG_BYTES = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="the run folder to store calibration.json in")
    p.add_argument("--max-mb", type=float, default=256.0)
    p.add_argument("--budget-s", type=float, default=0.4, help="time per size (repeats: 3 to 50)")
    p.add_argument("--bind", action="store_true", help="bind each rank to its share of the cores, as the run did")
    p.add_argument("--pg-timeout-s", type=float, default=300.0)
    return p.parse_args(argv)


def sizes(max_bytes: int) -> list[int]:
    """4 KiB x 4^k up to ``max_bytes`` (bytes), and ``max_bytes`` itself."""
    out, n = [], MIN_BYTES
    while n < max_bytes:
        out.append(n)
        n *= 4
    return out + [max_bytes]


def _timed_all_reduce(t: torch.Tensor, device: torch.device) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(t)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CPU-GPU sync: the all-reduce's end, not its launch
    return (time.perf_counter() - t0) * 1e6


def _agreed(value: int) -> int:
    """Rank 0's ``value`` on every rank (repeat counts must match: all-reduce is collective)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, 0)
    return int(t.item())


def sweep(device: torch.device, max_bytes: int, budget_s: float, rank: int) -> list[dict]:
    rows = []
    for nbytes in sizes(max_bytes):
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        first = _timed_all_reduce(t, device)  # warm-up: buffers, connections
        reps = _agreed(max(3, min(50, int(budget_s * 1e6 / max(first, 1.0)))))
        us = [_timed_all_reduce(t, device) for _ in range(reps)]
        rows.append({"bytes": nbytes, "us": statistics.median(us), "repeats": reps,
                     "min_us": min(us), "max_us": max(us)})
        if rank == 0:
            progress(phase="calibrate", bytes=nbytes, us=rows[-1]["us"])
        del t
    return rows


def _compute(iters: int, a: torch.Tensor) -> float:
    """µs for ``iters`` matmuls of ``a`` (the compute a backward pass does)."""
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ a
    if a.is_cuda:
        torch.cuda.synchronize(a.device)  # CPU-GPU sync: the kernels' end
    return (time.perf_counter() - t0) * 1e6


def _comm_train(count: int, t: torch.Tensor) -> float:
    """µs for ``count`` all-reduces of ``t`` issued back to back, then waited for."""
    t0 = time.perf_counter()
    works = [dist.all_reduce(t, async_op=True) for _ in range(count)]
    for w in works:
        w.wait()
    return (time.perf_counter() - t0) * 1e6


def contention(device: torch.device) -> dict:
    """Compute alone, all-reduces alone, then both at once: the slowdown of each (extra
    time as a fraction of its time alone)."""
    a = torch.randn(256, 256, device=device)
    msg = torch.ones(CONTENTION_MSG_BYTES // 4, device=device)
    _compute(20, a)
    iters = _agreed(max(20, int(20 * 50e3 / max(_compute(20, a), 1.0))))  # ~50 ms of compute
    count = 8
    dist.barrier()
    comm_alone = _comm_train(count, msg)
    count = _agreed(max(4, int(count * 50e3 / max(comm_alone, 1.0))))  # ~50 ms of all-reduces
    compute_alone = statistics.median(_compute(iters, a) for _ in range(3))
    dist.barrier()
    comm_alone = statistics.median(_comm_train(count, msg) for _ in range(3))
    both: dict[str, float] = {}

    def comm() -> None:
        both["comm"] = _comm_train(count, msg)

    dist.barrier()
    th = threading.Thread(target=comm)
    th.start()
    laps = []
    while th.is_alive() or not laps:  # compute for as long as the all-reduces run
        laps.append(_compute(max(1, iters // 10), a) / max(1, iters // 10))
    th.join()
    per_iter_alone = compute_alone / iters
    busy = laps[:-1] or laps  # the last lap may have run partly alone
    return {"compute_slowdown": max(0.0, statistics.median(busy) / per_iter_alone - 1.0),
            "comm_slowdown": max(0.0, both["comm"] / comm_alone - 1.0),
            "compute_alone_us_per_matmul": per_iter_alone, "comm_alone_us": comm_alone / count,
            "message_bytes": CONTENTION_MSG_BYTES}


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_worker(args.pg_timeout_s, bind=args.bind)
    try:
        rank = dist.get_rank()
        if rank == 0:
            progress(phase="start", world_size=dist.get_world_size(), backend=dist.get_backend())
        rows = sweep(device, int(args.max_mb * 2**20), args.budget_s, rank)
        cont = contention(device)
        if rank == 0:
            write_json_atomic(Path(args.out) / FILE, {
                "format": FORMAT, "version": 1, "world_size": dist.get_world_size(),
                "backend": dist.get_backend(), "device": device.type, "bound_to_cores": bool(args.bind),
                "torch_version": torch.__version__, "created_unix_s": time.time(),
                "sizes": rows, "contention": cont,
            })
            progress(phase="done", **{k: cont[k] for k in ("compute_slowdown", "comm_slowdown")})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
