"""Profiler (Kineto) trace import at scale: ddpscope against Holistic Trace Analysis.

Builds a job of ``--ranks`` ranks (16), each a real GPU-cluster trace
(``../shared/data/kineto/hta-allreduce-rank0``, ~40 k events) repeated ``--copies``
times (3: ~110 k events a rank, 1.75 M in all), each copy shifted in time and given
fresh step numbers and correlation ids; each rank's clock shifted by 2-8 ms and every
GPU kernel's duration jittered ±3 % (its own seed). Then in the same run, alternating,
each in its own fresh process:

- ddpscope: ``load_kineto`` + ``compute_hta_breakdown`` (overlap, idle, compute);
- HTA (``holistictraceanalysis`` from PyPI, installed by this script into its own
  environment, not a project requirement): ``TraceAnalysis`` + ``get_comm_comp_overlap``
  + ``get_temporal_breakdown``.

Prints wall time (load + figures) and peak memory of each: the process's own peak RSS
(``VmHWM``, reset after the imports), and the peak of the memory of the process and
every process it started (PSS summed, sampled every 20 ms: both tools parse files in
worker processes, forked), the ratios, and both tools' figures for every rank, with the largest
difference. Goal: >= 10x faster, >= 3x less peak memory than HTA, every rank's figures
within 0.1 pp of HTA's.

    python -m benchmarks.kineto [--ranks 16] [--copies 3] [--rounds 3] [--hta-env /tmp/ddpscope-hta-env] [--smoke]

Benchmarks are not tests: nothing is asserted. ``--smoke``: 2 ranks, one copy, one round, and
HTA only where its environment already exists (installing it, Jupyter included, takes minutes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "data" / "kineto" / "hta-allreduce-rank0" / "rank-0.json.gz"
HTA_VERSION = "0.5.0"

DDPSCOPE = """
import json, sys, time
from ddpscope.viz.sources.kineto import load_kineto
from ddpscope.viz.ddp.kernel_overlap import compute_hta_breakdown
def _vm(key):  # kB, from /proc/self/status (ru_maxrss would carry the parent's peak across exec)
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts here, after the imports
base = _vm("VmRSS")
print("ready", flush=True)
t = time.perf_counter()
trace = load_kineto(sys.argv[1])
hta = compute_hta_breakdown(trace)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "peak_kib": _vm("VmHWM"), "base_kib": base, "events": int(len(trace.kernels)),
                  "ranks": {int(r.rank): {"overlap": r.comp_comm_overlap_pct, "idle": r.idle_pct,
                                          "compute": r.compute_pct, "non_compute": r.non_compute_pct}
                            for r in hta.itertuples()}}))
"""

HTA = """
import json, logging, sys, time
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
def _vm(key):  # kB, from /proc/self/status (ru_maxrss would carry the parent's peak across exec)
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts here, after the imports
base = _vm("VmRSS")
print("ready", flush=True)
t = time.perf_counter()
a = TraceAnalysis(trace_dir=sys.argv[1])
o = a.get_comm_comp_overlap(visualize=False).set_index("rank")
b = a.get_temporal_breakdown(visualize=False).set_index("rank")
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "peak_kib": _vm("VmHWM"), "base_kib": base,
                  "events": int(sum(len(a.t.get_trace(r)) for r in a.t.get_all_traces())),
                  "ranks": {int(r): {"overlap": float(o.loc[r, "comp_comm_overlap_pctg"]),
                                     "idle": float(b.loc[r, "idle_time_pctg"]),
                                     "compute": float(b.loc[r, "compute_time_pctg"]),
                                     "non_compute": float(b.loc[r, "non_compute_time_pctg"])} for r in o.index}}))
"""
FIGURES = ("overlap", "idle", "compute", "non_compute")


def repeated_events(copies: int) -> tuple[dict, list[dict]]:
    """The source trace (its fields) and ``copies`` back-to-back repetitions of its events."""
    data = json.loads(gzip.open(SOURCE).read())
    events = data["traceEvents"]
    timed = [e for e in events if isinstance(e.get("ts"), (int, float)) and e.get("ph") != "M"]
    lo = min(e["ts"] for e in timed)
    period = max(e["ts"] + e.get("dur", 0) for e in timed) - lo + 1000.0
    steps = [int(e["name"].split("#")[1]) for e in timed if e["name"].startswith("ProfilerStep#")]
    nsteps = max(steps) - min(steps) + 1
    ids = [e.get("args", {}).get(k, 0) for e in timed for k in ("correlation", "External id")]
    id_span = max(i for i in ids if isinstance(i, int)) + 1
    flow_span = max((e.get("id", 0) for e in timed if isinstance(e.get("id"), int)), default=0) + 1
    out_events = [e for e in events if e.get("ph") == "M"]
    for k in range(copies):
        for e in timed:
            e = dict(e)
            e["ts"] = e["ts"] + k * period
            if isinstance(e.get("args"), dict):
                args = e["args"] = dict(e["args"])
                for key in ("correlation", "External id"):
                    if isinstance(args.get(key), int) and args[key] > 0:
                        args[key] += k * id_span
            if isinstance(e.get("id"), int):
                e["id"] += k * flow_span
            if e["name"].startswith("ProfilerStep#"):
                e["name"] = f"ProfilerStep#{int(e['name'].split('#')[1]) + k * nsteps}"
            out_events.append(e)
    return data, out_events


def build_job(out: Path, ranks: int, copies: int, seed: int = 0, world_size: int | None = None) -> int:
    """``ranks`` rank files (gzip) of the repeated source trace, each with its clock
    shifted by 2-8 ms and its GPU kernels' durations jittered ±3 %, of a job of
    ``world_size`` ranks (``ranks``: all of them); the number of events written."""
    data, events = repeated_events(copies)
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for rank in range(ranks):
        rng = random.Random(seed * 1000 + rank)
        shift = rng.uniform(2000.0, 8000.0)
        mine = []
        for e in events:
            if "ts" in e and e.get("ph") != "M":
                e = {**e, "ts": e["ts"] + shift}
                if e.get("cat") == "kernel" and "dur" in e:
                    e["dur"] = e["dur"] * rng.uniform(0.97, 1.03)
            mine.append(e)
        info = {**(data.get("distributedInfo") or {}), "rank": rank, "world_size": world_size or ranks}
        with gzip.open(out / f"rank-{rank}.json.gz", "wt", compresslevel=3) as f:
            json.dump({**data, "distributedInfo": info, "traceEvents": mine}, f)
        total += len(mine)
    return total


def hta_python(env: Path) -> Path:
    """The HTA environment's python, created (pip install) the first time."""
    py = env / "bin" / "python"
    if not py.exists():
        print(f"installing holistictraceanalysis=={HTA_VERSION} into {env} (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"holistictraceanalysis=={HTA_VERSION}"], check=True)
    return py


def _tree_pss_kib(root: int) -> int:
    """The memory (kB) of ``root`` and every process below it, now: their PSS summed
    (a page shared by n processes counts 1/n in each: a forked worker's shared imports
    count once, where summed RSS would count them in every process)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, todo = set(), [root]
    while todo:
        p = todo.pop()
        tree.add(p)
        todo += [c for c, pp in parent.items() if pp == p and c not in tree]
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("Pss:")), 0)
        except OSError:
            continue
    return total


def measure(python: Path, code: str, folder: Path, pythonpath: str | None) -> dict:
    """The tool's own figures, and the peak of its process tree's memory (PSS, sampled
    every 20 ms from when its imports are done)."""
    env = {**os.environ, "PYTHONPATH": pythonpath or ""}
    proc = subprocess.Popen([str(python), "-c", code, str(folder)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tempfile.gettempdir())
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            peak[0] = max(peak[0], _tree_pss_kib(proc.pid))

    first = proc.stdout.readline()  # "ready": the imports are done
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=1800)
    finally:
        done.set()
        sampler.join()
    if proc.returncode != 0 or first.strip() != "ready":
        raise SystemExit(f"{python} failed:\n{err[-3000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["tree_peak_kib"] = peak[0]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--copies", type=int, default=3, help="repetitions of the source trace (40 k events each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hta-env", default=str(Path(tempfile.gettempdir()) / "ddpscope-hta-env"))
    p.add_argument("--smoke", action="store_true", help="2 ranks, one copy, one round; HTA only if already installed")
    args = p.parse_args()
    if not SOURCE.exists():
        raise SystemExit(f"{SOURCE} is absent: this benchmark needs ../shared beside the project")
    if args.smoke:
        args.ranks, args.copies, args.rounds = 2, 1, 1
    hta_py = None if args.smoke and not (Path(args.hta_env) / "bin" / "python").exists() else \
        hta_python(Path(args.hta_env))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "job"
        n = build_job(folder, args.ranks, args.copies)
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"job: {args.ranks} ranks, {n} events ({args.copies} copies of {SOURCE.parent.name} a rank, clocks "
              f"shifted 2-8 ms, kernels ±3 %), {size / 2**20:.1f} MiB gzip")
        runs: dict[str, list[dict]] = {"ddpscope": [], "HTA": []} if hta_py else {"ddpscope": []}
        for r in range(args.rounds):  # alternate: both see the same machine drift
            runs["ddpscope"].append(measure(Path(sys.executable), DDPSCOPE, folder, str(ROOT.parent)))
            if hta_py:
                runs["HTA"].append(measure(hta_py, HTA, folder, None))
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]['wall_s']:.2f} s" for k, v in runs.items()), flush=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("wall_s", "peak_kib", "base_kib", "tree_peak_kib")}
           for k, v in runs.items()}
    print(f"\n{'':10} {'load+figures s':>14} {'peak RSS MiB':>13} {'growth MiB':>11} {'tree peak MiB':>14}   "
          f"(medians of {args.rounds}; the peaks count each tool's imports)")
    for k, m in med.items():
        print(f"{k:10} {m['wall_s']:14.2f} {m['peak_kib'] / 1024:13.0f} {(m['peak_kib'] - m['base_kib']) / 1024:11.0f} "
              f"{m['tree_peak_kib'] / 1024:14.0f}")
    if "HTA" not in med:
        print("HTA: not run (--smoke without its environment)")
    else:
        d, h = med["ddpscope"], med["HTA"]
        print(f"HTA / ddpscope: time {h['wall_s'] / d['wall_s']:.1f}x, peak RSS {h['peak_kib'] / d['peak_kib']:.1f}x, "
              f"RSS growth {(h['peak_kib'] - h['base_kib']) / (d['peak_kib'] - d['base_kib']):.1f}x, tree peak "
              f"{h['tree_peak_kib'] / d['tree_peak_kib']:.1f}x   (goal: >= 10x time, >= 3x memory)")
    ours = runs["ddpscope"][-1]["ranks"]
    theirs = runs["HTA"][-1]["ranks"] if "HTA" in runs else {}
    print("figures per rank, % (ddpscope / HTA):")
    print(f"  rank {'overlap':>17} {'idle':>15} {'compute':>15} {'non-compute':>15}")
    worst = 0.0
    for rank in sorted(ours, key=int):
        mine, hta = ours[rank], theirs.get(rank)
        cells = []
        for fig in FIGURES:
            cells.append(f"{mine[fig]:7.2f} / {hta[fig]:6.2f}" if hta else f"{mine[fig]:7.2f} /   -   ")
            if hta:
                worst = max(worst, abs(mine[fig] - hta[fig]))
        print(f"  {int(rank):4d} " + " ".join(f"{c:>15}" for c in cells))
    if theirs:
        print(f"largest difference from HTA over every rank and figure: {worst:.3f} pp (goal: <= 0.1 pp)")


if __name__ == "__main__":
    main()
