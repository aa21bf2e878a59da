"""A plain FSDP2 training script (``fully_shard``, CPU, gloo, a root without parameters
of its own): ddpscope traces it, and the script trains to its end."""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        os.makedirs(args.report, exist_ok=True)
        with open(os.path.join(args.report, f"check-rank{dist.get_rank()}.json"), "w") as f:
            json.dump({"done": True}, f)
        # A clean gloo teardown (see user_train.py): torch 2.13 aborts a rank at exit now and
        # then ("terminate called without an active exception", 4 of 12 two-rank runs of this
        # script under torchrun alone) unless every rank is past its last collective and the
        # sharded model (reference cycles: hence the collection) is gone before its group.
        dist.barrier()
        del model, opt
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
