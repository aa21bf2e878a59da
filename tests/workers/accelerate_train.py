"""A Hugging Face Accelerate training script (no ddpscope code): ``Accelerator`` with
``DistributedDataParallelKwargs(bucket_cap_mb=...)`` on CPU under torchrun. Writes what
Accelerate's DDP model used to ``--report``."""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn as nn
from accelerate import Accelerator, DistributedDataParallelKwargs
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    args = p.parse_args()
    kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accumulate,
                              kwargs_handlers=[DistributedDataParallelKwargs(**kw)])
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(2048, 256), torch.randn(2048, 4)), batch_size=32)
    model, opt, data = accelerator.prepare(model, opt, data)
    steps = 0
    for x, y in data:
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        if accelerator.sync_gradients:
            steps += 1
            if steps == args.steps:
                break
    d = model._get_ddp_logging_data()
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"check-rank{accelerator.process_index}.json"), "w") as f:
        json.dump({"class": type(model).__name__, "bucket_bytes_cap": model.bucket_bytes_cap,
                   "rebuilt": d.get("rebuilt_per_bucket_param_indices"), "steps": steps}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
