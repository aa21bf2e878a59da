"""Profiler (Kineto) trace import at scale: ddpscope against Holistic Trace Analysis.

Builds a trace of at least 200 k events by repeating the steps of a shared GPU-cluster
trace (``../shared/data/kineto/hta-allreduce-rank0``), each copy shifted in time and
given fresh step numbers and correlation ids, then in the same run, alternating, each in
its own fresh process:

- ddpscope: ``load_kineto`` + ``compute_hta_breakdown`` (overlap, idle, compute);
- HTA (``holistictraceanalysis`` from PyPI, installed by this script into its own
  environment, not a project requirement): ``TraceAnalysis`` + ``get_comm_comp_overlap``
  + ``get_temporal_breakdown``.

Prints wall time (load + figures) and peak memory of each: the process's peak RSS while
it loads and computes (``VmHWM``, reset after the imports), and that peak's growth over
the RSS after imports (what loading adds to a running dashboard), the ratios, and both tools' figures for the big trace.
Goal: >= 10x faster and >= 3x less peak memory than HTA.

    python -m benchmarks.kineto [--copies 6] [--rounds 3] [--hta-env /tmp/ddpscope-hta-env] [--smoke]

Benchmarks are not tests: nothing is asserted. ``--smoke``: one copy, one round, and HTA
only where its environment already exists (installing it, Jupyter included, takes minutes).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "data" / "kineto" / "hta-allreduce-rank0" / "rank-0.json.gz"
HTA_VERSION = "0.5.0"

DDPSCOPE = """
import json, sys, time
from ddpscope.viz.sources.kineto import load_kineto
from ddpscope.viz.kernel_overlap import compute_hta_breakdown
def _vm(key):  # kB, from /proc/self/status (ru_maxrss would carry the parent's peak across exec)
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts here, after the imports
base = _vm("VmRSS")
t = time.perf_counter()
trace = load_kineto(sys.argv[1])
hta = compute_hta_breakdown(trace)
wall = time.perf_counter() - t
row = hta.iloc[0]
print(json.dumps({"wall_s": wall, "peak_kib": _vm("VmHWM"), "base_kib": base,
                  "events": int(len(trace.kernels)), "overlap": row.comp_comm_overlap_pct, "idle": row.idle_pct,
                  "compute": row.compute_pct, "non_compute": row.non_compute_pct}))
"""

HTA = """
import json, logging, sys, time
logging.disable(logging.WARNING)
from hta.trace_analysis import TraceAnalysis
def _vm(key):  # kB, from /proc/self/status (ru_maxrss would carry the parent's peak across exec)
    return int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith(key + ":")))
open("/proc/self/clear_refs", "w").write("5")  # the peak restarts here, after the imports
base = _vm("VmRSS")
t = time.perf_counter()
a = TraceAnalysis(trace_dir=sys.argv[1])
o = a.get_comm_comp_overlap(visualize=False)
b = a.get_temporal_breakdown(visualize=False)
wall = time.perf_counter() - t
print(json.dumps({"wall_s": wall, "peak_kib": _vm("VmHWM"), "base_kib": base,
                  "events": int(len(a.t.get_trace(0))), "overlap": float(o["comp_comm_overlap_pctg"][0]),
                  "idle": float(b["idle_time_pctg"][0]), "compute": float(b["compute_time_pctg"][0]),
                  "non_compute": float(b["non_compute_time_pctg"][0])}))
"""


def build_trace(out: Path, copies: int) -> int:
    """Write ``copies`` back-to-back repetitions of the source trace's events as one rank's
    trace (gzip); the number of events written."""
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
    data["traceEvents"] = out_events
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / "rank-0.json.gz", "wt", compresslevel=3) as f:
        json.dump(data, f)
    return len(out_events)


def hta_python(env: Path) -> Path:
    """The HTA environment's python, created (pip install) the first time."""
    py = env / "bin" / "python"
    if not py.exists():
        print(f"installing holistictraceanalysis=={HTA_VERSION} into {env} (once)...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"holistictraceanalysis=={HTA_VERSION}"], check=True)
    return py


def measure(python: Path, code: str, folder: Path, pythonpath: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": pythonpath or ""}
    proc = subprocess.run([str(python), "-c", code, str(folder)], capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{python} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--copies", type=int, default=6, help="repetitions of the source trace (40 k events each)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hta-env", default=str(Path(tempfile.gettempdir()) / "ddpscope-hta-env"))
    p.add_argument("--smoke", action="store_true", help="one copy, one round; HTA only if already installed")
    args = p.parse_args()
    if not SOURCE.exists():
        raise SystemExit(f"{SOURCE} is absent: this benchmark needs ../shared beside the project")
    if args.smoke:
        args.copies, args.rounds = 1, 1
    hta_py = None if args.smoke and not (Path(args.hta_env) / "bin" / "python").exists() else \
        hta_python(Path(args.hta_env))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "big"
        n = build_trace(folder, args.copies)
        size = (folder / "rank-0.json.gz").stat().st_size
        print(f"trace: {n} events ({args.copies} copies of {SOURCE.parent.name}), {size / 2**20:.1f} MiB gzip")
        runs: dict[str, list[dict]] = {"ddpscope": [], "HTA": []} if hta_py else {"ddpscope": []}
        for r in range(args.rounds):  # alternate: both see the same machine drift
            runs["ddpscope"].append(measure(Path(sys.executable), DDPSCOPE, folder, str(ROOT)))
            if hta_py:
                runs["HTA"].append(measure(hta_py, HTA, folder, None))
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v[-1]['wall_s']:.2f} s" for k, v in runs.items()), flush=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in ("wall_s", "peak_kib", "base_kib")}
           for k, v in runs.items()}
    print(f"\n{'':10} {'load+figures s':>14} {'peak RSS MiB':>13} {'growth MiB':>11}   (medians of {args.rounds}; "
          "the peak RSS counts each tool's imports)")
    for k, m in med.items():
        print(f"{k:10} {m['wall_s']:14.2f} {m['peak_kib'] / 1024:13.0f} {(m['peak_kib'] - m['base_kib']) / 1024:11.0f}")
    if "HTA" not in med:
        print("HTA: not run (--smoke without its environment)")
    else:
        d, h = med["ddpscope"], med["HTA"]
        print(f"HTA / ddpscope: time {h['wall_s'] / d['wall_s']:.1f}x, peak RSS {h['peak_kib'] / d['peak_kib']:.1f}x, "
              f"RSS growth {(h['peak_kib'] - h['base_kib']) / (d['peak_kib'] - d['base_kib']):.1f}x   "
              "(goal: >= 10x time, >= 3x memory)")
    print("figures (rank 0, %):      overlap   idle  compute  non-compute")
    for k, v in runs.items():
        x = v[-1]
        print(f"  {k:22} {x['overlap']:8.2f} {x['idle']:6.2f} {x['compute']:8.2f} {x['non_compute']:12.2f}")


if __name__ == "__main__":
    main()
