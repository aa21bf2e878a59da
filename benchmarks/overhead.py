"""Tracing overhead, piece by piece: the tracer's cost per training step, with 95 % intervals.

    python -m benchmarks.overhead [--models gpt,mlp,launch] [--caps 1,25] [--rounds 150] [--smoke]

For each model and bucket_cap_mb, one real 2-rank DDP job (torchrun, gloo on CPU, each
rank bound to its core as the demo is). Every rank builds one identical copy of the
demo model per mode, each in its own DDP, and runs them interleaved *step by step*
(one step of each mode per round, the order rotating), so machine noise hits every mode
alike. The rounds come in blocks, and from one block to the next the compiled modes
move to another copy (each mode runs on each copy for one block): a copy's place in
memory alone makes its steps up to ~2 % slower or faster than another's (measured: a
mode that adds nothing came out at 1.018, 95 % CI 1.006-1.028, when it kept its copy).
The modes add the tracer's pieces one at a time:

- ``untraced``: DDP alone;
- ``buckets``: the compiled capture's process group on the reducer, records taken each step;
- ``+ready``: and the C++ gradient-ready hooks;
- ``+spans``: the whole tracer (forward, backward, optimizer spans, step events) but no
  memory accounting and no file: its events are built and dropped;
- ``+memory``: and the per-step memory accounting;
- ``full``: the tracer as ``ddpscope run`` uses it, writing its file;
- ``sparse``: ``full`` with ``--grad-marks-every 10`` (gradient-ready marks on the first
  steps and 1 step in 10: the others build, encode and write none);
- ``python``: the full tracer on the Python hooks (``--capture python``), for comparison.

Each mode's ratio is the median over rounds of its step time over the same round's
untraced step (rank 0; paired, so slow drifts of the machine cancel), with a bootstrap
95 % interval (rounds resampled with replacement, 2000 times). Goal: ``full`` <= 1.01,
upper bound <= 1.02. Then the full tracer alone runs ``--pieces-steps`` more steps with
each of its pieces timed in place (``PIECES``): where its remaining cost is, in µs a
step. Needs the compiled capture built (``ddpscope build``). Benchmarks are not tests:
nothing is asserted; ``--smoke`` runs the MLP at one cap, 12 rounds, 3 piece steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RESULT_PREFIX = "overhead-result "
MODES = ("untraced", "buckets", "+ready", "+spans", "+memory", "full", "sparse", "python")
SPARSE_EVERY = 10  # the "sparse" mode's --grad-marks-every


def launch_bound_model(torch):
    """``launch``: 24 ``Linear(64)`` + GELU layers, batch 8 (``cuda_overhead.py``'s
    launch-bound model at its CPU width): ~2 ms steps of 48 tiny gradients, where the
    tracer's cost per step and per gradient shows instead of hiding in the compute."""
    class LaunchBound(torch.nn.Sequential):
        def batch(self, gen):
            return torch.randn(8, 64, generator=gen), torch.randn(8, 64, generator=gen)

        def loss(self, out, target):
            return torch.nn.functional.mse_loss(out, target)

    return LaunchBound(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()) for _ in range(24)])


def worker(args: argparse.Namespace) -> None:
    import time

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddpscope.tracer import DDPTracer
    from ddpscope.tracer.capture.ddp.compiled import load_extension
    from ddpscope.tracer.capture.ddp.reducer import reducer_params
    from ddpscope.tracer.workloads.affinity import bind_local_rank_to_cores
    from ddpscope.tracer.workloads.demo.models import build_model

    bind_local_rank_to_cores()  # as the demo job does
    dist.init_process_group("gloo")
    ext, why = load_extension()
    if ext is None:
        raise SystemExit(f"overhead benchmark: {why}")
    try:
        rank = dist.get_rank()
        torch.manual_seed(0)
        base = launch_bound_model(torch) if args.model == "launch" else build_model(args.model)
        # one model copy per mode; the copies of the compiled modes rotate between modes
        # block by block (below): each copy sits in its own memory, which alone can make
        # one copy's steps 1-2 % slower than another's, whatever traces it
        modes = args.modes.split(",")
        models = [copy.deepcopy(base) for _ in modes]
        ddps = [DDP(m, bucket_cap_mb=args.bucket_cap_mb) for m in models]
        opts = [torch.optim.AdamW(d.parameters(), lr=1e-3) for d in ddps]
        gen = torch.Generator().manual_seed(rank)
        out = Path(args.out)
        after_step: dict[str, object] = {}
        tracers: dict[str, DDPTracer] = {}

        def attach(mode: str, i: int, block: int):
            """Mode ``mode`` on copy ``i``; returns what takes it off again."""
            ddp = ddps[i]
            if mode == "untraced":
                return lambda: None
            if mode in ("buckets", "+ready"):  # the pieces alone, as the tracer uses them
                group = ext.wrap(ddp.process_group)
                ddp.reducer._update_process_group(group)
                ready = ext.ReadyTimes(reducer_params(ddp)[1]) if mode == "+ready" else None
                after_step[mode] = (lambda: ext.take(group, 10_000)) if ready is None else \
                    (lambda: (ext.take(group, 10_000), ready.take(0)))

                def off():
                    ext.take(group, 10_000)
                    ddp.reducer._update_process_group(ddp.process_group)
                    if ready is not None:
                        ready.remove()
                    after_step.pop(mode)
                return off
            tracer = tracers[mode] = DDPTracer(ddp, opts[i], out_dir=out / mode / str(block),
                                               capture="python" if mode == "python" else "compiled",
                                               grad_marks_every=SPARSE_EVERY if mode == "sparse" else 1)
            tracer.__enter__()
            assert tracer.capture_note is None or mode == "python", tracer.capture_note
            if mode in ("+spans", "+memory"):  # their events are built, then dropped: no file
                tracer._recorder.emit = lambda events, layouts: sum(1 for _ in events)
            if mode == "+spans":
                tracer._recorder.measure = lambda *a, **k: {}
            return lambda: tracer.__exit__(None, None, None)

        times: dict[str, list[float]] = {m: [] for m in modes}
        copy_of: dict[str, int] = {}

        def step(mode: str) -> float:
            i = copy_of[mode]
            x, y = models[i].batch(gen)
            t0 = time.perf_counter()
            loss = models[i].loss(ddps[i](x), y)
            loss.backward()
            opts[i].step()
            opts[i].zero_grad(set_to_none=True)
            if mode in after_step:
                after_step[mode]()
            return time.perf_counter() - t0

        rotating = [m for m in modes if m != "python"]  # the Python hook stays registered: its copy is its own
        blocks = len(rotating)
        detach = {}
        for block in range(blocks):
            for mode in rotating:
                copy_of[mode] = (rotating.index(mode) + block) % blocks
            copy_of["python"] = len(modes) - 1
            for mode in modes:
                if mode != "python" or block == 0:
                    detach[mode] = attach(mode, copy_of[mode], block)
            for mode in modes:  # warm-up (DDP's bucket rebuild in the first block)
                for _ in range(3 if block == 0 else 1):
                    step(mode)
            order = list(modes)
            for r in range(block * args.rounds // blocks, (block + 1) * args.rounds // blocks):
                k = r % len(order)
                for mode in order[k:] + order[:k]:  # rotate who goes first
                    times[mode].append(step(mode))
            if block < blocks - 1:
                for mode in rotating:
                    detach.pop(mode)()
        pieces = where_the_time_goes(tracers["full"], lambda: step("full"), args.pieces_steps) \
            if "full" in tracers and args.pieces_steps else {}
        for off in detach.values():
            off()
        if rank == 0:
            print(RESULT_PREFIX + json.dumps({"times": times, "pieces": pieces}), flush=True)
    finally:
        dist.destroy_process_group()


# The full tracer's own work on the training thread, by piece: what each recorder method
# (or the writer's hand-over) costs, timed in place (the caches as cold as a real step
# leaves them). Exclusive: a piece's time excludes the pieces inside it.
PIECES = {
    "forward hooks (step and pass records, output-gradient hook)": ("on_forward_start", "on_forward_end",
                                                                    "on_output_grad"),
    "end of backward (gradient-ready times from C++)": ("_on_backward_end",),
    "after DDP's wait (bucket records from C++)": ("_on_grads_synced",),
    "optimizer hooks": ("on_optimizer_start", "on_optimizer_end"),
    "memory accounting": ("measure",),
    "building the step's events": ("events",),
    "encoding and handing them to the writer": ("add",),
    "rest of closing a step (bucket layout, records)": ("_close",),
}
# With the compiled capture a step's events are built and encoded on the tracer's encoder
# thread while the next backward runs (tracer/capture/backward_encoder.py): not on the
# training thread, so the two pieces above read 0 there and this one says what it took.
ENCODER_PIECE = "building and encoding them on the encoder's thread, inside backward (not the training thread's)"


def exclusive_timer(spent: dict[str, int]):
    """``timed(label, fn, materialize=False)``: ``fn`` wrapped to add its ns to
    ``spent[label]``, less the time of the timed pieces it calls on the same thread
    (exclusive); ``materialize``: an iterable it returns is built inside the timing (events
    built here, not in whoever consumes them)."""
    import threading
    import time

    local = threading.local()  # per thread: the time of the pieces inside the running one, per level

    def timed(label: str, fn, materialize: bool = False):
        def wrapper(*a, **k):
            stack = local.__dict__.setdefault("stack", [])
            stack.append(0)
            t0 = time.perf_counter_ns()
            try:
                out = fn(*a, **k)
                return iter(list(out)) if materialize else out
            finally:
                total = time.perf_counter_ns() - t0
                inner = stack.pop()
                spent[label] = spent.get(label, 0) + total - inner
                if stack:
                    stack[-1] += total
        return wrapper

    return timed


def where_the_time_goes(tracer, run_step, steps: int, extra: dict[str, tuple] | None = None) -> dict[str, float]:
    """µs a step per piece of ``PIECES``, over ``steps`` steps of ``tracer``'s model
    (``run_step``), after the interleaved rounds (so the wrapping never touches them).
    ``extra``: further pieces, label -> ``(object, method name)`` pairs (taken out of the
    pieces that call them: timing is exclusive)."""
    rec, writer, encoder = tracer._recorder, tracer._writer, tracer._encoder
    spent: dict[str, int] = {}
    timed = exclusive_timer(spent)
    for label, names in PIECES.items():
        for name in names:
            owner = (encoder or writer) if name == "add" else rec.step_events if name == "events" else rec
            # built where they are consumed: on the encoder's thread when there is one
            setattr(owner, name, timed(label, getattr(owner, name), materialize=name == "events" and not encoder))
    if encoder is not None:
        extra = {**(extra or {}), ENCODER_PIECE: ((encoder, "_work"),)}
    for label, methods in (extra or {}).items():
        for owner, name in methods:
            setattr(owner, name, timed(label, getattr(owner, name)))
    for _ in range(3):
        run_step()
    spent.clear()
    for _ in range(steps):
        run_step()
    return {label: spent.get(label, 0) / steps / 1e3 for label in (*PIECES, *(extra or {}))}


def ratios(times: dict[str, list[float]], boot: int = 2000, seed: int = 0) -> dict[str, tuple[float, float, float]]:
    """Per mode: (ratio to untraced, 2.5 %, 97.5 %). Paired: each round's step over the
    same round's untraced step (the two ran moments apart: slow drifts of the machine
    cancel), the median of those ratios, its interval by resampling rounds."""
    rng = random.Random(seed)
    out = {}
    for m, ts in times.items():
        per_round = [a / b for a, b in zip(ts, times["untraced"])]
        n = len(per_round)
        samples = sorted(statistics.median(per_round[rng.randrange(n)] for _ in range(n)) for _ in range(boot))
        out[m] = (statistics.median(per_round), samples[int(0.025 * boot)], samples[int(0.975 * boot) - 1])
    return out


def window_ratios(times: dict[str, list[float]], window: int = 16, boot: int = 2000, seed: int = 0
                  ) -> dict[str, tuple[float, float, float]]:
    """As ``ratios``, over windows of ``window`` consecutive rounds: each window's total
    step time over the same rounds' untraced total, the median over windows, its interval
    by resampling windows. A cost paid once every few steps (a tracer that writes its steps
    in batches) is in every window's total, where a median over single rounds would miss
    it; the median over windows still keeps a spike of the machine out."""
    rng = random.Random(seed)
    base = times["untraced"]
    out = {}
    for m, ts in times.items():
        per = [sum(ts[k:k + window]) / sum(base[k:k + window]) for k in range(0, len(ts) - window + 1, window)]
        if not per:
            out[m] = (float("nan"),) * 3
            continue
        n = len(per)
        samples = sorted(statistics.median(per[rng.randrange(n)] for _ in range(n)) for _ in range(boot))
        out[m] = (statistics.median(per), samples[int(0.025 * boot)], samples[int(0.975 * boot) - 1])
    return out


def worker_result(target: str, prefix: str, args: list[str], log_dir: Path, env: dict[str, str] | None = None,
                  timeout_s: float = 1800) -> tuple[dict | None, object]:
    """Run ``python -m target --worker ARGS`` on 2 ranks (torchrun, this repository on the
    path) and hand back what rank 0 printed after ``prefix`` (JSON), or None, with the
    launch's result (its reason and stderr when it failed). The benchmarks' jobs share it."""
    from ddpscope.tracer.launch.torchrun import LaunchConfig, launch

    results: list[dict] = []

    def on_line(rank, line, err):
        if line.startswith(prefix):
            results.append(json.loads(line[len(prefix):]))

    cfg = LaunchConfig(target=target, nproc=2, log_dir=log_dir, timeout_s=timeout_s,
                       env={"PYTHONPATH": str(ROOT), **(env or {})},  # the benchmark module runs on every rank
                       args=["--worker", *args])
    res = launch(cfg, on_line)
    return (results[0] if res.ok and results else None), res


def run_one(model: str, cap: float, args: argparse.Namespace) -> dict | None:
    from ddpscope.tracer.launch.torchrun import LaunchConfig, launch

    results: list[dict] = []  # {"times": {mode: [s]}, "pieces": {piece: µs a step}}

    def on_line(rank, line, err):
        if line.startswith(RESULT_PREFIX):
            results.append(json.loads(line[len(RESULT_PREFIX):]))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = LaunchConfig(target="benchmarks.overhead", nproc=2, log_dir=Path(tmp) / "logs", timeout_s=1200,
                           env={"PYTHONPATH": str(ROOT)},  # benchmarks.overhead runs on every rank
                           args=["--worker", "--model", model, "--bucket-cap-mb", str(cap), "--rounds", str(args.rounds),
                                 "--pieces-steps", str(args.pieces_steps), "--modes", args.modes,
                                 "--out", str(Path(tmp) / "trace")])
        res = launch(cfg, on_line)
    if not res.ok or not results:
        print(f"benchmark failed ({model}, cap {cap:g}): {res.reason}\n{res.stderr_tail}", file=sys.stderr)
        return None
    return results[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt,mlp", help="gpt, mlp (the demo's) and launch (launch_bound_model)")
    p.add_argument("--caps", default="1,25", help="bucket_cap_mb values (MiB), comma-separated")
    p.add_argument("--rounds", type=int, default=150)
    p.add_argument("--pieces-steps", type=int, default=50,
                   help="steps of the full tracer timed piece by piece after the rounds (0: none)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="the modes to interleave, untraced first (e.g. untraced,full: the goal alone, "
                        "more rounds in the same time)")
    p.add_argument("--smoke", action="store_true", help="the MLP, one cap, 12 rounds: the script runs, nothing more")
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--bucket-cap-mb", type=float, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke and not args.worker:
        args.models, args.caps, args.rounds, args.pieces_steps = "mlp", "25", 12, 3
    modes = args.modes.split(",")
    if modes[0] != "untraced" or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        p.error(f"--modes: untraced, then any of {', '.join(MODES[1:])}, each once")
    if args.worker:
        worker(args)
        return 0
    from ddpscope.tracer.launch.native import build_native

    if not build_native(lambda line: print(line, file=sys.stderr))["ok"]:
        return 1
    failed = False
    for model in args.models.split(","):
        for cap in (float(c) for c in args.caps.split(",")):
            result = run_one(model, cap, args)
            if result is None:
                failed = True
                continue
            times = result["times"]
            r = ratios(times)
            print(f"\nmodel={model} bucket_cap_mb={cap:g} ranks=2 rounds={args.rounds} "
                  "(rank 0; one step of every mode per round, interleaved; model copies rotating)")
            print(f"  {'mode':<9} {'median ms':>9}  {'ratio':>6}  {'95% CI':>13}  {'added by this piece':>19}")
            prev = None
            for m in modes:
                med = statistics.median(times[m]) * 1e3
                added = "" if prev is None or m == "python" else f"{r[m][0] - r[prev][0]:+.3f}"
                print(f"  {m:<9} {med:9.2f}  {r[m][0]:6.3f}  {r[m][1]:.3f}-{r[m][2]:.3f}  {added:>19}")
                prev = m if m != "python" else prev
            if "full" in r:
                verdict = "met" if r["full"][0] <= 1.01 and r["full"][2] <= 1.02 else "NOT met"
                print(f"  goal full <= 1.01 (upper bound <= 1.02): {verdict}")
            if not result["pieces"]:
                continue
            full_us = statistics.median(times["full"]) * 1e6
            total = sum(result["pieces"].values())
            print(f"  where the full tracer's time goes ({args.pieces_steps} steps timed in place, "
                  f"µs a step; {total:.0f} µs = {100 * total / full_us:.2f} % of its median step):")
            for piece, us in sorted(result["pieces"].items(), key=lambda kv: -kv[1]):
                print(f"    {us:7.1f}  {piece}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
