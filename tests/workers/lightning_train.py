"""A PyTorch Lightning training script (no ddpscope code): ``Trainer(strategy=DDPStrategy(...))``
on CPU under torchrun. Writes what Lightning's DDP model used to ``--report``."""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self, width: int = 256, depth: int = 6) -> None:
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Report(L.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, module) -> None:
        ddp = trainer.strategy.model
        d = ddp._get_ddp_logging_data()
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, f"check-rank{trainer.global_rank}.json"), "w") as f:
            json.dump({"class": type(ddp).__name__, "bucket_bytes_cap": ddp.bucket_bytes_cap,
                       "rebuilt": d.get("rebuilt_per_bucket_param_indices"), "global_step": trainer.global_step}, f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--bucket-cap-mb", type=float, default=None)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    args = p.parse_args()
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(1024, 256), torch.randn(1024, 4))
    kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy=DDPStrategy(process_group_backend="gloo", **kw), max_steps=args.steps,
        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Report(args.report)],
    )
    trainer.fit(Regressor(), DataLoader(data, batch_size=32))


if __name__ == "__main__":
    main()
