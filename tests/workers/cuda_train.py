"""A small DDP training script on CUDA, for tests/tracer/capture/test_cuda.py (run under ``ddpscope run``).

    cuda_train.py --backend nccl|gloo --report PATH [--steps N] [--sync-debug-from K] [--temp-mib M]
                  [--gpu-sleep-ms MS]

Every rank trains on ``cuda:LOCAL_RANK % device_count`` (two ranks may share one GPU
with gloo, which all-reduces CUDA tensors through the host). After each
``optimizer.step()`` (where the tracer closes the step and measures memory) it records
``torch.cuda.memory_allocated`` and the bytes of parameters and gradients; rank r writes
them to PATH.r.json after every step, with the allocator's reserved bytes and peak. ``--sync-debug-from K``
turns torch's sync debug mode to "error" from step K on: any device or stream synchronize
inside a step (the tracer's included) raises. ``--temp-mib M`` allocates and frees M MiB
before training: the script's own peak, which the tracer must not reset. ``--gpu-sleep-ms
MS`` queues a kernel that keeps the GPU busy that long each step (``torch.cuda._sleep``: no
host time), so the host can run ahead of the device; each row then says whether the
previous step was still running on the device when this step's ``optimizer.step()``
returned (``previous_running``: an event per step, queried, never waited for).
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
    p.add_argument("--sync-debug-from", type=int, default=-1)
    p.add_argument("--temp-mib", type=int, default=0)
    p.add_argument("--gpu-sleep-ms", type=float, default=0.0)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group(args.backend)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]).to(device)
    ddp = DDP(model, device_ids=[device.index], bucket_cap_mb=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    if args.temp_mib:
        temp = torch.empty(args.temp_mib * 2**20, dtype=torch.uint8, device=device)  # the script's own peak
        del temp
    rows = []
    khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0) or 1_500_000  # SM clock (older torch: a guess)
    cycles = int(args.gpu_sleep_ms * khz)
    ends: list = []  # an event after each step's optimizer.step(), on the current stream
    for step in range(args.steps):
        if step == args.sync_debug_from:
            torch.cuda.set_sync_debug_mode("error")
        if cycles:
            torch.cuda._sleep(cycles)
        x = torch.randn(64, 1024, device=device)
        ddp(x).square().mean().backward()
        opt.step()
        previous_running = bool(ends) and not ends[-1].query()  # a query: no wait
        ends.append(torch.cuda.Event())
        ends[-1].record()
        rows.append({"step": step, "previous_running": previous_running,
                     "allocated_bytes": torch.cuda.memory_allocated(device),
                     "params_bytes": sum(q.numel() * q.element_size() for q in model.parameters()),
                     "grads_bytes": sum(q.grad.numel() * q.grad.element_size() for q in model.parameters()),
                     "reserved_bytes": torch.cuda.memory_reserved(device),
                     "peak_allocated_bytes": torch.cuda.max_memory_allocated(device)})
        # every step: `ddpscope run --steps N` ends the job inside the N-th step's optimizer.step()
        with open(f"{args.report}.{dist.get_rank()}.json", "w") as f:
            json.dump(rows, f)
        opt.zero_grad(set_to_none=False)
    torch.cuda.set_sync_debug_mode(0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
