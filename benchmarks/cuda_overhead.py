"""Tracing overhead on a GPU: traced against untraced step time, one rank on NCCL.

    python -m benchmarks.cuda_overhead [--seconds 240] [--models launch,compute] [--window 20]
                                       [--report-s 60] [--record FILE] [--grad-marks-every 10]
                                       [--device cpu] [--smoke]

One process, one rank (NCCL, world size 1; ``--device cpu`` runs it on gloo, to try the
script where there is no GPU). For each model, two identical copies, each in its own DDP on
its own process group (the tracer turns NCCL's collective timing on for its group alone),
one traced by the full tracer as ``ddpscope run`` uses it (compiled capture, writing its
file), the other not. Both train on the same batches, so their parameters must end
bit-identical (printed). A third copy is traced with ``--grad-marks-every N`` (10; 1: no
third copy): gradient-ready marks on the first steps and every Nth only, the cut left for a
launch-bound model (docs/cuda.md). A fourth copy encodes its steps' events between
steps, on the training thread (``inline``), where the others build and encode them beside
the next backward when the host has cores to spare (``tracer/capture/backward_encoder.py``):
the two side by side say what that buys. They run in *windows* of ``--window`` steps, each
copy first in turn, round by round; a window is timed from a device synchronize to a device synchronize
(the benchmark's own, between windows, never inside a step), so inside it the CPU runs ahead
of the GPU as in training, and a window's time is what the device took. Ratio per round:
traced window over untraced window (paired: slow drifts of the machine cancel); printed, the
median with a bootstrap 95 % interval. Goal (issue 34): <= 1.02 over >= 10 minutes
(``--seconds 600``); every ``--report-s`` the median of the rounds since the last report is
printed, so a long run shows whether the overhead moves as it goes (anchors, the trace file
growing), and ``--record`` keeps every round's times as they end (a run cut short keeps them).

Models, fp32, AdamW:
- ``launch``: 24 ``Linear(512)`` layers, batch 64: tiny kernels, the GPU waits for the
  CPU's launches, so the tracer's host cost shows in full;
- ``compute``: 8 ``Linear(4096)`` layers, batch 2048: the CPU runs ahead of the GPU, so the
  host cost hides unless the tracer makes the CPU wait for the device.

Then, for the traced copy, where its host time goes, piece by piece (µs a step, timed in
place: ``benchmarks.overhead.where_the_time_goes``), and the host cost of each CUDA call the
tracer makes (µs a call, median of 200, the GPU idle; ``mem_get_info`` also behind 50 ms of
queued work: if it waited for the device it would take that long). Benchmarks are not
tests: nothing is asserted. Needs the compiled capture built (``ddpscope build``).
``--smoke``: 3 s a model, on gloo and the CPU where there is no GPU: the script runs, nothing more.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODELS = {"launch": (24, 512, 64), "compute": (8, 4096, 2048)}  # layers, width, batch


def median_ci(values: list[float], boot: int = 2000, seed: int = 0) -> tuple[float, float, float]:
    """The median of ``values`` with a bootstrap 95 % interval (resampled with replacement)."""
    rng, n = random.Random(seed), len(values)
    samples = sorted(statistics.median(values[rng.randrange(n)] for _ in range(n)) for _ in range(boot))
    return statistics.median(values), samples[int(0.025 * boot)], samples[int(0.975 * boot) - 1]


def call_costs(torch, device) -> dict[str, float]:
    """µs a call (median of 200, GPU idle) of the CUDA calls the tracer makes on the host."""
    from ddpscope.tracer.capture.memory import allocator_counters

    calls = {
        "torch.cuda.memory_allocated (each of the 4 reads a measured step made before)":
            lambda: torch.cuda.memory_allocated(device),
        "allocator_counters (the 1 read a measured step makes now)": lambda: allocator_counters(device),
        "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(device),
        "Event(enable_timing=True) + record": lambda: torch.cuda.Event(enable_timing=True).record(),
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(device),
    }
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    torch.cuda.synchronize(device)
    calls["Event.query (done)"] = ev.query
    out = {}
    for label, fn in calls.items():
        times = []
        for _ in range(200):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
        out[label] = statistics.median(times) / 1e3
    # behind queued work: a call that waited for the device would take the queue's time
    a = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize(device)
    one_ms = (time.perf_counter() - t0) * 100  # ms per product
    for _ in range(max(1, int(50 / max(one_ms, 1e-3)))):
        a @ a  # ~50 ms queued
    t0 = time.perf_counter_ns()
    torch.cuda.mem_get_info(device)
    out["torch.cuda.mem_get_info, 50 ms of work queued"] = (time.perf_counter_ns() - t0) / 1e3
    torch.cuda.synchronize(device)
    return out


def run_model(name: str, args, torch, dist, device) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from benchmarks.overhead import where_the_time_goes
    from ddpscope.tracer import DDPTracer

    layers, width, batch = MODELS[name]
    if args.device == "cpu":  # a try, not a measurement: the model's parameters (so a step's
        width, batch = 64, 8  # events and the tracer's Python), narrow enough to be launch-bound here
    torch.manual_seed(0)
    base = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
                                 for _ in range(layers)]).to(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    modes = ("untraced", "traced", *(("sparse",) if args.grad_marks_every > 1 else ()), "inline")
    copies = {}
    for mode in modes:
        ddp = DDP(copy.deepcopy(base), process_group=dist.new_group(backend=backend),
                  device_ids=[device.index] if device.type == "cuda" else None)
        copies[mode] = (ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4, foreach=True))
    gen = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randn(batch, width, device=device, generator=gen) for _ in range(8)]
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    done = dict.fromkeys(modes, 0)

    def window(mode: str, steps: int) -> float:
        ddp, opt = copies[mode]
        sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            x = batches[done[mode] % len(batches)]
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            done[mode] += 1
        sync()
        return time.perf_counter() - t0

    tmp = tempfile.mkdtemp(prefix="ddpscope-cuda-overhead-")
    class InlineTracer(DDPTracer):  # steps encoded between steps, on the training thread
        encode_in_backward = False

    tracers = {m: (InlineTracer if m == "inline" else DDPTracer)(
        *copies[m], out_dir=Path(tmp) / f"{name}-{m}", capture="compiled",
        grad_marks_every=args.grad_marks_every if m == "sparse" else 1) for m in modes[1:]}
    tracer = tracers["traced"]
    entered = []
    try:
        for t in tracers.values():
            t.__enter__()
            entered.append(t)
        for mode in modes:
            window(mode, 10)  # warm-up: DDP's bucket rebuild, the allocator, cuBLAS
        ratios, times = {m: [] for m in modes[1:]}, {m: [] for m in modes}
        begin = time.monotonic()
        end, report, reported, rounds = begin + args.seconds, begin + args.report_s, 0, 0
        record = open(args.record, "a") if args.record else None  # noqa: SIM115 - closed below
        try:
            while time.monotonic() < end:
                order = modes[rounds % len(modes):] + modes[:rounds % len(modes)]  # each mode first in turn
                got = {m: window(m, args.window) for m in order}
                for m in got:
                    times[m].append(got[m] / args.window)
                for m in ratios:
                    ratios[m].append(got[m] / got["untraced"])
                if record is not None:  # a run cut short keeps its rounds
                    record.write(json.dumps({"model": name, "round": rounds, "window": args.window,
                                             **{f"{m}_s": got[m] for m in got}}) + "\n")
                    record.flush()
                rounds += 1
                if time.monotonic() >= report:  # does the overhead move as the run goes on?
                    print(f"  {name}: {time.monotonic() - begin:5.0f} s, rounds {reported}-{rounds - 1}: " + ", ".join(
                        f"{m} / untraced {statistics.median(r[reported:]):.4f}" for m, r in ratios.items()),
                        flush=True)
                    reported, report = rounds, report + args.report_s
        finally:
            if record is not None:
                record.close()
        pieces = where_the_time_goes(tracer, lambda: window("traced", 1), 50, extra=closing_pieces(tracer))
        stamp_us = stamp_cost(tracer.clock)
        # the other copies catch up on the steps the pieces took, then all must match
        for m in modes:
            window(m, done["traced"] - done[m])
        sync()
        same = all(all(torch.equal(a, b) for a, b in zip(copies[m][0].parameters(), copies["untraced"][0].parameters()))
                   for m in modes[1:])
        note = tracer.capture_note
        beside = tracer._encoder is not None  # backward_encoder.worth_it here
    finally:
        for t in reversed(entered):
            t.__exit__(None, None, None)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"ratios": ratios, "times": times, "pieces": pieces, "same": same, "note": note,
            "steps": done["traced"], "capture": "compiled" if note is None else "python", "stamp_us": stamp_us,
            "beside": beside,
            "ring_stamps": getattr(tracer.clock, "ring_stamps", 0), "shape": (layers, width, batch)}


def closing_pieces(tracer) -> dict[str, tuple]:
    """Closing a step, split (``where_the_time_goes``' ``extra``): on a GPU it is most of
    the tracer's host time (269 µs a step on an H200 host, 14 on the CPU), and these are
    its CUDA calls: the compiled capture's bucket records and their device times read a
    take later, the gradients' and buckets' device times once the step is done, the
    stamps resolved, and the queries whether a step's end is done."""
    rec, source = tracer._recorder, tracer._recorder.bucket_source
    out = {"resolving the step's stamps (clock.resolve: events on the anchors)": ((rec.clock, "resolve"),),
           "asking whether steps ended on the device (clock.done: an event query)": ((rec.clock, "done"),)}
    if source is not None:
        out["bucket records and their device times from C++ (take)"] = ((source, "take"),)
        out["gradient and bucket device times (settle)"] = ((source, "settle"),)
    return out


def stamp_cost(clock) -> float:
    """µs a ``clock.stamp()`` (median of 200, between steps): on CUDA with the compiled
    capture, a slot of its C++ ring; else a ``torch.cuda.Event`` (or the host clock)."""
    times = []
    for _ in range(200):
        t0 = time.perf_counter_ns()
        clock.stamp()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=240.0, help="alternating windows per model, seconds")
    p.add_argument("--models", default="launch,compute", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--window", type=int, default=20, help="steps of one mode between two device synchronizes")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--report-s", type=float, default=60.0,
                   help="print the median ratio of the rounds of each such interval as the run goes (seconds)")
    p.add_argument("--record", default="", help="append each round's window times here (JSON Lines) as it ends")
    p.add_argument("--grad-marks-every", type=int, default=10,
                   help="a third copy traced with this --grad-marks-every, side by side (1: none)")
    p.add_argument("--smoke", action="store_true", help="3 s a model (on the CPU where there is no GPU)")
    args = p.parse_args()
    models = args.models.split(",")
    if any(m not in MODELS for m in models):
        p.error(f"--models: any of {', '.join(MODELS)}")
    import torch
    import torch.distributed as dist

    if args.smoke:
        args.seconds = 3.0
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_overhead: no CUDA device here (--device cpu tries the script on gloo)", file=sys.stderr)
        return 2
    from ddpscope.tracer.launch.native import build_native

    if not build_native(lambda line: print(line, file=sys.stderr))["ok"]:
        return 1
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        name_of = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (a try, not a measurement)"
        print(f"{name_of}, torch {torch.__version__}; windows of {args.window} steps, {args.seconds:g} s a model")
        for name in models:
            r = run_model(name, args, torch, dist, device)
            layers, width, batch = r["shape"]
            print(f"\nmodel={name} ({layers} x Linear({width}), batch {batch}; capture {r['capture']}"
                  f"{'' if r['note'] is None else ': ' + r['note']})")
            print(f"  {len(r['ratios']['traced'])} rounds, {r['steps']} traced steps; ms a step (median of windows): "
                  + ", ".join(f"{m} {1e3 * statistics.median(t):.3f}" for m, t in r["times"].items()))
            for m, ratios in r["ratios"].items():
                med, lo, hi = median_ci(ratios)
                label = {"traced": "traced", "inline": "traced, steps encoded between steps (before)"}.get(
                    m, f"traced, marks every {args.grad_marks_every}th step")
                print(f"  {label} / untraced: {med:.4f} (95 % CI {lo:.4f}-{hi:.4f}); goal <= 1.02: "
                      f"{'met' if hi <= 1.02 else 'NOT met'}")
            print(f"  parameters bit-identical to the untraced copy's: {r['same']}")
            print(f"  the traced copies' steps built and encoded beside backward: {r['beside']} "
                  f"({os.cpu_count()} cores; backward_encoder.worth_it)")
            if device.type == "cuda":
                print(f"  the clock's stamp: {r['stamp_us']:.1f} µs a call ({r['ring_stamps']} stamps from the "
                      f"compiled capture's ring of events; 0: every stamp a torch.cuda.Event)")
            print(f"  where the traced step's host time goes (µs a step, 50 steps timed in place; "
                  f"{sum(r['pieces'].values()):.0f} µs in all):")
            for piece, us in sorted(r["pieces"].items(), key=lambda kv: -kv[1]):
                print(f"    {us:7.1f}  {piece}")
        if device.type == "cuda":
            print("\nhost cost of the CUDA calls the tracer makes (µs a call, median of 200, GPU idle):")
            for label, us in call_costs(torch, device).items():
                print(f"  {us:9.1f}  {label}")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
