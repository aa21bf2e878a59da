"""The demo training script: a plain torchrun DDP script, with no ddpscope code in it.

``ddpscope run --demo gpt`` runs it like any user's script (``-m
tracer.workloads.demo.train``), traced by the zero-code capture; ``--bucket-cap-mb``
reaches DDP through the capture's override. Run it yourself with torchrun too::

    torchrun --nproc-per-node 2 -m ddpscope.tracer.workloads.demo.train --model gpt --steps 20

``--accumulate K``: gradient accumulation over K micro-batches (``no_sync()`` on the
first K-1).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer.options import DEMO_MODELS
from ddpscope.tracer.workloads.demo.models import build_model
from ddpscope.tracer.workloads.worker import DELAY_ENV, FAIL_ENV, HANG_ENV, STALL_ENV, init_worker, injected


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=DEMO_MODELS, default="mlp")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--pg-timeout-s", type=float, default=600.0)
    return p.parse_args(argv)


def _inject_in_forward(model, rank: int, at_step: list[int]) -> None:
    """Test-only faults inside the model's forward (``STALL_ENV``, ``DELAY_ENV``)."""
    stall, delay_ms = injected(STALL_ENV, rank), injected(DELAY_ENV, rank)
    if stall is None and not delay_ms:
        return

    def forward_pre_hook(module, args):
        if at_step[0] == stall:
            while True:  # stuck in Python, inside the forward
                time.sleep(3600)
        if delay_ms:
            time.sleep(delay_ms / 1000)

    model.register_forward_pre_hook(forward_pre_hook)


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    device = init_worker(args.pg_timeout_s)
    use_cuda = device.type == "cuda"
    try:
        rank = dist.get_rank()
        torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts)
        model = build_model(args.model).to(device)
        ddp = DDP(model, device_ids=[device.index] if use_cuda else None,
                  gradient_as_bucket_view=args.gradient_as_bucket_view)
        opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own data
        fail_at, hang_at = injected(FAIL_ENV, rank), injected(HANG_ENV, rank)
        at_step = [0]
        _inject_in_forward(model, rank, at_step)
        # As torchtitan does: objects made during set-up never need collecting; freezing
        # them keeps Python's full collections (GIL-holding pauses that delay all-reduce
        # callbacks by tens of ms) short during training.
        gc.collect()
        gc.freeze()
        for step in range(args.steps):
            at_step[0] = step
            t0 = time.perf_counter()
            if step == fail_at:
                raise RuntimeError(f"injected failure on rank {rank} at step {step} ({FAIL_ENV})")
            if step == hang_at:
                time.sleep(10**6)
            for micro in range(args.accumulate):
                last = micro == args.accumulate - 1
                x, y = (t.to(device, non_blocking=True) for t in model.batch(gen))
                with contextlib.nullcontext() if last else ddp.no_sync():
                    loss = model.loss(ddp(x), y) / args.accumulate
                    loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rank == 0:
                # loss.item(): a CPU-GPU sync on CUDA, once per step, after the step is done
                print(f"step {step + 1}/{args.steps} loss {loss.item() * args.accumulate:.4f} "
                      f"{(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
