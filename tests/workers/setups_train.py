"""Ordinary DDP scripts that once died under ``ddpscope run`` (issue 20), with no ddpscope
code in them; the tests run each under ``ddpscope run`` and under torchrun alone and
compare every parameter bit for bit (``--report``: one JSON file per rank).

- ``gan``: two DDP models (a generator, traced, and a discriminator), one Adam each, and
  an optimizer ddpscope does not trace (a plain module's SGD, stepped first). The
  generator's hook is registered with DDP's keyword form, ``register_comm_hook(state=None,
  hook=...)``; the discriminator's through the class, ``DDP.register_comm_hook(D, None, h)``.
- ``zero``: one DDP model stepped by ``ZeroRedundancyOptimizer`` (Adam inside), its
  built-in hook registered by keyword (``_register_builtin_comm_hook(comm_hook_type=...)``).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP


def mlp(width: int, depth: int, out: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, out))


def sha256(*modules: nn.Module) -> str:
    h = hashlib.sha256()
    for m in modules:
        for p in m.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def gan(steps: int, rank: int) -> dict:
    torch.manual_seed(0)
    gen, disc, head = mlp(32, 3, 32), mlp(32, 2, 1), nn.Linear(32, 1)
    G = DDP(gen, bucket_cap_mb=0.01)
    G.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
    D = DDP(disc)
    DDP.register_comm_hook(D, None, default_hooks.fp16_compress_hook)
    opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
    opt_head = torch.optim.SGD(head.parameters(), lr=1e-2)  # not a DDP model's: ddpscope leaves it alone
    data = torch.Generator().manual_seed(10 + rank)
    for _ in range(steps):
        z, real = torch.randn(16, 32, generator=data), torch.randn(16, 32, generator=data)
        head(real).pow(2).mean().backward()
        opt_head.step()
        opt_head.zero_grad()
        # discriminator: real against generated (no gradient into the generator)
        with torch.no_grad():
            fake = G(z)
        d_loss = nn.functional.softplus(-D(real)).mean() + nn.functional.softplus(D(fake)).mean()
        opt_d.zero_grad()
        d_loss.backward()
        opt_d.step()
        # generator
        g_loss = nn.functional.softplus(-D(G(z))).mean()
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    return {"params_sha256": sha256(G.module, D.module, head), "models": [G, D]}


def zero(steps: int, rank: int, bucket_view: bool = False, hook: bool = True) -> dict:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = DDP(mlp(64, 4, 8), bucket_cap_mb=0.02)
    if hook:
        model._register_builtin_comm_hook(comm_hook_type=dist.BuiltinCommHookType.FP16_COMPRESS)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3,
                                  parameters_as_bucket_view=bucket_view)
    data = torch.Generator().manual_seed(10 + rank)
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=data), torch.randn(32, 8, generator=data)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    own = [p for g in opt.optim.param_groups for p in g["params"]]  # the inner optimizer: this rank's partition
    return {"params_sha256": sha256(model.module), "models": [model],
            "optimizer_state_keys": sorted(len(s) for s in opt.optim.state.values()),
            "own_bytes": sum(p.numel() * p.element_size() for p in own),
            "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "state_bytes": sum(t.untyped_storage().nbytes() for s in opt.optim.state.values() for t in s.values()
                               if isinstance(t, torch.Tensor)),
            "sync_params_wrapped": "_sync_params" in vars(opt)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=("gan", "zero"))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--bucket-view", action="store_true", help="zero: parameters_as_bucket_view=True")
    p.add_argument("--no-hook", action="store_true", help="zero: no FP16 compression hook")
    p.add_argument("--report", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = gan(args.steps, rank) if args.case == "gan" else \
            zero(args.steps, rank, bucket_view=args.bucket_view, hook=not args.no_hook)
        models = result.pop("models")
        os.makedirs(args.report, exist_ok=True)
        with open(os.path.join(args.report, f"check-rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, **result}, f)
        # A clean gloo teardown (see user_train.py): every rank past its last collective, the
        # DDP models (reference cycles: hence the collection) released before their group goes
        dist.barrier()
        del models
        gc.collect()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
