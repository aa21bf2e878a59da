"""Worker for tests/tracer/capture/ddp/test_compiled.py: two checks in one 2-rank job (gloo, CPU).

``--mode agree``: one DDP model traced through the Python hook, whose all-reduces go
through the compiled wrapper as well: both instruments time the same collectives; the
wrapper's records per step go to the report, the hook's to the trace.
``--mode detach``: two DDP models traced with the compiled capture at once for a few
steps, then untraced; the report has each model's records and parameter hashes.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer import DDPTracer
from ddpscope.tracer.capture.ddp.compiled import load_extension


def build(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def sha(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def step(ddp: DDP, opt, gen: torch.Generator, width: int) -> None:
    ddp(torch.randn(32, width, generator=gen)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("agree", "detach"), required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--traced", type=int, default=6)
    p.add_argument("--after", type=int, default=3)
    p.add_argument("--untraced", action="store_true", help="no tracer at all (the reference run)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ext, why = load_extension()
    assert ext is not None, why
    report: dict = {"rank": rank}
    try:
        gen = torch.Generator().manual_seed(rank)
        if args.mode == "agree":
            ddp = DDP(build(256, 6), bucket_cap_mb=0.5)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
            with DDPTracer(ddp, opt, out_dir=Path(args.out) / "trace", capture="python") as tracer:
                wrapper = ext.wrap(ddp.process_group)
                tracer._comm_state.group = wrapper  # the hook's all_reduce goes through the wrapper too
                ready = ext.ReadyTimes(tracer._recorder.params)  # beside the Python gradient hooks
                steps, grads = [], []
                for _ in range(args.traced):
                    step(ddp, opt, gen, 256)
                    steps.append([[launch / 1e3, done / 1e3, nbytes] for launch, done, nbytes, _ in ext.take(wrapper)[0]])
                    grads.append([[param, us] for param, us, _ in ready.take(0)])
                ready.remove()
            report["compiled"], report["ready"] = steps, grads
        else:
            models = {"a": DDP(build(256, 6), bucket_cap_mb=0.5), "b": DDP(build(128, 4), bucket_cap_mb=0.1)}
            opts = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
            if args.untraced:
                for _ in range(args.traced):
                    for k in models:
                        step(models[k], opts[k], gen, 256 if k == "a" else 128)
            else:
                tracers = {k: DDPTracer(m, opts[k], out_dir=Path(args.out) / k, capture="compiled")
                           for k, m in models.items()}
                for t in tracers.values():
                    t.__enter__()
                report["wrappers"] = {k: t._compiled is not None for k, t in tracers.items()}
                groups = {k: t._compiled.group for k, t in tracers.items()}
                for _ in range(args.traced):
                    for k in models:
                        step(models[k], opts[k], gen, 256 if k == "a" else 128)
                for t in tracers.values():
                    t.__exit__(None, None, None)
                report["attached_after_exit"] = {k: t._compiled.attached for k, t in tracers.items()}
            for _ in range(args.after):  # untraced from here on: the reducers use their own groups again
                for k in models:
                    step(models[k], opts[k], gen, 256 if k == "a" else 128)
            if not args.untraced:
                report["records_after_exit"] = {k: len(ext.take(g)[0]) for k, g in groups.items()}
            report["sha"] = {k: sha(m.module) for k, m in models.items()}
            report["buckets"] = {k: len(m._get_ddp_logging_data()["rebuilt_per_bucket_param_indices"].split(","))
                                 for k, m in models.items()}  # DDP's own count, after its rebuild
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"report-{rank}.json").write_text(json.dumps(report))
        dist.barrier()
    finally:
        # the DDP models, the tracers and the wrapped groups released before their process
        # group is destroyed: a gloo group's threads torn down after it, in the interpreter's
        # exit, aborted a rank once in CI ("terminate called without an active exception")
        ddp = opt = tracer = wrapper = ready = models = opts = tracers = groups = None  # noqa: F841
        gc.collect()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
