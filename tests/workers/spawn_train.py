"""A script that launches its own ranks (``torch.multiprocessing.spawn``, as frameworks
that relaunch themselves do, and as PyTorch's ZeRO recipe does): ``ddpscope run --nproc 1``
starts it once, and the ranks it spawns must be traced (the capture reaches them through
the environment). Nothing in it knows it runs under torchrun."""

from __future__ import annotations

import argparse
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def rank_main(rank: int, world: int, port: int, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4)), bucket_cap_mb=0.1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(steps):
            ddp(torch.randn(32, 256)).sum().backward()
            opt.step()
            opt.zero_grad()
        # DDP's reducer holds the group: dropped, on every rank, before the group is destroyed, or
        # torch 2.13's gloo may tear its threads down as the process exits and abort it ("terminate
        # called without an active exception": a spawned rank of the untraced second job, once, here)
        dist.barrier()
        del ddp, opt
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--jobs", type=int, default=1, help="spawn this many jobs, one after the other (as "
                                                         "PyTorch's ZeRO recipe does: with and without ZeRO)")
    p.add_argument("--report", default=None)  # accepted like the other test scripts
    args = p.parse_args()
    for _ in range(args.jobs):
        mp.spawn(rank_main, args=(args.world, _free_port(), args.steps), nprocs=args.world, join=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
