"""Test worker (run under torchrun): our ring all-reduce against ``dist.all_reduce`` on
many sizes (empty chunks, sizes not divisible by N), dtypes and layouts, on the whole
world and on a sub-group; writes what it checked to ``<out>/rank-<r>.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from ddpscope.tracer.workloads.ring import ring_all_reduce

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32]


def check(x: torch.Tensor, group=None) -> dict:
    mine, ref = x.clone(), x.clone()
    records = ring_all_reduce(mine, group)
    dist.all_reduce(ref, group=group)
    if x.dtype.is_floating_point:
        # Both sums round N-1 times, each time by at most eps/2 of a partial sum, which is
        # bounded by sum_i |x_i|: the textbook bound for two summation orders.
        abs_sum = x.abs().double()
        dist.all_reduce(abs_sum, group=group)
        n = dist.get_world_size(group)
        bound = 2 * (n - 1) * torch.finfo(x.dtype).eps / 2 * abs_sum
        ok = bool(((mine.double() - ref.double()).abs() <= bound).all())
    else:
        ok = torch.equal(mine, ref)
    return {"dtype": str(x.dtype), "shape": list(x.shape), "ok": bool(ok), "steps": len(records),
            "sent": sum(r.send_bytes for r in records), "received": sum(r.recv_bytes for r in records),
            "changed": not torch.equal(mine, x),
            "max_abs_diff": (mine.double() - ref.double()).abs().max().item() if x.numel() else 0.0,
            "max_abs": ref.double().abs().max().item() if x.numel() else 0.0}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(1234 + rank)
    results = []
    try:
        for numel in (0, 1, world - 1, world, 7, 1000, 4097, 65536 + 3):
            for dtype in DTYPES:
                x = (torch.randn(numel, generator=gen) * 100).to(dtype)
                results.append({"numel": numel, **check(x)})
        # a non-contiguous tensor (transposed): summed in place, shape kept
        x = torch.randn(33, 17, generator=gen).t()
        results.append({"numel": x.numel(), "layout": "transposed", **check(x)})
        # a sub-group of the last two ranks: group ranks differ from global ranks
        sub = dist.new_group([world - 2, world - 1])
        if rank >= world - 2:
            x = torch.randn(1001, generator=gen)
            results.append({"numel": 1001, "group": "last two", **check(x, sub)})
    finally:
        Path(args.out, f"rank-{rank}.json").write_text(json.dumps(results))
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
