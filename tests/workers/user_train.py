"""A plain torchrun DDP training script with no ddpscope code in it (the tests run it
under ``ddpscope run`` and under torchrun alone). It reports what it can see itself,
beside the trace, to ``--report`` (one JSON file per rank):

- its own timings of every micro-batch's forward and ``loss.backward()`` (perf_counter);
- DDP's runtime logging (sample rate 1) for each step's syncing pass;
- a SHA-256 of its parameters after training (bit-identity with an untraced run).

Options cover the cases ``ddpscope run`` must handle: gradient accumulation
(``--accumulate``), a communication hook of the script's own (``--hook``), two DDP
models, no DDP model at all, the script's own ``bucket_cap_mb``, a failure on a rank.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import _functional_collectives as funcol  # --functional (DTensor's kind of collective)
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

LOG_KEYS = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
            "backward_compute_comm_overlap_time")


def build(width: int, depth: int, batchnorm: bool = False) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), *([nn.BatchNorm1d(width)] if batchnorm else []), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


class WithUnusedHead(nn.Module):
    """A model whose second head takes no part in the loss (a branch for another task, as
    in multimodal and multi-task code): DDP needs ``find_unused_parameters=True``."""

    def __init__(self, body: nn.Module, width: int) -> None:
        super().__init__()
        self.body, self.unused_head = body, nn.Linear(width, 8)

    def forward(self, x):
        return self.body(x)


def register_hook(ddp: DDP, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if name == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif name == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=True, warm_start=False,
                                       random_seed=0)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    elif name == "builtin-fp16":
        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    elif name == "custom":  # a hook of one's own (DDP docs' encode/decode pattern): scale, sum, decode
        def scaled_sum(state, bucket):
            buf = bucket.buffer().mul_(state)
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0].clone())

        ddp.register_comm_hook(1.0 / dist.get_world_size(), scaled_sum)


def params_sha256(module: nn.Module) -> str:
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().float().contiguous().numpy().tobytes())  # bf16 has no numpy dtype; fp32 as it is
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--report", required=True, help="folder for check-rank<r>.json")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--hook", default="none", choices=("none", "bf16", "fp16", "powersgd", "builtin-fp16", "custom"))
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="the script's own bucket_cap_mb")
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--two-models", action="store_true")
    p.add_argument("--find-unused", action="store_true", help="a head the loss never uses, find_unused_parameters=True")
    p.add_argument("--find-unused-flag-only", action="store_true",
                   help="find_unused_parameters=True on a model whose every parameter is used")
    p.add_argument("--static-graph", action="store_true", help="DDP(static_graph=True)")
    p.add_argument("--batchnorm", action="store_true", help="a BatchNorm1d after each layer: buffers DDP broadcasts")
    p.add_argument("--grad-as-bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True)")
    p.add_argument("--delay-allreduce", type=int, default=0,
                   help="DDP(delay_all_reduce_named_params=) the first N parameters: DDP all-reduces them itself, "
                        "outside its reducer, when the first parameter's gradient is ready")
    p.add_argument("--no-ddp", action="store_true")
    p.add_argument("--python-reducer", action="store_true", help="compiled autograd's Python reducer for DDP")
    p.add_argument("--fail-rank", type=int, default=-1, help="-2: every rank, each with its own error")
    p.add_argument("--fail-step", type=int, default=-1)
    p.add_argument("--join", action="store_true",
                   help="uneven inputs: the last rank has one step fewer; the loop runs under Join([ddp])")
    p.add_argument("--loss-allreduce", action="store_true",
                   help="average the loss across ranks for logging (an all_reduce after backward, DDP's group)")
    p.add_argument("--functional", action="store_true",
                   help="--loss-allreduce with torch's functional all_reduce (DTensor's kind: waited for when used)")
    p.add_argument("--catch-exit", type=int, default=0,
                   help="catch this many SystemExits out of optimizer.step() and train on (a framework's wrapper)")
    p.add_argument("--abort-at-exit", type=int, default=-1,
                   help="this rank aborts (SIGABRT) after destroy_process_group: a failure at exit, after training")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank's forward sleeps --slow-ms each pass")
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--freeze", type=int, default=0,
                   help="the first N layers' parameters do not train (requires_grad=False: a partial fine-tune)")
    p.add_argument("--frozen-bf16", action="store_true",
                   help="the frozen layers in bfloat16, forward under CPU autocast (a bf16 base model beside fp32 "
                        "adapters, as PEFT keeps them)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        torch.manual_seed(0)
        model = build(args.width, args.depth, args.batchnorm)
        for layer in [m for m in model if isinstance(m, nn.Linear)][:args.freeze]:
            layer.requires_grad_(False)
            if args.frozen_bf16:
                layer.to(torch.bfloat16)
        if args.no_ddp:
            for _ in range(args.steps):
                model(torch.randn(4, args.width)).sum().backward()
            return
        kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
        if args.find_unused:
            model, kw["find_unused_parameters"] = WithUnusedHead(model, args.width), True
        if args.find_unused_flag_only:  # the flag set, every parameter used (Hugging Face Trainer's default case)
            kw["find_unused_parameters"] = True
        if args.static_graph:
            kw["static_graph"] = True
        if args.grad_as_bucket_view:
            kw["gradient_as_bucket_view"] = True
        if args.delay_allreduce:
            named = list(model.named_parameters())
            kw["delay_all_reduce_named_params"] = named[:args.delay_allreduce]
            kw["param_to_hook_all_reduce"] = named[0][1]  # its gradient is among the last ready
        if args.python_reducer:
            torch._dynamo.config.optimize_ddp = "python_reducer"
        if rank == args.slow_rank:  # a straggler: a slower machine, or more data on this rank
            model.register_forward_pre_hook(lambda m, a: time.sleep(args.slow_ms / 1e3))
        ddp = DDP(model, **kw)
        ddp._set_ddp_runtime_logging_sample_rate(1)
        if args.hook != "none":
            register_hook(ddp, args.hook)
        other = DDP(build(64, 2)) if args.two_models else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        gen = torch.Generator().manual_seed(100 + rank)
        own, logging, losses = [], [], []
        steps = args.steps - (args.join and rank == dist.get_world_size() - 1)
        joined = Join([ddp]) if args.join else contextlib.nullcontext()
        joined.__enter__()
        grad_bytes = 0
        for step in range(steps):
            if rank == args.fail_rank and step == args.fail_step or args.fail_rank == -2 and step == args.fail_step:
                raise RuntimeError(f"user script failed on rank {rank} at step {step}")
            for micro in range(args.accumulate):
                sync = micro == args.accumulate - 1
                x = torch.randn(64, args.width, generator=gen)
                y = torch.randn(64, 8, generator=gen)
                autocast = torch.autocast("cpu", dtype=torch.bfloat16) if args.frozen_bf16 else contextlib.nullcontext()
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    t0 = time.perf_counter()
                    with autocast:
                        out = ddp(x).float()
                    t1 = time.perf_counter()
                    if sync:
                        d = ddp._get_ddp_logging_data()  # the previous syncing pass's timings
                        if d.get("iteration", 0) >= 1 and all(k in d for k in LOG_KEYS):
                            logging.append({"step": step - 1, **{k: int(d[k]) for k in LOG_KEYS}})
                    loss = nn.functional.mse_loss(out, y) / args.accumulate
                    t2 = time.perf_counter()
                    loss.backward()
                    t3 = time.perf_counter()
                own.append({"step": step, "micro": micro, "sync": sync,
                            "forward_ms": (t1 - t0) * 1e3, "backward_ms": (t3 - t2) * 1e3})
            if args.loss_allreduce and args.functional:
                mean = funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)  # waits at float()
                losses.append(float(mean) / dist.get_world_size())
            elif args.loss_allreduce:
                mean = loss.detach().clone()
                dist.all_reduce(mean)
                losses.append(float(mean) / dist.get_world_size())
            try:
                opt.step()
            except SystemExit:
                if args.catch_exit <= 0:
                    raise
                args.catch_exit -= 1
                print(f"rank {rank}: caught SystemExit after step {step}, training on", file=sys.stderr, flush=True)
            grad_bytes = sum(q.grad.numel() * q.grad.element_size() for q in ddp.parameters() if q.grad is not None)
            opt.zero_grad()
            if other is not None:
                other(torch.randn(4, 64)).sum().backward()
        joined.__exit__(None, None, None)  # a rank out of data shadows the others' collectives until all are
        os.makedirs(args.report, exist_ok=True)
        with open(os.path.join(args.report, f"check-rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "buffer_bytes": sum(b.numel() * b.element_size() for b in ddp.module.buffers()),
                       "param_bytes": sum(q.numel() * q.element_size() for q in ddp.module.parameters()),
                       "frozen_numel": sum(q.numel() for q in ddp.module.parameters() if not q.requires_grad),
                       "grad_bytes": grad_bytes,  # at the last step's end, before zero_grad
                       "optimizer_state_bytes": sum(t.numel() * t.element_size() for s in opt.state.values()
                                                    for t in s.values() if isinstance(t, torch.Tensor)),
                       "own": own, "logging": logging, "losses": losses, "steps": steps, "params_sha256": params_sha256(ddp.module),
                       "bucket_bytes_cap": ddp.bucket_bytes_cap,
                       "delayed_bytes": 0 if ddp._delay_grad_buffer is None else
                       ddp._delay_grad_buffer.numel() * ddp._delay_grad_buffer.element_size(),
                       "bucket_bytes_cap_list": list(getattr(ddp, "bucket_bytes_cap_list", [])),
                       "rebuilt": ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices"),
                       "bucket_sizes": [int(b) for b in str(ddp._get_ddp_logging_data().get("bucket_sizes", ""))
                                        .split(",") if b.strip()]}, f)
        # A clean gloo teardown: every rank done with its last collective, the DDP reducers
        # (and a comm hook's pending futures) released before their process group goes. Without
        # it torch 2.13 sometimes aborts one rank at exit ("terminate called without an active
        # exception"), untraced as well as traced.
        dist.barrier()
        del ddp, other, opt
    finally:
        # ddpscope's --steps ends the script with a SystemExit that skips the teardown above:
        # the script's references to its DDP models go here too, before their process group
        model = ddp = other = opt = joined = None  # noqa: F841
        gc.collect()
        rank = dist.get_rank() if dist.is_initialized() else -1
        dist.destroy_process_group()
    if rank == args.abort_at_exit:  # as torch's gloo sometimes does at interpreter exit (ZeRO-3, DeepSpeed)
        os.abort()


if __name__ == "__main__":
    sys.exit(main())
