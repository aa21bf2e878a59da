"""Hugging Face Trainer as its users run it (the user's code: nothing of ddpscope's in it):
a tiny GPT-2 built from ``GPT2Config`` (no download), random tokens, CPU, gloo, and the
Trainer's own defaults (its DDP has ``find_unused_parameters=True``).

``--report DIR``: rank r writes DIR/rank<r>.json after training: the parameters' checksum,
and what DDP itself says of its buckets (``_get_ddp_logging_data``: their sizes, the
rebuilt layout) and of its flags.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(Dataset):
    def __init__(self, n: int = 512, length: int = 64, vocab: int = 512) -> None:
        self.data = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--report", required=True)
    args = p.parse_args()
    os.makedirs(args.report, exist_ok=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=2))
    training = TrainingArguments(output_dir=os.path.join(args.report, "hf"), per_device_train_batch_size=4,
                                 max_steps=args.steps, gradient_accumulation_steps=args.accumulate, logging_steps=2,
                                 save_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
                                 learning_rate=3e-4, seed=0)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens())
    trainer.train()
    ddp = trainer.model_wrapped
    data = ddp._get_ddp_logging_data()
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().numpy().tobytes())
    rank = dist.get_rank()
    with open(os.path.join(args.report, f"rank{rank}.json"), "w") as f:
        json.dump({"params_sha256": digest.hexdigest(), "class": type(ddp).__name__,
                   "find_unused_parameters": bool(ddp.find_unused_parameters),
                   "bucket_sizes": [int(b) for b in str(data.get("bucket_sizes", "")).split(",") if b.strip()],
                   "rebuilt": data.get("rebuilt_per_bucket_param_indices"), "global_step": trainer.state.global_step},
                  f)


if __name__ == "__main__":
    main()
