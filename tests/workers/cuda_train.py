"""A small DDP training script on CUDA, for tests/tracer/capture/test_cuda.py (run under ``ddpscope run``).

    cuda_train.py --backend nccl|gloo --report PATH [--steps N]

Every rank trains on ``cuda:LOCAL_RANK % device_count`` (two ranks may share one GPU
with gloo, which all-reduces CUDA tensors through the host). After each
``optimizer.step()`` (where the tracer closes the step and measures memory) it records
``torch.cuda.memory_allocated`` and the bytes of parameters and gradients; rank r writes
them to PATH.r.json.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", choices=["nccl", "gloo"], required=True)
    p.add_argument("--report", required=True)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).to(device)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    rows = []
    for step in range(args.steps):
        x = torch.randn(64, 1024, device=device)
        ddp(x).square().mean().backward()
        opt.step()
        rows.append({"step": step, "allocated_bytes": torch.cuda.memory_allocated(device),
                     "params_bytes": sum(q.numel() * q.element_size() for q in model.parameters()),
                     "grads_bytes": sum(q.grad.numel() * q.grad.element_size() for q in model.parameters())})
        opt.zero_grad(set_to_none=False)
    with open(f"{args.report}.{dist.get_rank()}.json", "w") as f:
        json.dump(rows, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
