"""The calibration job: what the what-if model cannot read off one trace, measured on the
same ranks and backend (started by torchrun; see ``tracer.launch.calibrate``).

1. ``dist.all_reduce`` of 4 KiB, 16 KiB, ... up to ``--max-mb`` (x4 each), one warm-up
   each, then three passes through every size (repeats per pass: what fits
   ``--budget-s`` per size, 2 to 20), every repeat started together (a barrier): the
   median µs per size;
2. contention, for 64 KiB and 16 MiB all-reduces, three times each: a compute loop
   (forward + backward of a small MLP) alone, a train of all-reduces alone, and both at
   once (the all-reduces from a second thread, as DDP's reducer issues them during
   backward): the median over every rank's repeats of the extra time each takes beside
   the other, as a fraction, and of the compute time lost per all-reduce
   (``compute_lost_us``).

Rank 0 writes ``calibration.json`` (atomically) in ``--out``, the traced run's folder;
nothing else there changes. Rank 0 prints ``ddpscope-progress {json}`` lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddpscope.tracer.progress import emit_progress as progress
from ddpscope.tracer.workloads.worker import init_worker
from ddpscope.tracer.writer import write_json_atomic

FORMAT = "ddpscope-calibration"
FILE = "calibration.json"
MIN_BYTES = 4096
CONTENTION_BYTES = (64 * 2**10, 16 * 2**20)  # latency-bound, bandwidth-bound


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="the run folder to store calibration.json in")
    p.add_argument("--max-mb", type=float, default=256.0)
    p.add_argument("--budget-s", type=float, default=0.6, help="time per size, over all passes")
    p.add_argument("--bind", action="store_true", help="bind each rank to its share of the cores, as the run did")
    p.add_argument("--pg-timeout-s", type=float, default=300.0)
    p.add_argument("--nodes", type=int, default=1, help="the nodes the ranks are on")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="the run's device (else this machine's choice, as ddpscope's own jobs make it)")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="the run's backend, with --device")
    p.add_argument("--emulation", type=json.loads, default=None,
                   help="the lab the run's nodes were emulated in (run.json's emulation, JSON)")
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


def _agreed(value: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every rank (repeat counts must match: all-reduce is collective);
    on the job's device (NCCL broadcasts device tensors only)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return int(t.item())  # CPU-GPU sync on CUDA: between measurements


def sweep(device: torch.device, max_bytes: int, budget_s: float, rank: int, passes: int = 3) -> list[dict]:
    """Median µs per size over ``passes`` passes through every size (a slow spell of the
    machine then touches one pass of each size, not every repeat of one)."""
    tensors = {n: torch.ones(n // 4, dtype=torch.float32, device=device) for n in sizes(max_bytes)}
    reps = {}
    for nbytes, t in tensors.items():  # warm-up: buffers, connections; and how many repeats fit
        first = _timed_all_reduce(t, device)
        reps[nbytes] = _agreed(max(2, min(20, int(budget_s * 1e6 / passes / max(first, 1.0)))), device)
    times: dict[int, list[float]] = {n: [] for n in tensors}
    for p in range(passes):
        for nbytes, t in tensors.items():
            times[nbytes] += [_timed_all_reduce(t, device) for _ in range(reps[nbytes])]
            if rank == 0 and p == passes - 1:
                progress(event="size", bytes=nbytes, us=statistics.median(times[nbytes]))
    return [{"bytes": n, "us": statistics.median(us), "repeats": len(us), "min_us": min(us), "max_us": max(us)}
            for n, us in times.items()]


class _Backward:
    """The compute of a training step: forward and backward of a small MLP through
    autograd (matmuls, element-wise kernels, the engine's own overhead)."""

    def __init__(self, device: torch.device) -> None:
        torch.manual_seed(0)
        layers = [m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.GELU())]
        self.model = torch.nn.Sequential(*layers).to(device)
        self.x = torch.randn(64, 512, device=device)

    def __call__(self, iters: int) -> float:
        """µs for ``iters`` forward + backward passes."""
        t0 = time.perf_counter()
        for _ in range(iters):
            self.model(self.x).sum().backward()
        if self.x.is_cuda:
            torch.cuda.synchronize(self.x.device)  # CPU-GPU sync: the kernels' end
        return (time.perf_counter() - t0) * 1e6


def _comm_train(count: int, t: torch.Tensor) -> float:
    """µs for ``count`` all-reduces of ``t`` issued back to back, then waited for."""
    t0 = time.perf_counter()
    works = [dist.all_reduce(t, async_op=True) for _ in range(count)]
    for w in works:
        w.wait()  # NCCL: only makes the current stream wait
    if t.is_cuda:
        torch.cuda.synchronize(t.device)  # CPU-GPU sync: the all-reduces' end, not their enqueue
    return (time.perf_counter() - t0) * 1e6


def contention(device: torch.device, nbytes: int, repeats: int = 3) -> dict:
    """Compute alone, all-reduces of ``nbytes`` alone, then both at once, ``repeats``
    times: the median slowdown of each (extra time as a fraction of its time alone) and
    the compute time lost per all-reduce beside it (µs)."""
    compute = _Backward(device)
    msg = torch.ones(nbytes // 4, device=device)
    compute(5)
    iters = _agreed(max(10, int(10 * 100e3 / max(compute(10), 1.0))), device)  # ~100 ms of compute
    dist.barrier()
    first = _comm_train(2, msg)
    count = _agreed(max(2, int(2 * 150e3 / max(first, 1.0))), device)  # ~150 ms of all-reduces
    compute_slow, comm_slow, alone_us, lost_us = [], [], [], []
    for _ in range(repeats):
        compute_alone = compute(iters)
        dist.barrier()
        comm_alone = _comm_train(count, msg)
        both: dict[str, float] = {}

        def comm() -> None:
            both["comm"] = _comm_train(count, msg)

        dist.barrier()
        th = threading.Thread(target=comm)
        th.start()
        laps = []
        lap = max(1, iters // 10)
        while th.is_alive() or not laps:  # compute for as long as the all-reduces run
            laps.append(compute(lap) / lap)
        th.join()
        busy = laps[:-1] or laps  # the last lap may have run partly alone
        slow = max(0.0, statistics.median(busy) / (compute_alone / iters) - 1.0)
        compute_slow.append(slow)
        comm_slow.append(max(0.0, both["comm"] / comm_alone - 1.0))
        alone_us.append(comm_alone / count)
        lost_us.append(both["comm"] * slow / (1.0 + slow) / count)  # compute lost while they ran
    # every rank's repeats, not rank 0's alone: what an all-reduce takes from compute differs
    # between the ranks of one job (in the lab, the kernel's network work lands on one core or
    # the other), and the model takes one steal for all ranks (rank 0's alone read 0 and 3.9
    # ms per MiB in two calibrations of one lab)
    compute_slow, comm_slow, alone_us, lost_us = _everyones([compute_slow, comm_slow, alone_us, lost_us], device)
    return {"bytes": nbytes, "compute_slowdown": statistics.median(compute_slow),
            "comm_slowdown": statistics.median(comm_slow), "comm_alone_us": statistics.median(alone_us),
            "compute_lost_us": statistics.median(lost_us), "count": count, "repeats": repeats,
            "ranks": dist.get_world_size()}


def _everyones(lists: list[list[float]], device: torch.device) -> list[list[float]]:
    """Each of ``lists`` (this rank's values, the same length on every rank) with every
    rank's values: one all-gather (on the job's device: NCCL gathers device tensors only)."""
    mine = torch.tensor(lists, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return torch.cat(every, dim=1).tolist()  # CPU-GPU sync on CUDA: between measurements


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_worker(args.pg_timeout_s, bind=args.bind, device_type=args.device, backend=args.backend)
    try:
        rank = dist.get_rank()
        if rank == 0:
            progress(event="start", world_size=dist.get_world_size(), backend=dist.get_backend(),
                     sizes=len(sizes(int(args.max_mb * 2**20))))
        rows = sweep(device, int(args.max_mb * 2**20), args.budget_s, rank)
        small, large = (contention(device, n) for n in CONTENTION_BYTES)
        cont = {"compute_slowdown": large["compute_slowdown"], "comm_slowdown": large["comm_slowdown"],
                "sizes": [small, large]}
        if rank == 0:
            write_json_atomic(Path(args.out) / FILE, {
                "format": FORMAT, "version": 1, "world_size": dist.get_world_size(),
                "backend": dist.get_backend(), "device": device.type, "bound_to_cores": bool(args.bind),
                "nnodes": args.nodes, "emulation": args.emulation,
                "torch_version": torch.__version__, "created_unix_s": time.time(),
                "sizes": rows, "contention": cont,
            })
            progress(event="done", **{k: cont[k] for k in ("compute_slowdown", "comm_slowdown")})
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
