"""A PyTorch Lightning script that shards with FSDP2 (no ddpscope code):
``ModelParallelStrategy`` (data parallel only) with ``fully_shard`` applied per block in
``configure_model``, as Lightning's docs do; CPU and gloo under torchrun. Writes each
rank's final parameters' checksum to ``--report``."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset


class Blocks(L.LightningModule):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Report(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, module) -> None:
        h = hashlib.sha256()
        for p in module.parameters():
            h.update(p.detach().to_local().numpy().tobytes())
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, f"check-rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"params_sha256": h.hexdigest(), "global_step": trainer.global_step}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 64), torch.randn(256, 4))
    world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Report(args.report)],
    )
    module = Blocks()
    trainer.fit(module, DataLoader(data, batch_size=16))
    # A clean gloo teardown (see user_train.py): torch 2.13 aborts a rank at exit when the
    # sharded model outlives its group; every rank past its last collective first
    if dist.is_initialized():
        dist.barrier()
        del trainer, module
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
