"""The ring job: one process per rank, started by torchrun (see ``own_jobs.run_ring``).

For each size (two small calibration sizes, then the requested one) it runs one warm-up
and then ``--repeat`` rounds of: our ring all-reduce (``tracer/workloads/ring.py``) and PyTorch's
own ``dist.all_reduce`` on the same input, in alternating order, checking that both give
the same sum. Every step of every ring is traced. Each rank writes ``rank-<r>.json``
(valid after every round); rank 0 writes the run's facts into ``run.json``.

Rank 0 prints ``ddpscope-progress {json}`` lines for the runner.
"""

from __future__ import annotations

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.clock import CpuClock
from ddpscope.tracer.capture.offsets import estimate_offsets
from ddpscope.tracer.progress import emit_progress as progress
from ddpscope.tracer.workloads.ring import ALL_GATHER, RingStepRecord, chunk_bounds, ring_all_reduce
from ddpscope.tracer.workloads.worker import FAIL_ENV, HANG_ENV, init_worker, injected
from ddpscope.tracer.writer import TraceWriter, update_run_json

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int64": torch.int64, "int32": torch.int32}
CALIBRATION_MIN_BYTES = 4096


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--mb", type=float, required=True, help="tensor size in MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--no-calibration", action="store_true")
    p.add_argument("--pg-timeout-s", type=float, default=600.0)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def sizes_to_run(numel: int, item: int, calibrate: bool) -> list[tuple[int, bool]]:
    """(numel, is_calibration) in the order they run. The calibration sizes (4 KiB and
    1/16 of the tensor, when well below it) let the dashboard fit latency and bandwidth
    separately: one size alone cannot tell them apart."""
    out = []
    if calibrate:
        for c in sorted({max(1, CALIBRATION_MIN_BYTES // item), numel // 16}):
            if 0 < c <= numel // 4:
                out.append((c, True))
    return out + [(numel, False)]


def tolerance(dtype: torch.dtype, world: int) -> tuple[float, float]:
    """(rtol, atol) for comparing two sums taken in different orders."""
    if not dtype.is_floating_point:
        return 0.0, 0.0
    eps = torch.finfo(dtype).eps
    return 4 * world * eps, 4 * world * eps






def _input(numel: int, dtype: torch.dtype, rank: int, seed: int, device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    if dtype.is_floating_point:
        t = torch.randn(numel, generator=gen).to(dtype)
    else:
        t = torch.randint(-1000, 1000, (numel,), generator=gen, dtype=dtype)
    return t.to(device)


def step_events(rank: int, round_args: dict, records: list[RingStepRecord], world: int) -> list[dict]:
    """The ring span and its nested step spans, as Chrome trace events (µs)."""
    start, end = records[0].start_us, records[-1].end_us
    label = f"ring all-reduce {round_args['bytes'] / 2**20:.3g} MiB"
    events = [{"ph": "X", "cat": fmt.CAT_RING, "name": label, "pid": rank, "tid": fmt.TID_RING,
               "ts": start, "dur": end - start, "args": round_args}]
    for r in records:
        fields = r.to_json()
        ts, comm_end, te = fields.pop("start_us"), fields.pop("comm_end_us"), fields.pop("end_us")
        events.append({
            "ph": "X", "cat": fmt.CAT_RING_STEP, "pid": rank, "tid": fmt.TID_RING, "ts": ts, "dur": te - ts,
            "name": f"{r.phase} {r.phase_step + 1}/{world - 1}: send c{r.send_chunk}, recv c{r.recv_chunk}",
            "args": {**fields, "round": round_args["round"], "size_bytes": round_args["bytes"],
                     "comm_us": comm_end - ts, "reduce_us": te - comm_end if r.phase != ALL_GATHER else 0.0},
        })
    return events


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_worker(args.pg_timeout_s)
    use_cuda = device.type == "cuda"
    backend = "nccl" if use_cuda else "gloo"
    writer = None
    status, error = fmt.FAILED, None
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        clock = CpuClock()
        # CUDA: each stamp follows a device sync (ring.py), so host clock stamps are device times.
        sync = torch.cuda.synchronize if use_cuda else None
        cpu_group = None if backend == "gloo" else dist.new_group(backend="gloo")
        offsets_start = estimate_offsets(clock.host_us, cpu_group)
        dtype = DTYPES[args.dtype]
        item = torch.empty(0, dtype=dtype).element_size()
        numel = max(1, round(args.mb * 2**20 / item))
        sizes = sizes_to_run(numel, item, not args.no_calibration)
        meta = {
            "format": fmt.FORMAT, "version": fmt.VERSION, "kind": fmt.KIND_RING, "status": fmt.RUNNING,
            "rank": rank, "world_size": world, "host": socket.gethostname(), "pid": os.getpid(),
            "backend": backend, "device": str(device), "clock": clock.kind, "dtype": args.dtype,
            "clock_offset": {"start": offsets_start[rank].to_json(), "end": None},
            "torch_version": torch.__version__, "rounds": 0,
        }
        writer = TraceWriter(os.path.join(args.out, fmt.rank_file(rank)), meta)
        writer.add([
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": fmt.TID_RING, "args": {"name": "ring all-reduce"}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": fmt.TID_RING_REF, "args": {"name": "dist.all_reduce"}},
        ])
        run_facts = {
            "kind": fmt.KIND_RING, "world_size": world, "backend": backend, "device": str(device),
            "dtype": args.dtype, "item_bytes": item, "numel": numel, "bytes": numel * item, "mb": args.mb,
            "repeat": args.repeat, "sizes": [{"numel": n, "bytes": n * item, "calibration": c} for n, c in sizes],
            "chunk_numel": [length for _, length in chunk_bounds(numel, world)],
            "clock": clock.kind, "torch_version": torch.__version__,
        }
        if rank == 0:
            update_run_json(args.out, {**run_facts, "status": fmt.RUNNING})
            progress(event="start", world_size=world, bytes=numel * item, repeat=args.repeat, dtype=args.dtype)
        fail_at, hang_at = injected(FAIL_ENV, rank), injected(HANG_ENV, rank)
        rtol, atol = tolerance(dtype, world)
        n_round = 0
        for size_numel, calibration in sizes:
            for i in range(-1, args.repeat):  # round -1: warm-up (connections, first-touch pages)
                if not calibration and i == fail_at:
                    raise RuntimeError(f"injected failure on rank {rank} at round {i} ({FAIL_ENV})")
                if not calibration and i == hang_at:
                    time.sleep(10**6)
                data = _input(size_numel, dtype, rank, n_round, device)
                ring_buf, ref = data.clone(), data.clone()
                round_args = {"round": n_round, "repeat": i, "bytes": size_numel * item, "numel": size_numel,
                              "calibration": calibration, "warmup": i < 0}
                events = []
                for which in (("ring", "ref") if n_round % 2 == 0 else ("ref", "ring")):  # alternate the order
                    dist.barrier(group=cpu_group)  # both start together
                    if which == "ring":
                        events += step_events(rank, round_args,
                                              ring_all_reduce(ring_buf, clock_us=clock.host_us, sync=sync), world)
                    else:
                        if sync:
                            sync()  # CPU-GPU sync: start the clock on an idle device
                        t0 = clock.host_us()
                        dist.all_reduce(ref)
                        if sync:
                            sync()  # CPU-GPU sync: the all-reduce finished on the device
                        t1 = clock.host_us()
                        events.append({"ph": "X", "cat": fmt.CAT_RING_REF, "pid": rank, "tid": fmt.TID_RING_REF,
                                       "name": f"dist.all_reduce {size_numel * item / 2**20:.3g} MiB",
                                       "ts": t0, "dur": t1 - t0, "args": round_args})
                diff = (ring_buf.double() - ref.double()).abs().max().item()  # CPU-GPU sync, outside timings
                if not torch.allclose(ring_buf, ref, rtol=rtol, atol=atol):
                    raise RuntimeError(f"ring all-reduce differs from dist.all_reduce on rank {rank} "
                                       f"({size_numel} x {args.dtype}, max |diff| {diff:.3g})")
                span = next(e for e in events if e["cat"] == fmt.CAT_RING)
                span["args"] = {**round_args, "max_abs_diff": diff}
                writer.add(events)
                n_round += 1
                writer.set_meta(rounds=n_round)
                if rank == 0 and not calibration and i >= 0:
                    ring_ms = next(e["dur"] for e in events if e["cat"] == fmt.CAT_RING) / 1e3
                    ref_ms = next(e["dur"] for e in events if e["cat"] == fmt.CAT_RING_REF) / 1e3
                    progress(event="round", round=i + 1, repeat=args.repeat, ring_ms=round(ring_ms, 3),
                              ref_ms=round(ref_ms, 3))
        offsets_end = estimate_offsets(clock.host_us, cpu_group)
        meta["clock_offset"]["end"] = offsets_end[rank].to_json()
        status = fmt.COMPLETE
        if rank == 0:
            update_run_json(args.out, {**run_facts, "status": status, "rounds": n_round, "clock_offsets": {
                "start": [o.to_json() for o in offsets_start], "end": [o.to_json() for o in offsets_end]}})
            progress(event="done")
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        if writer is not None:
            writer.close(status=status, error=error, clock_offset=meta["clock_offset"])
        dist.destroy_process_group()



if __name__ == "__main__":
    main()
