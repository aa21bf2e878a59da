"""Tracing overhead: median step time untraced vs traced vs torch.profiler.

Launches one real 2-rank DDP job (torchrun, gloo on CPU). Every rank builds three
identical copies of the demo model, each in its own DDP: one untraced (DDP's built-in
all-reduce), one with DDP's reference Python ``allreduce_hook``, one under ``DDPTracer``,
one run inside ``torch.profiler.profile``. The four are interleaved in rounds in the same processes, so machine noise hits all of
them alike; the script prints the medians and the ratios. Target: traced/untraced <= 1.03.

    python -m benchmarks.overhead [--model gpt|mlp] [--bucket-cap-mb 1] [--rounds 6] [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULT_PREFIX = "overhead-result "
MODES = ("untraced", "python_hook", "traced", "profiler")


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from tracer import DDPTracer
    from tracer.workloads.affinity import bind_local_rank_to_cores
    from tracer.workloads.demo.models import build_model

    bind_local_rank_to_cores()  # as the demo job does
    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        torch.manual_seed(0)
        base = build_model(args.model)
        models = {m: copy.deepcopy(base) for m in MODES}
        ddps = {m: DDP(models[m], bucket_cap_mb=args.bucket_cap_mb) for m in models}
        # the reference Python hook: what any Python communication hook pays
        ddps["python_hook"].register_comm_hook(None, default_hooks.allreduce_hook)
        opts = {m: torch.optim.AdamW(ddps[m].parameters(), lr=1e-3) for m in models}
        gen = torch.Generator().manual_seed(rank)
        times: dict[str, list[list[float]]] = {m: [] for m in models}  # per round, per step

        def steps(mode: str, n: int, record: bool) -> None:
            for _ in range(n):
                x, y = models[mode].batch(gen)
                t0 = time.perf_counter()
                loss = models[mode].loss(ddps[mode](x), y)
                loss.backward()
                opts[mode].step()
                opts[mode].zero_grad(set_to_none=True)
                if record:
                    times[mode][-1].append(time.perf_counter() - t0)

        with DDPTracer(ddps["traced"], opts["traced"], out_dir=Path(args.out)):
            for mode in models:  # warm-up, incl. DDP's bucket rebuild
                steps(mode, 2, record=False)
            order = list(models)
            for r in range(args.rounds):
                for mode in order[r % len(order):] + order[: r % len(order)]:  # rotate who goes first
                    times[mode].append([])
                    if mode == "profiler":
                        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
                            steps(mode, args.steps, record=True)
                    else:
                        steps(mode, args.steps, record=True)
        if rank == 0:
            print(RESULT_PREFIX + json.dumps(times), flush=True)
    finally:
        dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt")
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0

    from tracer.launch.torchrun import LaunchConfig, launch
    from tracer.launch.runner import project_env

    results: list[dict] = []

    def on_line(rank, line):
        if line.startswith(RESULT_PREFIX):
            results.append(json.loads(line[len(RESULT_PREFIX):]))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LaunchConfig(target="benchmarks.overhead", nproc=2, log_dir=Path(tmp) / "logs", timeout_s=600,
                           env=project_env(),
                           args=["--worker", "--model", args.model, "--bucket-cap-mb", str(args.bucket_cap_mb),
                                 "--rounds", str(args.rounds), "--steps", str(args.steps), "--out", str(Path(tmp) / "trace")])
        res = launch(cfg, on_line)
    if not res.ok or not results:
        print(f"benchmark failed: {res.reason}\n{res.stderr_tail}", file=sys.stderr)
        return 1
    rounds = results[0]
    med = {m: statistics.median(t for r in rounds[m] for t in r) * 1e3 for m in MODES}
    # paired: each round's median against the same round's untraced median, then the median ratio
    paired = {m: statistics.median(statistics.median(a) / statistics.median(b)
                                   for a, b in zip(rounds[m], rounds["untraced"])) for m in MODES}
    n = sum(len(r) for r in rounds["untraced"])
    print(f"model={args.model} bucket_cap_mb={args.bucket_cap_mb:g} ranks=2 rounds={args.rounds} "
          f"steps/mode={n} (rank 0, modes interleaved)")
    for m in MODES:
        print(f"  {m:<11} median step {med[m]:8.2f} ms   paired ratio to untraced {paired[m]:.3f}")
    print(f"  traced/untraced      = {med['traced'] / med['untraced']:.3f} (pooled)  {paired['traced']:.3f} (paired)"
          f"   target <= 1.03")
    print(f"  python_hook/untraced = {med['python_hook'] / med['untraced']:.3f} (pooled)  {paired['python_hook']:.3f} (paired)"
          f"   DDP's own Python allreduce_hook")
    print(f"  traced/python_hook   = {med['traced'] / med['python_hook']:.3f} (pooled)")
    print(f"  profiler/untraced    = {med['profiler'] / med['untraced']:.3f} (pooled)  {paired['profiler']:.3f} (paired)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
