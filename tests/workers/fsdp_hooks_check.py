"""After ``dist.destroy_process_group()`` (where ``ddpscope run`` closes the trace), does
anything of ddpscope's stay on the FSDP2 model? Writes what it finds per rank."""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_collectives


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--hsdp", action="store_true", help="a 2-D mesh: every rank a replica (HSDP)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard")) if args.hsdp \
        else init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(4, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    groups = [m._get_fsdp_state()._fsdp_param_group for m in (model[0], model[1])]
    during = [sorted(k for k in vars(g) if k in ("pre_forward", "post_backward", "unshard")) for g in groups]
    stand_in = _fsdp_collectives.dist is not dist  # HSDP: its all-reduce timed
    backward_call = torch.autograd.backward  # each backward call cut while traced
    dist.barrier()
    dist.destroy_process_group()  # the trace closes here
    after = {
        "instance_methods": [sorted(k for k in vars(g) if k in ("pre_forward", "post_forward", "pre_backward",
                                                                 "post_backward", "unshard", "wait_for_unshard"))
                             for g in groups],
        "comm_classes": [type(g._all_gather_comm).__name__ + "/" + type(g._reduce_scatter_comm).__name__ for g in groups],
        "comm_subclassed": [getattr(type(g._all_gather_comm), "_ddpscope", False) for g in groups],
        "module_hooks": [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in (model,)],
        "during": during,
        "stand_in_during": stand_in,
        "collectives_dist_is_torch": _fsdp_collectives.dist is dist,
        "backward_call_patched_during": hasattr(backward_call, "__wrapped__"),
        "backward_call_is_torch": [getattr(torch.autograd, n).__module__ for n in ("backward", "grad")] ==
        ["torch.autograd", "torch.autograd"] and not hasattr(torch.autograd.backward, "__wrapped__")
        and not hasattr(torch.autograd.grad, "__wrapped__"),
    }
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
        json.dump(after, f)
    # the sharded model (reference cycles) goes before the interpreter's teardown: left to
    # it, torch 2.13's gloo threads abort the process now and then (see fsdp_train.py)
    del groups, model, opt, mesh
    gc.collect()


if __name__ == "__main__":
    main()
