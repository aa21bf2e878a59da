"""A user's DeepSpeed script, as the tutorials write it: a small MLP, a client AdamW
(torch's: no C++ optimizer to build), ``deepspeed.initialize`` with a config dict, the
engine's own forward/backward/step, under torchrun on the CPU accelerator (gloo). Writes
``--report``/check-rank<r>.json: what the engine says it ran with (its own accessors, the
independent instrument) and a digest of the parameters."""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--reduce-bucket-size", type=int, default=50_000, help="elements (DeepSpeed's unit)")
    p.add_argument("--config-file", action="store_true", help="hand DeepSpeed a JSON file, not a dict")
    p.add_argument("--overlap-comm", action="store_true", help="zero_optimization.overlap_comm")
    p.add_argument("--persistence-threshold", type=int, default=0,
                   help="stage3_param_persistence_threshold (elements; DeepSpeed's default 100000)")
    p.add_argument("--loss-allreduce", action="store_true",
                   help="average each loss over the ranks with torch.distributed.all_reduce (not deepspeed.comm), "
                        "after backward, before the step: the script's own collective in the step")
    p.add_argument("--offload", choices=["optimizer", "both"], help="ZeRO-Offload to cpu: the optimizer's states "
                   "(offload_optimizer), or those and the parameters (offload_param, stage 3); the client AdamW kept "
                   "(zero_force_ds_cpu_optimizer false: DeepSpeedCPUAdam would build another C++ op)")
    p.add_argument("--freeze", action="store_true", help="the first two layers do not train (requires_grad=False: "
                   "a partial fine-tune); the optimizer gets those that do, as the Hugging Face Trainer hands them")
    args = p.parse_args()
    import deepspeed

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": args.accumulate,
              "zero_optimization": {"stage": args.stage, "reduce_bucket_size": args.reduce_bucket_size,
                                    "allgather_bucket_size": args.reduce_bucket_size,
                                    "stage3_prefetch_bucket_size": args.reduce_bucket_size,
                                    "stage3_param_persistence_threshold": args.persistence_threshold, "overlap_comm": args.overlap_comm},
              "bf16": {"enabled": args.bf16}, "steps_per_print": 10**9}
    if args.offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if args.offload == "both":
        config["zero_optimization"]["offload_param"] = {"device": "cpu"}
    if args.config_file:
        path = os.path.join(args.report, f"ds-config-{os.environ.get('RANK', '0')}.json")
        os.makedirs(args.report, exist_ok=True)
        with open(path, "w") as f:
            json.dump(config, f)
        config = path
    if args.freeze:
        model[0].requires_grad_(False)
        model[2].requires_grad_(False)
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    losses, loss_means = [], []
    for step in range(args.steps):
        for _ in range(args.accumulate):
            x = torch.randn(4, 64, generator=gen)
            y = torch.randn(4, 8, generator=gen)
            if args.bf16:
                x, y = x.bfloat16(), y.bfloat16()
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            if args.loss_allreduce:
                mean = loss.detach().float().clone()
                dist.all_reduce(mean)
                loss_means.append(float(mean) / dist.get_world_size())
            engine.step()
        losses.append(float(loss.detach().float()))
        print(f"rank {rank}: step {step + 1} loss {losses[-1]:.6f}", flush=True)
    digest = hashlib.sha256()
    for name, param in sorted(engine.module.named_parameters()):
        full = param.ds_tensor if hasattr(param, "ds_tensor") else param  # ZeRO-3: this rank's partition
        digest.update(name.encode())
        digest.update(full.detach().float().contiguous().numpy().tobytes())
    os.makedirs(args.report, exist_ok=True)
    with open(os.path.join(args.report, f"check-rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "stage": int(engine.zero_optimization_stage()),
                   "reduce_bucket_size": int(engine.zero_reduce_bucket_size()),
                   "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
                   "bf16": bool(engine.bfloat16_enabled()), "losses": losses, "loss_means": loss_means,
                   "params_sha256": digest.hexdigest(),
                   "numel": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()),
                   "trainable_numel": sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters()
                                          if p.requires_grad),
                   # ZeRO-3: this rank's partition of every parameter, each its own (padded)
                   "partition_numel": sum(p.ds_tensor.numel() for p in engine.module.parameters()
                                          if getattr(p, "ds_tensor", None) is not None)}, f)
    # a clean teardown: ZeRO-3 under gloo can abort a rank at exit otherwise (an async
    # all-gather's last reference dropped after finalisation began)
    engine.destroy()
    del engine, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
