"""What-if accuracy: predictions from one trace against real reruns at each cap.

    python -m benchmarks.whatif [--steps 20] [--repeat 2] [--models gpt,mlp,wide] [--no-calibrate]

For each model (the demo GPT and MLP, and ``wide``: a script with a few large
parameters, an 8192-row embedding and 2048-wide layers, written below as a user would),
trace it at its script's own bucket_cap_mb (DDP's default), run ``ddpscope calibrate``
on that run, predict caps 0.25, 1, 4, 16, 64 and 256 MiB, then run each for real
(``--repeat`` times, interleaved, and the traced cap again) and print predicted beside
measured step time and exposed communication (medians over non-warm-up steps and ranks,
ms; the measured value is the median over the repeats) and the errors, with the noise
floor: how far real runs of one cap spread, and how far a rerun of the traced cap lands
from the trace. Every run goes through the ``ddpscope`` command, one after another
(nothing else should run on the machine meanwhile).

Goals (issue 10): replaying the traced cap within 5 %; mean absolute error over the
sweep <= 10 % on step time and, on exposed communication, within 15 % or 2 ms.
Benchmarks are not tests: the numbers are printed, nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CAPS = (0.25, 1.0, 4.0, 16.0, 64.0, 256.0)
WIDE_SCRIPT = textwrap.dedent('''
    import argparse
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(8192, 512), nn.Flatten(), nn.Linear(512 * 8, 2048), nn.ReLU(),
                          nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 8192))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3, momentum=0.9)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        x = torch.randint(0, 8192, (64, 8), generator=g)
        y = torch.randint(0, 8192, (64,), generator=g)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
''')


def ddpscope(*args: str) -> None:
    cmd = [sys.executable, "-m", "tracer", *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")


def trace(model: str, out: Path, cap: float | None, steps: int, script: Path) -> float:
    t0 = time.perf_counter()
    capflag = [] if cap is None else ["--bucket-cap-mb", repr(cap)]
    if model == "wide":
        ddpscope("run", "--nproc", "2", *capflag, "--out", str(out), "--", str(script), "--steps", str(steps))
    else:
        ddpscope("run", "--nproc", "2", "--demo", model, "--steps", str(steps), *capflag, "--out", str(out))
    return time.perf_counter() - t0


def medians(t) -> tuple[float, float]:
    from viz.overlap import compute_step_breakdown

    b = compute_step_breakdown(t)
    return float(b["step_ms"].median()), float(b["exposed_ms"].median())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeat", type=int, default=2, help="real runs per cap, interleaved (their median counts)")
    p.add_argument("--models", default="gpt,mlp,wide")
    p.add_argument("--no-calibrate", action="store_true")
    args = p.parse_args()
    from viz.trace import load_run
    from viz.whatif.model import fit_model
    from viz.whatif.simulate import predict_run

    work = Path(tempfile.mkdtemp(prefix="ddpscope-whatif-"))
    script = work / "wide_train.py"
    script.write_text(WIDE_SCRIPT)
    summary = []
    for model in args.models.split(","):
        base = work / f"{model}-base"
        trace(model, base, None, args.steps, script)
        cal_s = 0.0
        if not args.no_calibrate:
            t0 = time.perf_counter()
            ddpscope("calibrate", str(base))
            cal_s = time.perf_counter() - t0
        t = load_run(base)
        t0 = time.perf_counter()
        m = fit_model(t)
        traced_cap = float(t.run["bucket_cap_mb"])
        preds = {cap: medians(predict_run(t, cap, m)) for cap in CAPS}
        replay = medians(predict_run(t, traced_cap, m))
        predict_s = time.perf_counter() - t0
        # real runs, interleaved: a slow spell of the machine touches one run of each cap
        runs: dict[object, list[tuple[float, float]]] = {cap: [] for cap in (*CAPS, "base")}
        run_s = 0.0
        for rep in range(args.repeat):
            for cap in (*CAPS, "base"):
                out = work / f"{model}-{cap if cap == 'base' else format(cap, 'g')}-r{rep}"
                run_s += trace(model, out, None if cap == "base" else cap, args.steps, script)
                runs[cap].append(medians(load_run(out)))
        measured = {cap: tuple(statistics.median(v[i] for v in runs[cap]) for i in (0, 1)) for cap in runs}
        spread = {cap: 100 * (max(v[0] for v in runs[cap]) - min(v[0] for v in runs[cap])) / measured[cap][0]
                  for cap in runs}
        base_m = medians(t)
        print(f"\n== {model}: traced at bucket_cap_mb={traced_cap:g} ({len(t.run['bucket_layout'])} buckets), "
              f"{t.world_size} ranks, {args.steps} steps; {args.repeat} real runs per cap"
              + ("" if args.no_calibrate else f"; calibrate took {cal_s:.1f} s"), flush=True)
        for note in m.notes:
            print(f"   model: {note}")
        print(f"{'cap MiB':>8} {'step pred':>9} {'step meas':>9} {'err %':>6} {'spread %':>8} | {'exp pred':>8} "
              f"{'exp meas':>8} {'err ms':>7} {'err %':>6}")
        rows = [("replay", replay, base_m, float("nan"))] + [
            (f"{c:g}", preds[c], measured[c], spread[c]) for c in CAPS]
        step_err, exp_ok = [], []
        for name, (sp, ep), (sm, em), sd in rows:
            se = 100 * (sp - sm) / sm
            ee_ms, ee_pct = ep - em, 100 * (ep - em) / em if em > 0 else float("nan")
            print(f"{name:>8} {sp:9.1f} {sm:9.1f} {se:6.1f} {sd:8.1f} | {ep:8.1f} {em:8.1f} {ee_ms:7.1f} {ee_pct:6.1f}")
            if name != "replay":
                step_err.append(abs(se))
                exp_ok.append(abs(ee_ms) <= 2.0 or abs(ee_pct) <= 15.0)
        mae = sum(step_err) / len(step_err)
        exp_mae_ms = sum(abs(preds[c][1] - measured[c][1]) for c in CAPS) / len(CAPS)
        rep = 100 * abs(replay[0] - base_m[0]) / base_m[0]
        rerun = 100 * (measured["base"][0] - base_m[0]) / base_m[0]
        noise = statistics.median(spread[c] for c in CAPS)
        print(f"replay error {rep:.1f}% (goal <= 5%); step MAE {mae:.1f}% (goal <= 10%); exposed: "
              f"{sum(exp_ok)}/{len(exp_ok)} caps within 15% or 2 ms, MAE {exp_mae_ms:.1f} ms")
        print(f"noise floor: the traced cap rerun for real differs from the trace by {rerun:+.1f}%; real runs of one "
              f"cap spread {noise:.1f}% (median over caps); predicting {len(CAPS) + 1} caps took {predict_s:.2f} s, "
              f"running {len(runs) * args.repeat} took {run_s:.0f} s", flush=True)
        summary.append((model, rep, mae, sum(exp_ok), len(exp_ok), exp_mae_ms, rerun, noise))
    print("\nmodel   replay%  stepMAE%  exposed-ok  exposedMAE(ms)  rerun-vs-trace%  spread%")
    for model, rep, mae, ok, n, emae, rerun, noise in summary:
        print(f"{model:6} {rep:8.1f} {mae:9.1f} {ok:6d}/{n}  {emae:10.1f}  {rerun:15.1f}  {noise:7.1f}")
    print(f"(runs kept in {work})")


if __name__ == "__main__":
    main()
