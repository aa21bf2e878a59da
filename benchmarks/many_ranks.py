"""Summary-first loading at 1,024 ranks: a run synthesised from a real 2-rank run, opened
as a viewer opens it, beside parsing every event.

    python -m benchmarks.many_ranks [--ranks 1024] [--steps 100] [--full-ranks 64] [--keep DIR] [--smoke]

1. Traces a real 2-rank run (``ddpscope run --demo mlp``, gloo) of ``--steps`` steps.
2. Synthesises ``--ranks`` rank files from its rank 0 (``synthesise``): each rank a copy of
   rank 0's events, its clock shifted by up to ±5 ms (its metadata's clock offset
   says so, as the tracer's would), every span's duration jittered ±3 %, and one rank
   (5/8 of the way down) slow: its forward 30 ms longer every step, everything after
   it later. Each synthetic rank is written by the tracer's own writer
   (``TraceWriter``), step by step, so its summary is made as a training node makes it.
3. In fresh processes (peak memory from ``/proc/self/status``: ``VmHWM``), times:
   - the viewer: every rank's summary read (``load_run(..., events_for=())``), the
     rank overview and the slow ranks computed, the events of the ranks drawn first
     read (rank 0 and the three slowest: ``with_events``);
   - ``ddpscope summary`` on the same folder;
   - on the first ``--full-ranks`` ranks alone (a folder of their own): that viewer
     against parsing every event of every rank (``load_run(path)``), on every core and
     on one.

Prints the format's size (summary against events, bytes a rank and in all), each
measurement, the ratios, and whether the overview and ``summary`` name the slow rank.
Goal (issue 22): the viewer of 1,024 ranks in <= 5 s and <= 1 GiB. Benchmarks are not
tests: nothing is asserted. ``--smoke``: 16 ranks x 10 steps, 8 parsed in full, once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.tracer.step_summary import summarize_steps
from ddpscope.tracer.writer import TraceWriter, read_json, write_json_atomic
from ddpscope.viz.run_files import read_rank_file

ROOT = Path(__file__).resolve().parents[1]

VIEWER = """
import json, sys, time
import ddpscope.viz.parallel as parallel
from ddpscope.viz.sources.rank_events import with_events
from ddpscope.viz.trace import load_run
from ddpscope.viz.ddp.rank_overview import compute_rank_overview, compute_slow_ranks, ranks_to_show, slow_rank_line
def _vm(key):  # kB, from /proc/self/status
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))
mode = sys.argv[2]
if mode == "one-core":
    parallel.MIN_PARALLEL_BYTES = 2**62
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts here, after the imports
base = _vm("VmRSS")
t = time.perf_counter()
if mode == "summary-first":
    trace = load_run(sys.argv[1], events_for=())
    read_s = time.perf_counter() - t
    slow = compute_slow_ranks(compute_rank_overview(trace))
    trace = with_events(trace, ranks_to_show(trace))
else:  # every event of every rank
    trace = load_run(sys.argv[1])
    read_s = time.perf_counter() - t
    slow = compute_slow_ranks(compute_rank_overview(trace))
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "read_s": read_s, "peak_kib": _vm("VmHWM"), "base_kib": base,
                  "ranks": len(trace.ranks), "event_ranks": len(trace.event_ranks or trace.ranks),
                  "slowest": int(slow["rank"].iloc[0]), "line": slow_rank_line(slow)}))
"""


def trace_real_run(out: Path, steps: int) -> None:
    """A real 2-rank DDP run, traced (``ddpscope run --demo mlp``)."""
    proc = subprocess.run([sys.executable, "-m", "ddpscope.cli", "run", "--demo", "mlp", "--nproc", "2",
                           "--steps", str(steps), "--out", str(out), "--quiet"], capture_output=True, text=True,
                          timeout=900, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"the real 2-rank run failed:\n{proc.stderr[-3000:]}")


def synthesise(source: Path, out: Path, ranks: int, slow: int, slow_ms: float = 30.0, seed: int = 0) -> None:
    """``ranks`` rank files (and their summaries, by the tracer's writer) from rank 0 of the
    real run in ``source``: shifted clocks, ±3 % durations, rank ``slow`` ``slow_ms`` slow.

    Every rank copies the same source rank: copies of two real ranks would carry whatever
    imbalance the real run had between them (on a loaded machine one rank can trail the
    other by more than ``slow_ms``), and the injected slow rank would not be the slowest."""
    rng = random.Random(seed)
    meta, events = read_rank_file(source / fmt.rank_file(0))
    out.mkdir(parents=True, exist_ok=False)
    run = read_json(source / fmt.RUN_FILE)
    write_json_atomic(out / fmt.RUN_FILE, {**run, "world_size": ranks, "nproc_per_node": 8,
                                           "synthesised_from": str(source)})
    for rank in range(ranks):
        shift = rng.uniform(-5000.0, 5000.0)  # µs: this rank's clock against its source's
        co = meta.get("clock_offset") or {}
        offsets = {k: ({"offset_us": v["offset_us"] - shift, "at_us": v["at_us"] + shift, "rtt_us": 0.0}
                       if v else None) for k, v in (("start", co.get("start")), ("end", co.get("end")))}
        final = {**meta, "rank": rank, "world_size": ranks, "host": f"node{rank // 8}", "clock_offset": offsets}
        writer = TraceWriter(out / fmt.rank_file(rank), {**final, "status": fmt.RUNNING}, 0.05,
                             summary_path=out / fmt.summary_file(rank))
        header, steps = [], {}
        for e in events:
            step = (e.get("args") or {}).get("step")
            if e.get("ph") == "M" or step is None:
                header.append(e)
            else:
                steps.setdefault(step, []).append(e)
        writer.add([{**e, "pid": rank} for e in header])
        for step in sorted(steps):
            writer.add(_jittered(steps[step], rank, shift, rng, slow_ms if rank == slow else 0.0))
        writer.close(**{k: final[k] for k in ("status", "steps", "clock_offset")})


def _jittered(events: list[dict], rank: int, shift: float, rng: random.Random, late_ms: float) -> list[dict]:
    """One step's events on a clock ``shift`` µs off, durations ±3 %; with ``late_ms``,
    the forward that much longer and everything after it that much later."""
    forward_end = next((e["ts"] + e.get("dur", 0.0) for e in events if e.get("cat") == fmt.CAT_FORWARD), None)
    late = late_ms * 1e3
    out = []
    for e in events:
        e = {**e, "pid": rank, "ts": e["ts"] + shift}
        if "dur" in e:
            e["dur"] = e["dur"] * rng.uniform(0.97, 1.03)
        if late and forward_end is not None:
            if e.get("cat") in (fmt.CAT_STEP, fmt.CAT_FORWARD):
                e["dur"] += late
            elif e["ts"] - shift >= forward_end:
                e["ts"] += late
        out.append(e)
    return out


def measure(folder: Path, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", VIEWER, str(folder), mode], capture_output=True, text=True,
                          env=env, cwd=tempfile.gettempdir(), timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"the viewer ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary_cli(folder: Path) -> tuple[float, str]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "ddpscope.cli", "summary", str(folder)], capture_output=True,
                          text=True, timeout=900, cwd=tempfile.gettempdir())
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise SystemExit(f"ddpscope summary failed:\n{proc.stderr[-3000:]}")
    return wall, next((l for l in proc.stdout.splitlines() if l.startswith("slowest rank")), "(no slow rank named)")


def fold_cost_us(run: Path, repeat: int = 20) -> float:
    """The median time (µs) ``summarize_steps`` takes on one step's events of rank 0."""
    _, events = read_rank_file(run / fmt.rank_file(0))
    steps: dict[int, list] = {}
    for e in events:
        if "step" in (e.get("args") or {}):
            steps.setdefault(e["args"]["step"], []).append(e)
    times = []
    for _ in range(repeat):
        for evs in steps.values():
            t = time.perf_counter()
            summarize_steps(evs)
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def sizes(folder: Path, pattern: str) -> tuple[int, int]:
    files = list(folder.glob(pattern))
    return len(files), sum(p.stat().st_size for p in files)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--full-ranks", type=int, default=64, help="ranks of the run parsed in full, side by side")
    p.add_argument("--keep", help="build (or reuse) the synthetic runs in this folder")
    p.add_argument("--smoke", action="store_true", help="16 ranks x 10 steps, 8 in full")
    args = p.parse_args()
    if args.smoke:
        args.ranks, args.steps, args.full_ranks = 16, 10, 8
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ddpscope-many-"))
    slow = args.ranks * 5 // 8
    try:
        real, big, small = base / "real-2rank", base / f"synthetic-{args.ranks}", base / f"synthetic-{args.full_ranks}"
        if not real.exists():
            print(f"tracing a real 2-rank run of {args.steps} steps...", flush=True)
            trace_real_run(real, args.steps)
        for folder, n, s in ((big, args.ranks, slow), (small, args.full_ranks, args.full_ranks * 5 // 8)):
            if not folder.exists():
                t = time.perf_counter()
                synthesise(real, folder, n, s)
                print(f"synthesised {n} ranks in {time.perf_counter() - t:.1f} s ({folder})", flush=True)
        per_step = fold_cost_us(real)
        print(f"\nthe summary's cost on the training thread: {per_step:.1f} us a step (summarize_steps on the real "
              "run's steps, the gradient marks included, as the writer's add() hands them)")
        n_ev, ev_bytes = sizes(big, "rank-*.json")
        n_sum, sum_bytes = sizes(big, "rank-*.summary.jsonl")
        print(f"\nformat: {args.ranks} ranks x {args.steps} steps: events {ev_bytes / 2**20:.1f} MiB "
              f"({ev_bytes / n_ev / 1024:.1f} KiB a rank), summaries (JSON Lines, a row a step) "
              f"{sum_bytes / 2**20:.2f} MiB ({sum_bytes / n_sum / 1024:.1f} KiB a rank): "
              f"{ev_bytes / sum_bytes:.0f}x smaller")
        print(f"\n{'what':44s} {'ranks':>6s} {'wall s':>8s} {'read s':>8s} {'peak MiB':>9s} {'+MiB':>7s}  slowest")
        rows = {}
        for folder, n, mode in ((big, args.ranks, "summary-first"), (small, args.full_ranks, "summary-first"),
                                (small, args.full_ranks, "every event"), (small, args.full_ranks, "one-core")):
            r = rows[(n, mode)] = measure(folder, mode)
            what = {"summary-first": "viewer: summaries + events of 4 ranks shown",
                    "every event": "every event of every rank (every core)",
                    "one-core": "every event of every rank (one core)"}[mode]
            print(f"{what:44s} {n:6d} {r['wall_s']:8.2f} {r['read_s']:8.2f} {r['peak_kib'] / 1024:9.0f} "
                  f"{(r['peak_kib'] - r['base_kib']) / 1024:7.0f}  {r['slowest']}")
        wall, line = summary_cli(big)
        print(f"{'ddpscope summary (fresh process, imports too)':44s} {args.ranks:6d} {wall:8.2f}")
        full, first, one = (rows[(args.full_ranks, m)] for m in ("every event", "summary-first", "one-core"))
        print("(peak: the viewer process's own; parsing on every core, its worker processes hold their share "
              "besides)")
        print(f"\nat {args.full_ranks} ranks: summary-first {full['wall_s'] / first['wall_s']:.1f}x faster than every "
              f"event, {full['peak_kib'] / first['peak_kib']:.1f}x less peak memory; every core "
              f"{one['wall_s'] / full['wall_s']:.2f}x faster than one")
        at = rows[(args.ranks, "summary-first")]
        print(f"at {args.ranks} ranks: viewer {at['wall_s']:.2f} s (goal <= 5 s), peak {at['peak_kib'] / 1024:.0f} MiB "
              f"(goal <= 1024 MiB)")
        print(f"slow rank {slow}: the overview ranks rank {at['slowest']} first ({at['line']}); "
              f"ddpscope summary: {line}")
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
