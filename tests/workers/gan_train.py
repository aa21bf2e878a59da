"""A GAN with two DDP models (the user's code: nothing of ddpscope's in it), for the
tests of several DDP models in one job. Each step trains the discriminator on real and
generated samples, then the generator through the discriminator (whose gradients DDP
all-reduces too, then the script zeroes them), each with its own Adam.

``--report DIR``: rank r writes DIR/rank<r>.json: each model's parameter checksum and the
bucket layout DDP rebuilt (``_get_ddp_logging_data``), for checks against the trace.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


class Generator(nn.Module):
    def __init__(self, z: int, width: int, out: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(z, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, out))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self, inp: int, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(inp, width), nn.LeakyReLU(0.2), nn.Linear(width, width),
                                 nn.LeakyReLU(0.2), nn.Linear(width, 1))

    def forward(self, x):
        return self.net(x)


def checksum(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--report")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        gen = DDP(Generator(32, args.width, 64), bucket_cap_mb=0.25)
        disc = DDP(Discriminator(64, 2 * args.width), bucket_cap_mb=0.5)
        opt_g = torch.optim.Adam(gen.parameters(), lr=1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(disc.parameters(), lr=1e-3, betas=(0.5, 0.999))
        bce = nn.BCEWithLogitsLoss()
        data = torch.Generator().manual_seed(100 + rank)
        for _ in range(args.steps):
            real = torch.randn(32, 64, generator=data) * 0.5 + 1.0
            z = torch.randn(32, 32, generator=data)
            fake = gen(z)
            loss_d = bce(disc(real), torch.ones(32, 1)) + bce(disc(fake.detach()), torch.zeros(32, 1))
            opt_d.zero_grad()
            loss_d.backward()
            opt_d.step()
            loss_g = bce(disc(fake), torch.ones(32, 1))
            opt_g.zero_grad()
            loss_g.backward()
            opt_g.step()
        if args.report:
            os.makedirs(args.report, exist_ok=True)
            with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
                json.dump({m: {"sha256": checksum(ddp.module),
                               "rebuilt": ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")}
                           for m, ddp in (("Generator", gen), ("Discriminator", disc))}, f)
        dist.barrier()
        del gen, disc, opt_g, opt_d
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
