"""DeepSpeed tracing: its overhead on ZeRO stages 1, 2 and 3.

    python -m benchmarks.deepspeed [--rounds 60] [--layers 6] [--dim 1024] [--bucket-elements 250000]
                                   [--stages 1,2,3] [--pieces-steps 100] [--offload none|optimizer|both]
                                   [--cpu] [--stress] [--smoke]

Workload: an MLP of ``--layers`` hidden layers (``--dim`` wide), a client AdamW,
DeepSpeed's engine at each ZeRO stage (fp32, ``reduce_bucket_size`` and
``stage3_prefetch_bucket_size`` ``--bucket-elements``), 2 ranks, DeepSpeed's CPU
accelerator (gloo). By default the scale of the other overhead benchmarks
(``benchmarks/overhead.py``'s DDP demo models, 100-160 ms steps; ``benchmarks/sharded.py``'s
FSDP2 model, ~120 ms): 6 layers of 1024 (6.4 M parameters), 120-175 ms steps, buckets of
250,000 elements (1 MB of fp32, DDP's ``bucket_cap_mb=1`` there: ~26 reductions a step).
DeepSpeed's own default, 500,000,000 elements, makes this model one bucket. ``--stress``
is the short-step stress: 4 layers of 256, buckets of 50,000 elements, 15-38 ms steps
with a collective every ~1.5 ms, where the tracer's fixed cost per step and per
collective (a few hundred µs, ~10 µs) is 4-10 times the share it is at the default
scale. Needs DeepSpeed (``pip install deepspeed==0.19.8``); its first run builds a small
C++ op (~100 s). ``--offload`` measures the same with ZeRO-Offload to the CPU
(``offload_optimizer``; ``both`` adds ``offload_param``, stage 3 only), where the tracer's
memory samples also sort each state's host bytes from its device bytes.

As ``benchmarks/sharded.py`` measures FSDP2's: one real 2-rank job (torchrun); per stage
every rank builds three engines of the same model: ``untraced``, ``control`` (another
untraced one: the noise floor) and ``traced`` (``DeepSpeedTracer`` as ``ddpscope run``
starts it: every wrapper, the backend's collectives timed, memory measured once a
second of its own steps' time, the rank file and live file written: its steps come one
round apart, so its ``memory_interval_s`` is the default times the modes, which
measures as often per step as the default does in a run traced alone). They run interleaved step by step (one
step of every mode per round, the order rotating), so the machine's noise hits every
mode alike; the rounds come in six blocks, and from one block to the next every mode
moves to another engine (the tracer closed and started on the next; each mode on each
engine twice), so a copy's place in memory (~1-3 % here) cancels out. Each mode's ratio is
the median over rounds of its step over the same round's untraced step (rank 0), and the
median over windows of 16 rounds of their totals' ratio (``16-rd``: the tracer writes its
steps in batches, every 16 steps or each second, a cost a median over single rounds would not see), each
with a bootstrap 95 % interval. ``control`` against ``untraced`` is the noise floor: on
this 2-core machine it has read 0.97-1.05 over 600 rounds, as large as the goal, so
``both`` sets the traced step against the mean of the same round's two untraced steps
(half the noise of either). Goal: ``both`` <= 1.02 at every stage, both ways, at the
default scale (``--stress`` prints the same figures for its short steps). The
traced step's mean excess is then split by what the tracer did in it besides tracing
(memory measured, held steps emitted, neither): what each kind of step costs, and its
share of what a window pays. ``--cpu`` times the training thread's CPU
(``time.thread_time``) instead of the wall: what the tracer's own code adds, with the
waits for the other rank (and their noise) left out. The class's
collective methods stay wrapped while a tracer is attached (``comm.py``), so the untraced
engines pay the wrapper's check for another engine's tap (~2 µs a collective, ``hot path``): the ratios
leave that out. Then, at each stage, the traced engine runs
``--pieces-steps`` more steps with the tracer's pieces timed in place (``PIECES``): where
its cost is, in µs a step, as ``benchmarks/overhead.py`` says it for DDP.

Benchmarks are not tests: nothing is asserted; ``--smoke`` runs tiny sizes once.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "deepspeed-overhead-result "
MODES = ("untraced", "control", "traced")
BLOCKS = 2 * len(MODES)  # each mode runs on each engine for two blocks of rounds
STAGES = (1, 2, 3)
OFFLOADS = {"none": "none", "optimizer": "offload_optimizer", "both": "offload_optimizer and offload_param"}


def worker(args: argparse.Namespace) -> None:
    import copy
    import gc
    import time

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch
    import torch.distributed as dist
    from torch import nn

    from ddpscope.tracer.capture.deepspeed.engine_facts import engine_facts
    from ddpscope.tracer.capture.deepspeed.tracer import DeepSpeedTracer
    from ddpscope.tracer.capture.tracer_config import TracerConfig

    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Linear(64, args.dim), nn.ReLU()]
    for _ in range(args.layers):
        layers += [nn.Linear(args.dim, args.dim), nn.ReLU()]
    base = nn.Sequential(*layers, nn.Linear(args.dim, 8))
    gen = torch.Generator().manual_seed(rank)
    results: dict[str, dict[str, list[float]]] = {}
    pieces: dict[str, dict[str, float]] = {}
    step_tags: dict[str, list[str]] = {}
    offloads: dict[str, dict] = {}  # per stage, what the engine itself says it offloads
    for stage in (int(x) for x in args.stages.split(",")):
        config = {"train_micro_batch_size_per_gpu": 16, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": stage, "reduce_bucket_size": args.bucket_elements,
                                        "stage3_prefetch_bucket_size": args.bucket_elements,
                                        "stage3_param_persistence_threshold": 0}}
        if args.offload != "none":  # ZeRO-Offload to the CPU; the client AdamW kept (see --offload's help)
            config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
            config["zero_force_ds_cpu_optimizer"] = False
        if args.offload == "both":
            config["zero_optimization"]["offload_param"] = {"device": "cpu"}
        engines = []
        for _ in MODES:
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engines.append(deepspeed.initialize(model=model, optimizer=opt, config=config)[0])
        times: dict[str, list[float]] = {m: [] for m in MODES}
        tags: list[str] = []  # per traced round: what the tracer did in that step besides tracing it

        clk = time.thread_time if args.cpu else time.perf_counter

        def step(engine) -> float:
            x = torch.randn(16, 64, generator=gen)
            y = torch.randn(16, 8, generator=gen)
            t0 = clk()
            loss = nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            return clk() - t0

        for block in range(BLOCKS):  # every mode on every engine, twice: a copy's place in memory cancels out
            engine_of = {m: engines[(k + block) % len(MODES)] for k, m in enumerate(MODES)}
            cfg = TracerConfig(out_dir=Path(args.out) / f"stage{stage}-{block}", capture="python",
                               memory_interval_s=TracerConfig.memory_interval_s * len(MODES))  # docstring
            cfg.out_dir.mkdir(parents=True, exist_ok=True)
            facts = engine_facts(engine_of["traced"])
            offloads[str(stage)] = {k: facts[k] for k in ("offload_optimizer", "offload_param")}
            tracer = DeepSpeedTracer(engine_of["traced"], facts, cfg)
            why = tracer.start()
            if why is not None:
                raise SystemExit(f"deepspeed overhead benchmark: {why}")
            measured = tag_measured_steps(tracer.recorder)
            for mode in MODES:  # warm-up on this copy
                for _ in range(3):
                    step(engine_of[mode])
            for r in range(block * args.rounds // BLOCKS, (block + 1) * args.rounds // BLOCKS):
                order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]  # rotate who goes first
                for mode in order:
                    if mode == "traced":
                        written, measured[0] = tracer.recorder.steps_written, False
                    times[mode].append(step(engine_of[mode]))
                tags.append(step_tag(measured[0], tracer.recorder.steps_written > written))
            if block == BLOCKS - 1 and args.pieces_steps:  # after every round: the wrapping touches none
                pieces[str(stage)] = where_the_time_goes(tracer, lambda: step(engine_of["traced"]), args.pieces_steps)
            tracer.close()
            if tracer.failure:
                raise SystemExit(f"deepspeed overhead benchmark: {tracer.failure}")
        results[str(stage)] = times
        step_tags[str(stage)] = tags
        for engine in engines:
            engine.destroy()
        engines.clear()
        gc.collect()
    if rank == 0:
        print(RESULT_PREFIX + json.dumps({"times": results, "pieces": pieces, "tags": step_tags,
                                               "offloads": offloads}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def tag_measured_steps(rec) -> list[bool]:
    """A flag set when ``rec`` decides to measure memory in a step (its ``measure_step``
    wrapped: one call a step)."""
    flag, decide = [False], rec.measure_step

    def measure_step(step: int) -> bool:
        flag[0] = decide(step)
        return flag[0]

    rec.measure_step = measure_step
    return flag


def step_tag(measured: bool, emitted: bool) -> str:
    return ("memory measured" if measured else "") + (" + " if measured and emitted else "") + \
        ("steps emitted" if emitted else "") or "traced only"


def excess_by_tag(times: dict[str, list[float]], tags: list[str]) -> dict[str, tuple[int, float, float]]:
    """Per tag: (rounds, mean µs the traced step took over the mean of the round's untraced
    and control steps, that tag's share of the mean excess over all rounds, µs a step).
    The shares add up to the mean excess: what a window's total (``16-rd``) pays."""
    out: dict[str, list[float]] = {}
    for t, u, c, tag in zip(times["traced"], times["untraced"], times["control"], tags):
        out.setdefault(tag, []).append((t - (u + c) / 2) * 1e6)
    n = len(tags)
    return {tag: (len(xs), statistics.fmean(xs), sum(xs) / n) for tag, xs in sorted(out.items())}


# The tracer's own work on the training thread, by piece, timed in place (the caches as cold
# as a real step leaves them), exclusive: a piece's time excludes the pieces inside it. The
# wrappers' own frames (DeepSpeed's methods and the backend's collectives called through
# ddpscope's, with a bucket's reductions recorded on the short path inside them: comm.CommTap)
# are not timed: the ratios above hold them.
PIECES = {
    "collectives: who issued them (comm.CommTap)": ("tap.launch", "tap.landed", "tap.issued", "tap.poll",
                                                    "tap.step_ends"),
    "collective records": ("comm_start", "comm_end", "comm_async", "expand"),
    "passes and waits": ("on_forward_start", "on_forward_end", "enter", "leave", "wait_start", "wait_end",
                         "on_backward_end", "on_optimizer_start", "on_optimizer_end"),
    "memory accounting (measured steps)": ("sample",),
    "building the step's events": ("events",),
    "encoding and handing them to the writer": ("add",),
    "rest of closing a step": ("_close",),
}


def where_the_time_goes(tracer, run_step, steps: int) -> dict[str, float]:
    """µs a step per piece of ``PIECES`` over ``steps`` steps of the traced engine."""
    from benchmarks.overhead import exclusive_timer
    from ddpscope.tracer.capture.sharded import fsdp_tracer

    rec, tap, writer = tracer.recorder, tracer.tap, tracer._writer
    spent: dict[str, int] = {}
    timed = exclusive_timer(spent)
    events = fsdp_tracer.step_events
    for label, names in PIECES.items():
        for name in names:
            if name == "events":
                fsdp_tracer.step_events = timed(label, events)  # looked up at each call
                continue
            owner, attr = (tap, name[4:]) if name.startswith("tap.") else (writer, name) if name == "add" else (rec, name)
            if getattr(owner, attr, None) is not None:  # an instance attribute shadows the method
                setattr(owner, attr, timed(label, getattr(owner, attr)))
    try:
        for _ in range(3):
            run_step()
        spent.clear()
        for _ in range(steps):
            run_step()
    finally:
        fsdp_tracer.step_events = events
    return {label: spent.get(label, 0) / steps / 1e3 for label in PIECES}


def hot_path(calls: int = 2000) -> dict[str, tuple[float, float]]:
    """µs the tap adds to one collective, per path, warm and cold: a stand-in backend whose
    collective does nothing (warm), or streams 12 MB through the caches as a real one does
    (cold: what the wrapper runs on after each real collective); the median over ``calls``
    of the wrapped call less the plain one's. No DeepSpeed: ``comm.py`` on its own."""
    import time

    import torch

    from ddpscope.tracer.capture.clock import CpuClock
    from ddpscope.tracer.capture.deepspeed import comm
    from ddpscope.tracer.capture.sharded.recorder import BACKWARD, ROOT, ShardedRecorder

    flush, cold = torch.zeros(3_000_000), [False]

    class Guard:
        broken = None

        def fail(self, e: BaseException) -> None:
            raise e

    class StandIn:
        def all_reduce(self, tensor, op=None, group=None, async_op=False):
            if cold[0]:
                flush.add_(1.0)

    plain = StandIn.all_reduce
    comm.patch_backend(StandIn)
    rec = ShardedRecorder(clock=CpuClock(), emit=lambda s: None)
    tap = comm.CommTap(rec, {}, {}, Guard())
    backend, tensor = StandIn(), torch.zeros(1000)

    def median_us(fn) -> float:
        spent = []
        for k in range(calls):
            t0 = time.perf_counter_ns()
            fn(backend, tensor)
            spent.append(time.perf_counter_ns() - t0)
            if rec.current is not None and k % 64 == 0:  # the step's records, emptied as emitting does
                rec.current.raw.clear(), rec.current.colls.clear(), rec.current.holes.clear()
        return statistics.median(spent) / 1e3

    out = {}
    tap.attach(StandIn)
    try:
        for path in ("no step of the traced engine open", "a bucket's reduction",
                     "any other synchronous collective (its issuer found)"):
            if path.startswith("a bucket"):
                rec.on_forward_start()
                rec.enter(ROOT, BACKWARD)
                tap.bucket = comm.bucket_mark(("a.weight", "a.bias"))
            elif path.startswith("any other"):
                tap.bucket = None
            costs = []
            for cold[0] in (False, True):
                costs.append(median_us(StandIn.all_reduce) - median_us(plain))
            out[path] = (costs[0], costs[1])
    finally:
        tap.detach()
    return out


def overhead(args, tmp: Path) -> None:
    from benchmarks.overhead import ratios, window_ratios, worker_result  # the same job and paired ratios as DDP's

    result, res = worker_result("benchmarks.deepspeed", RESULT_PREFIX,
                                ["--rounds", str(args.rounds), "--layers", str(args.layers), "--dim", str(args.dim),
                                 "--bucket-elements", str(args.bucket_elements), "--stages", args.stages,
                                 "--pieces-steps", str(args.pieces_steps), "--offload", args.offload,
                                 *(["--cpu"] if args.cpu else []),
                                 "--out", str(tmp / "traces")], tmp / "logs", env={"DS_ACCELERATOR": "cpu"})
    if result is None:
        raise SystemExit(f"benchmark job failed: {res.reason}\n{res.stderr_tail}")
    print(f"overhead: DeepSpeed {args.layers} hidden layers of {args.dim}, buckets of {args.bucket_elements:,} "
          f"elements, ranks=2, rounds={args.rounds} "
          "(rank 0; one step of every mode per round, interleaved)"
          + ("" if args.offload == "none" else f"; ZeRO-Offload to cpu: {OFFLOADS[args.offload]}"))
    if args.offload != "none":
        print("  the engines say they offload to: " + "; ".join(
            f"stage {stage} optimizer {o['offload_optimizer']}, parameters {o['offload_param']}"
            for stage, o in result["offloads"].items()))
    if args.cpu:
        print("  --cpu: every time below is the training thread's CPU time, not the step's wall time")
    print("  ratios to the untraced engine's step of the same rounds; 'both': traced to the mean of the untraced")
    print("  and control steps of the same round (two baselines: half the noise of either; control's own ratio")
    print("  is the noise floor)")
    print(f"  {'stage':>5} {'mode':<9} {'median ms':>9}  {'median':>6}  {'95% CI':>11}  {'16-rd':>6}  {'95% CI':>11}")
    met = True
    for stage, times in result["times"].items():
        r, mr = ratios(times), window_ratios(times)
        both = {"untraced": [(u + c) / 2 for u, c in zip(times["untraced"], times["control"])],
                "traced": times["traced"]}
        r["both"], mr["both"] = ratios(both)["traced"], window_ratios(both)["traced"]
        for m in (*MODES, "both"):
            ms = f"{statistics.median(times[m]) * 1e3:9.2f}" if m in times else " " * 9
            print(f"  {stage:>5} {m:<9} {ms}  {r[m][0]:6.3f}  "
                  f"{r[m][1]:.3f}-{r[m][2]:.3f}  {mr[m][0]:6.3f}  {mr[m][1]:.3f}-{mr[m][2]:.3f}")
        met = met and max(r["both"][0], mr["both"][0]) <= 1.02
    print(f"  goal traced <= 1.02 at every stage ('both', per round and per 16 rounds): {'met' if met else 'NOT met'}"
          + (" (the --stress workload: the goal is set at the default scale)" if args.stress else ""))
    print("  the traced step's excess over the mean of its round's untraced and control steps, by what the tracer")
    print("  did in it besides tracing (µs; a mean keeps the spikes a median drops: share = what a window pays)")
    for stage, times in result["times"].items():
        tags = result["tags"][stage]
        for tag, (count, mean, share) in excess_by_tag(times, tags).items():
            print(f"    stage {stage}  {tag:<33} {count:5d} rounds  mean {mean:8.1f}  share {share:7.1f} µs a step")
    for stage, pieces in result["pieces"].items():
        step_us = statistics.median(result["times"][stage]["traced"]) * 1e6
        total = sum(pieces.values())
        print(f"  stage {stage}: where the tracer's time goes ({args.pieces_steps} steps timed in place, µs a step; "
              f"{total:.0f} µs = {100 * total / step_us:.2f} % of its median step):")
        for piece, us in sorted(pieces.items(), key=lambda kv: -kv[1]):
            print(f"    {us:7.1f}  {piece}")
    print("  hot path: µs the tap adds to one collective (stand-in backend; cold: after 12 MB streamed)")
    for path, (warm, cold) in hot_path(200 if args.smoke else 2000).items():
        print(f"    {warm:6.2f} warm  {cold:6.2f} cold  {path}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=60, help="rounds of one step per mode, per stage")
    p.add_argument("--layers", type=int, default=None, help="hidden layers (default 6; --stress: 4)")
    p.add_argument("--dim", type=int, default=None, help="their width (default 1024; --stress: 256)")
    p.add_argument("--bucket-elements", type=int, default=None,
                   help="reduce_bucket_size and stage3_prefetch_bucket_size (elements; default 250000, --stress 50000; "
                        "DeepSpeed's default: 500000000)")
    p.add_argument("--pieces-steps", type=int, default=100,
                   help="steps of the traced engine timed piece by piece after the rounds (0: none)")
    p.add_argument("--stages", default=",".join(map(str, STAGES)), help="ZeRO stages to measure, e.g. 1,3")
    p.add_argument("--cpu", action="store_true",
                   help="time each step's CPU on the training thread (time.thread_time), not its wall time: "
                        "what the tracer adds there, with the waits for the other rank left out (less noise)")
    p.add_argument("--offload", choices=tuple(OFFLOADS), default="none",
                   help="ZeRO-Offload to the CPU: the optimizer's states (offload_optimizer, stages 1-3), or those "
                        "and the parameters (offload_param, stage 3 only); the client AdamW is kept "
                        "(zero_force_ds_cpu_optimizer false), so the step is the same optimizer's")
    p.add_argument("--stress", action="store_true",
                   help="the short-step workload: 4 layers of 256, buckets of 50,000 elements (see the docstring)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few rounds: the script runs, nothing more")
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        print("benchmarks.deepspeed: DeepSpeed is not installed (pip install deepspeed==0.19.8)", file=sys.stderr)
        raise SystemExit(2)
    for name, default, stress in (("layers", 6, 4), ("dim", 1024, 256), ("bucket_elements", 250_000, 50_000)):
        if getattr(args, name) is None:
            setattr(args, name, stress if args.stress else default)
    if args.smoke:
        args.rounds, args.layers, args.dim, args.pieces_steps = 6, 1, 32, 3
    if not args.stages or any(x not in ("1", "2", "3") for x in args.stages.split(",")):
        p.error(f"--stages takes ZeRO stages 1, 2 and 3, comma-separated, not {args.stages!r}")
    if args.offload == "both" and args.stages != "3":
        p.error("--offload both offloads the parameters, which only ZeRO stage 3 does: add --stages 3")
    with tempfile.TemporaryDirectory(prefix="ddpscope-deepspeed-bench-") as tmp:
        overhead(args, Path(tmp))


if __name__ == "__main__":
    main()
