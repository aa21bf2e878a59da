"""The demo training job: one process per rank, started by torchrun (see runner.py).

Rank 0 prints one progress line per step (``ddpscope-progress {json}``) for the runner.
"""

from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from tracer.workloads.demo.models import MODELS, build_model
from tracer.capture.tracer import DDPTracer, TracerConfig
from tracer.workloads.worker import FAIL_ENV, HANG_ENV, init_worker, injected, progress



def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pg-timeout-s", type=float, default=600.0)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)






@record
def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_worker(args.pg_timeout_s)
    use_cuda = device.type == "cuda"
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts)
        model = build_model(args.model).to(device)
        ddp = DDP(model, device_ids=[device.index] if use_cuda else None,
                  bucket_cap_mb=args.bucket_cap_mb,
                  gradient_as_bucket_view=args.gradient_as_bucket_view)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own data
        fail_at, hang_at = injected(FAIL_ENV, rank), injected(HANG_ENV, rank)
        n_params = sum(p.numel() for p in model.parameters())
        cfg = TracerConfig(out_dir=args.out, run_meta={
            "model": args.model, "model_params": n_params, "steps_requested": args.steps,
            "seed": args.seed, "lr": args.lr,
        })
        # As torchtitan does: objects made during set-up never need collecting; freezing
        # them keeps Python's full collections (GIL-holding pauses that delay all-reduce
        # callbacks by tens of ms) short during training.
        gc.collect()
        gc.freeze()
        if rank == 0:
            progress(event="start", world_size=world, model=args.model, params=n_params, steps=args.steps)
        with DDPTracer(ddp, opt, config=cfg):
            for step in range(args.steps):
                t0 = time.perf_counter()
                if step == fail_at:
                    raise RuntimeError(f"injected failure on rank {rank} at step {step} ({FAIL_ENV})")
                if step == hang_at:
                    time.sleep(10**6)
                x, y = (t.to(device, non_blocking=True) for t in model.batch(gen))
                loss = model.loss(ddp(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if rank == 0:
                    # loss.item(): a CPU-GPU sync on CUDA, once per step, after the step is done
                    progress(event="step", step=step + 1, steps=args.steps, loss=round(loss.item(), 5),
                              ms=round((time.perf_counter() - t0) * 1e3, 1))
        if rank == 0:
            progress(event="done", steps=args.steps)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
