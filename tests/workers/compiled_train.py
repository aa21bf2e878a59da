"""A DDP script with ``torch.compile`` as nanoGPT writes it (no ddpscope code): the model
compiled, then wrapped (``--outer``: ``torch.compile(DDP(model))``, as Accelerate's dynamo
plugin does), AdamW, a few steps on gloo. Writes ``rank<r>.json`` (its parameters' SHA-256
and what torch.compile made: its graphs and the calls captured in them) to ``--report``."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln, self.fc, self.proj = torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.proj(torch.nn.functional.gelu(self.fc(self.ln(x))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--outer", action="store_true", help="torch.compile(DDP(model)) instead of DDP(torch.compile(model))")
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[Block(64) for _ in range(3)], torch.nn.Linear(64, 1))
    model = torch.compile(DDP(model)) if args.outer else DDP(torch.compile(model))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(args.steps):
        model(torch.randn(16, 64, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    os.makedirs(args.report, exist_ok=True)
    from torch._dynamo.utils import counters  # what torch.compile made of the script: the same traced or not

    compiled = {k: int(v) for k, v in counters["stats"].items()}
    with open(os.path.join(args.report, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"params_sha256": digest, "compiled": compiled}, f)
    # a clean gloo teardown (see fsdp_train.py): every rank past its last collective and DDP (its
    # reducer holds the group) gone before the group; torch 2.13 aborted a rank at exit otherwise,
    # once in CI ("terminate called without an active exception", after training and tracing ended)
    dist.barrier()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
