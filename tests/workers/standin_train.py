"""Test worker (run under torchrun by tests/tracer/capture/test_device_path.py): a small
DDP model trained on the CPU over gloo, traced by ``DDPTracer`` timing on the stand-in
accelerator (tests/standin_device: a stand-in, whose events and streams behave as a GPU's,
on the host): the CUDA path's clock, compiled capture, rings and anchors, end to end.

Beside the trace, ``rank-<r>.host.json``: what the host clock says of the same run, an
instrument independent of the device path, per step the host time (ns, the tracer's clock:
``time.perf_counter_ns``) just before its forward and just after its optimizer step (where
the step ends), and how many events the step recorded on the compute stream; the stand-in's
counters of synchronisations during the traced steps; whether the parameters
equal those of an untraced copy trained on the same batches.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from tests import standin_device


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--lag-ms", type=float, default=0.0, help="the compute stream runs this far behind the host")
    p.add_argument("--drift-ppm", type=float, default=0.0)
    p.add_argument("--offset-s", type=float, default=0.0, help="the device clock's epoch against the host's")
    p.add_argument("--grad-marks-every", type=int, default=1)
    p.add_argument("--capture", default="compiled")
    p.add_argument("--sleep-ms", type=float, default=0.0, help="host time between steps")
    p.add_argument("--untraced", action="store_true", help="no tracer: the control")
    p.add_argument("--fsdp2", action="store_true", help="fully_shard each layer and the root, not DDP")
    p.add_argument("--unshard-first", action="store_true",
                   help="FSDP2: the first layer's unshard() before each step's forward, by the script")
    p.add_argument("--clip", action="store_true",
                   help="FSDP2: clip_grad_norm_ before each optimizer step (DTensor's all-reduce of the norm)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches a step (DDP's no_sync on all but the last)")
    p.add_argument("--find-unused", action="store_true", help="DDP(find_unused_parameters=True)")
    p.add_argument("--fail-building-at", type=int, default=-1,
                   help="a fault injected: building this step's events raises (on the encoder's thread)")
    args = p.parse_args()
    dev = standin_device.load()
    dev.configure(drift_ppm=args.drift_ppm, offset_ns=round(args.offset_s * 1e9))
    dev.set_lag(0, round(args.lag_ms * 1e6))  # stream 0: every thread's current stream (compute, autograd, gloo's)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = Path(args.out)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(256, 256), nn.GELU())], nn.Linear(256, 4))
    plain = copy.deepcopy(model)
    if args.fsdp2:
        for m in (model, plain):
            for layer in m:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer)
            fully_shard(m)
        ddp, ref = model, plain
    else:
        ddp = DDP(model, bucket_cap_mb=0.3, find_unused_parameters=args.find_unused)
        ref = DDP(plain, bucket_cap_mb=0.3, find_unused_parameters=args.find_unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    batches = [[torch.randn(32, 256, generator=gen) for _ in range(args.accumulate)] for _ in range(args.steps)]
    tracer_class = standin_device.make_tracer_class()
    brackets, recorded = [], []
    if args.untraced:
        tracer = contextlib.nullcontext(type("T", (), {"capture_note": None}))
    elif args.fsdp2:
        tracer = fsdp2_traced(ddp, out)
    else:
        tracer = tracer_class(ddp, opt, out_dir=out, capture=args.capture, grad_marks_every=args.grad_marks_every)
    with tracer as tracer:
        if args.fail_building_at >= 0:
            inject_build_failure(tracer._recorder.step_events, args.fail_building_at)
        before = dev.counters()
        for micro in batches:
            r0, t0 = dev.recorded(0), time.perf_counter_ns()
            if args.unshard_first:  # PyTorch's FSDP2 example unshards before forward: that all-gather is the step's
                ddp[0].unshard()
            train_step(ddp, micro)
            if args.clip:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            brackets.append((t0, time.perf_counter_ns()))
            recorded.append(dev.recorded(0) - r0)
            opt.zero_grad(set_to_none=True)
            if args.sleep_ms:
                time.sleep(args.sleep_ms / 1e3)
        during = {k: v - before[k] for k, v in dev.counters().items()}
        note = tracer.capture_note
    for micro in batches:
        train_step(ref, micro)
        if args.clip:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    same = all(torch.equal(getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b))  # FSDP2: the shards
               for a, b in zip(ddp.parameters(), ref.parameters()))
    # DDP's own word on its buckets after the rebuild (an instrument apart from the tracer's)
    rebuilt = None if args.fsdp2 else ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    failure = getattr(tracer, "failure", None)
    (out / f"rank-{rank}.host.json").write_text(json.dumps({"failure": failure,"rebuilt_per_bucket_param_indices": rebuilt,
        "brackets_ns": brackets, "recorded": recorded, "during": during, "capture_note": note, "same_as_untraced": same,
        "lag_ms": args.lag_ms}))
    # DDP models alive at destroy_process_group: torch 2.13's gloo then aborts at exit about one
    # run in three (a worker thread frees a Work whose Python state needs the GIL while the
    # interpreter finalises: "terminate called without an active exception"), untraced too
    del ddp, ref, opt, ref_opt
    gc.collect()
    dist.destroy_process_group()


def inject_build_failure(step_events, at: int) -> None:
    """Building step ``at``'s events raises, wherever they are built."""
    build = step_events._events

    def failing(s, nccl):
        if s.step == at:
            raise ValueError(f"injected at step {at}")
        return build(s, nccl)

    step_events._events = failing


def train_step(model: nn.Module, micro: list[torch.Tensor]) -> None:
    """Forward and backward of each micro-batch; DDP reduces the gradients on the last."""
    for k, x in enumerate(micro):
        last = k == len(micro) - 1
        with contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync():
            model(x).square().mean().backward()


@contextlib.contextmanager
def fsdp2_traced(model: nn.Module, out: Path):
    """The FSDP2 tracer on the stand-in, started before the first forward, closed after."""
    from ddpscope.tracer.capture.tracer_config import TracerConfig

    model._get_fsdp_state()._lazy_init()  # what the root's first forward does: its units are known after
    tracer = standin_device.make_fsdp_tracer_class()(model, model._get_fsdp_state(),
                                                     TracerConfig(out_dir=out, capture="python"))
    with torch.no_grad():  # outside a forward: the next forward is its step 0
        why = tracer.start()
    if why is not None:
        raise SystemExit(f"the FSDP2 tracer did not start: {why}")
    try:
        yield type("T", (), {"capture_note": None})
    finally:
        tracer.close()
        if tracer.failure:
            raise SystemExit(f"the FSDP2 tracer failed: {tracer.failure}")


if __name__ == "__main__":
    main()
