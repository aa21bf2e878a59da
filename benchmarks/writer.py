"""The trace writer's cost, as a run grows: what the training thread pays per step to
hand a step's events over, and what the background thread pays per flush.

    python -m benchmarks.writer [--events-per-step 105] [--steps 100,1000,10000] [--smoke]

Side by side in one run, on the demo GPT's real events (a bundled sample, one step's
events repeated with new step numbers):
- hand-over (training thread, per step): ``TraceWriter.add`` (msgspec, one call per step)
  against encoding each event with ``json.dumps`` (what version 1 did);
- flush (writer thread, per 0.25 s flush of 4 steps at a given run length): appending
  what is new (``TraceWriter``) against rewriting the whole file atomically (version 1).
Medians of repeated timings; benchmarks are not tests: nothing is asserted; ``--smoke``
runs tiny sizes once (the script runs and prints its tables).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from ddpscope.tracer import format as fmt
from ddpscope.tracer.writer import TraceWriter, write_bytes_atomic
from ddpscope.viz.run_files import read_rank_file

SAMPLE = Path(__file__).resolve().parents[1] / "samples" / "gpt-2rank-cap1mb" / "rank-0.json"
_SEP = (",", ":")


def step_events(n: int) -> list[dict]:
    """One step's worth of real events (the sample's step 3, padded or cut to ``n``), read
    with the project's own reader of rank files."""
    _, events = read_rank_file(SAMPLE)
    events = [e for e in events if (e.get("args") or {}).get("step") == 3]
    return (events * (n // len(events) + 1))[:n]


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--events-per-step", type=int, default=105, help="the demo GPT at cap 1 MiB: 105")
    p.add_argument("--steps", default="100,1000,10000", help="run lengths at which a flush is timed")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat: the script runs, nothing more")
    args = p.parse_args()
    repeats = (1, 1, 1) if args.smoke else (200, 20, 5)
    if args.smoke:
        args.steps = "10"
    events = step_events(args.events_per_step)
    meta = {"format": fmt.FORMAT, "version": fmt.VERSION, "status": fmt.RUNNING, "rank": 0, "world_size": 2}
    with tempfile.TemporaryDirectory() as tmp:
        w = TraceWriter(Path(tmp) / "rank-0.json", meta, min_interval_s=3600)  # flushed by hand below
        add = median_us(lambda: w.add(events), repeats[0])
        w._pending.clear()
        dumps = median_us(lambda: [json.dumps(e, separators=_SEP).encode() for e in events], repeats[0])
        print(f"hand-over per step ({len(events)} events), training thread:")
        print(f"  msgspec (now) {add:8.1f} µs   json.dumps per event (v1) {dumps:8.1f} µs   ratio v1/now {dumps / add:5.1f}x")
        print("flush of 4 steps, writer thread, by run length:")
        print(f"  {'steps so far':>12}  {'file MiB':>8}  {'append (now) µs':>15}  {'rewrite (v1) µs':>15}  {'ratio':>7}")
        encoded = [json.dumps(e, separators=_SEP).encode() for e in events]
        for steps in (int(s) for s in args.steps.split(",")):
            path = Path(tmp) / f"grow-{steps}.json"
            w2 = TraceWriter(path, meta, min_interval_s=3600)
            for _ in range(steps):
                w2.add(events)
            w2._flush()

            def append():
                for _ in range(4):
                    w2.add(events)
                w2._flush()

            all_events = encoded * steps
            v1_path = Path(tmp) / f"v1-{steps}.json"

            def rewrite():
                all_events.extend(encoded * 4)
                write_bytes_atomic(v1_path, [b'{"traceEvents":[\n', b",\n".join(all_events),
                                             b'\n],"displayTimeUnit":"ms","otherData":{"ddpscope":',
                                             json.dumps(meta, separators=_SEP).encode(), b"}}\n"])

            repeat = repeats[1] if steps <= 1000 else repeats[2]
            a, r = median_us(append, repeat), median_us(rewrite, repeat)
            size = path.stat().st_size / 2**20
            print(f"  {steps:>12}  {size:8.1f}  {a:15.0f}  {r:15.0f}  {r / a:6.1f}x")
            w2.close(status=fmt.COMPLETE)
        w.close(status=fmt.COMPLETE)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
