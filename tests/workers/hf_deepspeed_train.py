"""Hugging Face Trainer with DeepSpeed ZeRO, as its users run it (the user's code: nothing
of ddpscope's in it): a tiny GPT-2 (its head tied to the token embedding) from
``GPT2Config`` (no download), random tokens, DeepSpeed's config as a dict in
``TrainingArguments(deepspeed=...)``; the Trainer builds the engine through Accelerate.

``--lora``: PEFT's LoRA on the attention (``get_peft_model``, as PEFT's docs fine-tune):
the base model frozen, the adapters trained.

``--report DIR``: rank r writes DIR/check-rank<r>.json after training: the parameters'
checksum, their count (each once: the tied weight is one parameter), the stage; with
``--lora`` PEFT's own count of the trainable and all parameters, and (ZeRO-3) this rank's
partition of every parameter (each one's ``ds_tensor``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from hf_trainer_train import RandomTokens  # its sibling's data (the script's folder is on sys.path)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--report", required=True)
    p.add_argument("--lora", action="store_true")
    args = p.parse_args()
    os.makedirs(args.report, exist_ok=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    peft_counts = None
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True,
                                                 lora_dropout=0.0, task_type="CAUSAL_LM"))
        peft_counts = dict(zip(("trainable", "all"), model.get_nb_trainable_parameters()))
    # explicit sizes: the Trainer's "auto" fills train_batch_size for one process on CPU
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 20000}}
    training = TrainingArguments(output_dir=os.path.join(args.report, "hf"), per_device_train_batch_size=4,
                                 max_steps=args.steps, deepspeed=ds, save_strategy="no", report_to=[],
                                 logging_steps=2, learning_rate=3e-4, seed=0, dataloader_num_workers=0)
    trainer = Trainer(model=model, args=training, train_dataset=RandomTokens(n=256, length=32, vocab=256))
    trainer.train()
    engine = trainer.model_wrapped
    digest = hashlib.sha256()
    for name, param in sorted(engine.module.named_parameters()):
        digest.update(name.encode())
        digest.update(param.detach().float().numpy().tobytes())
    rank = dist.get_rank()
    with open(os.path.join(args.report, f"check-rank{rank}.json"), "w") as f:
        json.dump({"params_sha256": digest.hexdigest(), "class": type(engine).__name__,
                   "stage": engine.zero_optimization_stage(),
                   "numel": sum(p.numel() for p in engine.module.parameters()),
                   "global_step": trainer.state.global_step, "peft": peft_counts,
                   "partition_numel": sum(p.ds_tensor.numel() for p in engine.module.parameters()
                                          if getattr(p, "ds_tensor", None) is not None)}, f)
    engine.destroy()
    dist.barrier()


if __name__ == "__main__":
    main()
