"""The ZeRO job: one process per rank, started by torchrun (see ``own_jobs.run_zero``).

Trains the same demo model (same seed, same batches) for ``--steps`` steps under each
requested ZeRO stage in turn (``tracer/zero.py``), profiling each stage with
``torch.profiler`` (memory events and operator shapes) from model construction on. The
last step of each stage is the measured one. Each rank writes ``rank-<r>.json`` (a
Chrome trace: a span per step, counters for model states and tensor memory; the
measurements in its metadata's ``stages``, appended after every stage); rank 0
writes the run's facts into ``run.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import socket
import time

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from torch.profiler import ProfilerActivity, profile, record_function

from ddpscope.tracer import format as fmt
from ddpscope.tracer.progress import emit_progress as progress
from ddpscope.tracer.workloads.demo.models import MODELS, build_model, model_config
from ddpscope.tracer.workloads.worker import FAIL_ENV, HANG_ENV, init_worker, injected
from ddpscope.tracer.workloads.zero import STAGES, STEP_MARK, ModelStates, analyze_profile, build_stage
from ddpscope.tracer.writer import TraceWriter, update_run_json

MAX_COUNTER_POINTS = 300  # tensor-memory counter samples written per stage


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=MODELS, default="mlp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pg-timeout-s", type=float, default=600.0)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)






def run_stage(stage: int, args, device, rank: int, world: int) -> tuple[dict, list[dict]]:
    """Train under ``stage``; (measurements, Chrome trace events) of this rank."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
    states = ModelStates()
    spans = []
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        torch.manual_seed(args.seed)  # the same model in every stage
        base = build_model(args.model).to(device)
        n_params = sum(p.numel() for p in base.parameters())
        module, opt = build_stage(base, stage, device)
        for step in range(args.steps):
            measured = step == args.steps - 1
            x, y = (t.to(device) for t in base.batch(gen))
            if measured and device.type == "cuda":
                torch.cuda.synchronize()  # CPU-GPU sync: the peak window starts with an idle device
                torch.cuda.reset_peak_memory_stats(device)
            t0 = time.perf_counter_ns() / 1e3
            with record_function(STEP_MARK):
                out = module(x)
                if measured:
                    states.sample(module, opt)  # stage 2 holds unsharded parameters here
                base.loss(out, y).backward()
                if measured:
                    states.sample(module, opt)
                opt.step()
                if measured:
                    states.sample(module, opt)
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize()  # CPU-GPU sync: the step's end on the device
            spans.append((step, t0, time.perf_counter_ns() / 1e3))
    profiles = analyze_profile(prof.profiler.kineto_results.events(), world)
    last = profiles[-1]
    result = {
        "stage": stage, "name": STAGES[stage], "params": n_params, "steps": args.steps,
        "params_bytes": states.params_bytes, "grads_bytes": states.grads_bytes,
        "optimizer_state_bytes": states.optimizer_state_bytes,
        "model_state_bytes": states.params_bytes + states.grads_bytes + states.optimizer_state_bytes,
        "step_start_bytes": last.start_bytes, "peak_bytes": last.peak_bytes,
        "comm": {k: vars(v) for k, v in sorted(last.comm.items())}, "issued": dict(sorted(last.issued.items())),
        "comm_volume_bytes": sum(v.volume_bytes for v in last.comm.values()),
        "step_ms": (spans[-1][2] - spans[-1][1]) / 1e3,
    }
    if device.type == "cuda":  # the allocator's own peak; the profiler's events mix in host memory there
        result["peak_bytes"] = torch.cuda.max_memory_allocated(device)
        result["step_start_bytes"] = None
    events = [{"ph": "X", "cat": "zero_step", "name": f"stage {stage} step {s}", "pid": rank, "tid": 1,
               "ts": a, "dur": b - a, "args": {"stage": stage, "step": s, "measured": s == args.steps - 1}}
              for s, a, b in spans]
    ts = spans[-1][2]
    events.append({"ph": "C", "name": f"model states (stage {stage})", "pid": rank, "tid": 1, "ts": ts,
                   "args": {k: result[k] for k in ("params_bytes", "grads_bytes", "optimizer_state_bytes")}})
    del module, opt, base, prof
    return result, events


@record
def main(argv=None) -> None:
    args = parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    device = init_worker(args.pg_timeout_s)
    use_cuda = device.type == "cuda"
    backend = "nccl" if use_cuda else "gloo"
    writer, status, error, meta = None, fmt.FAILED, None, {}
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        meta = {"format": fmt.FORMAT, "version": fmt.VERSION, "kind": fmt.KIND_ZERO, "status": fmt.RUNNING,
                "rank": rank, "world_size": world, "host": socket.gethostname(), "pid": os.getpid(),
                "backend": backend, "device": str(device), "model": args.model, "stages": [],
                "torch_version": torch.__version__}
        writer = TraceWriter(os.path.join(args.out, fmt.rank_file(rank)), meta)
        writer.add([{"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}},
                    {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "ZeRO stages"}}])
        facts = {"kind": fmt.KIND_ZERO, "world_size": world, "backend": backend, "device": str(device),
                 "model": args.model, "steps": args.steps, "stages_requested": stages, "dtype": "float32",
                 "optimizer": "Adam", "torch_version": torch.__version__,
                 "model_config": dataclasses.asdict(model_config(args.model))}
        if rank == 0:
            update_run_json(args.out, {**facts, "status": fmt.RUNNING})
            progress(event="start", world_size=world, model=args.model, stages=stages)
        fail_at, hang_at = injected(FAIL_ENV, rank), injected(HANG_ENV, rank)
        results = []
        for stage in stages:
            if stage == fail_at:
                raise RuntimeError(f"injected failure on rank {rank} at stage {stage} ({FAIL_ENV})")
            if stage == hang_at:
                time.sleep(10**6)
            gc.collect()
            result, events = run_stage(stage, args, device, rank, world)
            results.append(result)
            writer.add(events)
            writer.set_meta(stages=results)
            if rank == 0:
                progress(event="stage", stage=stage, name=STAGES[stage],
                          model_state_mib=round(result["model_state_bytes"] / 2**20, 2),
                          peak_mib=round(result["peak_bytes"] / 2**20, 2),
                          comm_mib=round(result["comm_volume_bytes"] / 2**20, 2))
        status = fmt.COMPLETE
        if rank == 0:
            update_run_json(args.out, {**facts, "status": status, "params": results[0]["params"] if results else 0})
            progress(event="done")
    except BaseException as e:
        error = f"{type(e).__name__}: {e}"[:2000]
        raise
    finally:
        if writer is not None:
            writer.close(status=status, error=error)
        dist.destroy_process_group()



if __name__ == "__main__":
    main()
