"""Test worker (run under torchrun by the tests): trains a small model under DDPTracer
and records, beside the trace, what independent instruments say about the same run:

- DDP's own runtime logging (``_get_ddp_logging_data`` at sample rate 1), per step;
- DDP's ``rebuilt_per_bucket_param_indices``;
- with ``--compare-untraced``: an identical, *untraced* DDP model (DDP's built-in
  all-reduce) trained on the same batches, and the largest parameter difference;
- ``dist.all_reduce`` of locally computed gradients vs the gradients DDP produced.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer import DDPTracer
from ddpscope.tracer.workloads.affinity import bind_local_rank_to_cores

LOG_KEYS = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
            "backward_compute_comm_overlap_time")


def build(width: int, depth: int) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--gradient-as-bucket-view", action="store_true")
    p.add_argument("--compare-untraced", action="store_true")
    p.add_argument("--step-boundary", choices=("auto", "explicit"), default="auto")
    p.add_argument("--no-optimizer-hooks", action="store_true", help="do not give the tracer the optimizer")
    p.add_argument("--grad-marks-every", type=int, default=1)
    p.add_argument("--capture", default="compiled")
    args = p.parse_args()
    # Each rank on its own cores, as the demo job does: on a 2-core machine the ranks'
    # threads would otherwise preempt each other for milliseconds at random, between the
    # tracer's timestamps and DDP's, which the two instruments would then disagree about.
    bind_local_rank_to_cores()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    try:
        torch.manual_seed(0)
        model = build(args.width, args.depth)
        reference = copy.deepcopy(model)
        ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.gradient_as_bucket_view)
        ddp._set_ddp_runtime_logging_sample_rate(1)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        if args.compare_untraced:
            ref_ddp = DDP(reference, bucket_cap_mb=args.bucket_cap_mb,
                          gradient_as_bucket_view=args.gradient_as_bucket_view)
            ref_opt = torch.optim.SGD(ref_ddp.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(100 + rank)
        gc.collect()
        gc.freeze()  # as the demo job does: short GC pauses, fewer late timestamps
        logging, allreduce_err = [], 0.0
        stamped: dict[int, list[int]] = {}  # per step, the parameters whose gradient the tracer stamped

        def on_step(record) -> None:
            stamped[record.step] = [param for param, _, _ in record.grads]

        with DDPTracer(ddp, None if args.no_optimizer_hooks else opt, out_dir=out / "trace",
                       step_boundary=args.step_boundary, grad_marks_every=args.grad_marks_every,
                       capture=args.capture, on_step=on_step) as tracer:
            for step in range(args.steps):
                x = torch.randn(64, args.width, generator=gen)
                y = torch.randn(64, 8, generator=gen)
                pred = ddp(x)
                d = ddp._get_ddp_logging_data()  # holds the previous iteration's timings
                if d.get("iteration", 0) >= 1 and all(k in d for k in LOG_KEYS):
                    logging.append({"step": int(d["iteration"]) - 1, **{k: int(d[k]) for k in LOG_KEYS}})
                loss = nn.functional.mse_loss(pred, y)
                loss.backward()
                if step == args.steps - 1:
                    # independent check of the averaged gradients with a plain dist.all_reduce
                    local = copy.deepcopy(ddp.module)
                    for q in local.parameters():
                        q.grad = None
                    nn.functional.mse_loss(local(x), y).backward()
                    for q, g in zip(ddp.module.parameters(), local.parameters()):
                        avg = g.grad.clone()
                        dist.all_reduce(avg)
                        avg /= world
                        allreduce_err = max(allreduce_err, float((q.grad - avg).abs().max()))
                opt.step()
                opt.zero_grad()
                if args.step_boundary == "explicit":
                    tracer.step()
                if args.compare_untraced:
                    nn.functional.mse_loss(ref_ddp(x), y).backward()
                    ref_opt.step()
                    ref_opt.zero_grad()
        result = {
            "rank": rank, "world_size": world, "logging": logging,
            "rebuilt_per_bucket_param_indices": ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices"),
            "allreduce_max_abs_err": allreduce_err, "stamped": stamped,
        }
        if args.compare_untraced:
            torch.set_grad_enabled(False)
            result["max_param_diff"] = max(float((a - b).abs().max()) for a, b in
                                           zip(ddp.module.parameters(), ref_ddp.module.parameters()))
            result["params_bitwise_equal"] = all(torch.equal(a, b) for a, b in
                                                 zip(ddp.module.parameters(), ref_ddp.module.parameters()))
        (out / f"check-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
