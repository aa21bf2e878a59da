"""The advisor where it matters: predictions and recommendations against real runs, on
loopback and on 2 emulated nodes (1 rank each) over shaped links.

    python -m benchmarks.advisor [--steps 10] [--repeats 2] [--links loopback,1gbit,200mbit]
                                 [--workloads mlp,large] [--caps 0.5,4,32,256] [--smoke]

For each workload (the demo MLP, and ``large``: a plain DDP script with four 4 MiB
weights, written below as a user would) and each regime: trace it at the script's own
setting (DDP's default), predict every cap and ask the advisor (``advise``), then run,
``--repeats`` times interleaved (every setting once, then again), the script's own
setting, every cap and the recommendation. Printed per setting, side by side: predicted
and measured step time (medians over non-warm-up steps and ranks; measured: the median
over repeats), the error, and the noise floor (the spread between repeats of one
setting, % of its median). Then per regime: MAPE over the caps and the recommendation
(goal in the emulated regimes: <= 5 %), and the gain check: when the predicted gain
exceeds the noise, the recommendation must measure faster than the script's own
setting, within +-30 % of the predicted gain.

Emulated regimes need CAP_NET_ADMIN (root here); without it they are left out, said
once. Benchmarks are not tests: nothing is asserted. ``--smoke``: the MLP on loopback,
caps 1 and 64, 4 steps, one repeat: the script runs, nothing more.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LARGE_SCRIPT = textwrap.dedent('''
    import argparse
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(1024, 1024), nn.ReLU())])
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        x = torch.randn(256, 1024, generator=g)
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
''')


def run(out: Path, workload: str, link: str, steps: int, script: Path, setting) -> float:
    """One traced run through the ``ddpscope`` command; its wall time (s)."""
    where = ["--nproc", "2"] if link == "loopback" else ["--emulate-nodes", "2", "--nproc", "1", "--link", link]
    if setting is None:
        cap = []
    elif isinstance(setting, tuple):
        cap = ["--bucket-cap-mb-list", ",".join(f"{c:g}" for c in setting)]
    else:
        cap = ["--bucket-cap-mb", f"{setting:g}"]
    what = ["--demo", workload, "--steps", str(steps)] if workload != "large" else \
        ["--", str(script), "--steps", str(steps)]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "ddpscope.cli", "run", "--quiet", *where, *cap, "--out", str(out), *what]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def step_ms(path: Path) -> float:
    from ddpscope.viz.trace import load_run
    from ddpscope.viz.whatif.sweep import _medians

    return _medians(load_run(path))["step_ms"]


def label(setting) -> str:
    from ddpscope.viz.whatif.advisor import setting_text

    return "own (DDP default)" if setting is None else setting_text(setting).split("=", 1)[1]


def regime(workload: str, link: str, args, caps, work: Path, script: Path) -> dict:
    from ddpscope.viz.trace import load_run
    from ddpscope.viz.whatif.advisor import advise
    from ddpscope.viz.whatif.model import fit_model
    from ddpscope.viz.whatif.simulate import predict_run
    from ddpscope.viz.whatif.sweep import _medians

    tag = f"{workload}-{link}"
    base = work / f"{tag}-base"
    run(base, workload, link, args.steps, script, None)
    t = load_run(base)
    model = fit_model(t)
    t0 = time.perf_counter()
    advice = advise(t, model)
    advise_s = time.perf_counter() - t0
    settings = [None, *caps] + ([advice.best] if advice.best not in (None, *caps) else [])
    pred = {s: (advice.traced_step_ms if s is None else _medians(predict_run(t, s, model))["step_ms"])
            for s in settings}
    meas: dict = {s: [] for s in settings}
    for rep in range(args.repeats):
        for k, s in enumerate(settings):
            out = work / f"{tag}-r{rep}-{k}"
            run(out, workload, link, args.steps, script, s)
            meas[s].append(step_ms(out))
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    print(f"\n== {workload} over {link}: traced at DDP's default ({len(t.run['bucket_layout'])} buckets, "
          f"{t.world_size} ranks, {args.steps} steps); advisor took {advise_s:.1f} s: "
          f"{'recommends ' + label(advice.setting) if advice.change else 'keep: ' + advice.why}", flush=True)
    for note in model.notes:
        print(f"   model: {note}")
    print(f"{'setting':>24} {'pred ms':>9} {'meas ms':>9} {'err %':>7} {'noise %':>8}")
    errs, noises = [], []
    for s in settings:
        m = statistics.median(meas[s])
        err = 100 * (pred[s] - m) / m
        noise = 100 * (max(meas[s]) - min(meas[s])) / m if len(meas[s]) > 1 else float("nan")
        noises.append(noise)
        if s is not None:
            errs.append(abs(err))
        mark = "  <- recommended" if s == advice.best else ""
        print(f"{label(s):>24} {pred[s]:9.1f} {m:9.1f} {err:7.1f} {noise:8.1f}{mark}")
    own_m, best_m = statistics.median(meas[None]), statistics.median(meas[advice.best])
    gained = own_m - best_m
    pred_gain = advice.gain_ms
    within = abs(gained - pred_gain) <= 0.3 * abs(pred_gain) if pred_gain else None
    mape = statistics.mean(errs)
    floor = statistics.median(n for n in noises if n == n) if any(n == n for n in noises) else float("nan")
    print(f"MAPE over the caps and the recommendation: {mape:.1f} % (goal <= 5 % when emulated); noise floor "
          f"(median spread between repeats) {floor:.1f} %")
    print(f"gain: predicted {pred_gain:.1f} ms (interval {advice.interval_ms[0]:.1f}..{advice.interval_ms[1]:.1f}, "
          f"{'worth a change' if advice.change else 'not worth a change'}"
          + ("" if advice.gain_if_overlap_lost_ms is None else
             f"; {advice.gain_if_overlap_lost_ms:.1f} ms with the unmeasured steal at its bound")
          + f"), measured {gained:.1f} ms "
          f"(own {own_m:.1f} -> best found {best_m:.1f})"
          + ("" if within is None else f"; within +-30 % of the predicted gain: {'yes' if within else 'no'}"))
    return {"workload": workload, "link": link, "mape": mape, "noise": floor, "change": advice.change,
            "pred_gain": pred_gain, "gained": gained, "within": within, "own_ms": own_m}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--links", default="loopback,1gbit,200mbit")
    p.add_argument("--workloads", default="mlp,large")
    p.add_argument("--caps", default="0.5,4,32,256")
    p.add_argument("--keep", action="store_true", help="keep every run folder")
    p.add_argument("--smoke", action="store_true", help="the MLP on loopback, caps 1 and 64, 4 steps, one repeat")
    args = p.parse_args()
    if args.smoke:
        args.steps, args.repeats, args.links, args.workloads, args.caps = 4, 1, "loopback", "mlp", "1,64"
    caps = [float(c) for c in args.caps.split(",")]
    links = args.links.split(",")
    from ddpscope.tracer.launch.lab import why_not

    if any(x != "loopback" for x in links) and (reason := why_not()) is not None:
        print(f"emulated links left out: {reason}")
        links = [x for x in links if x == "loopback"]
    work = Path(tempfile.mkdtemp(prefix="ddpscope-advisor-"))
    script = work / "large_train.py"
    script.write_text(LARGE_SCRIPT)
    rows = [regime(w, link, args, caps, work, script) for w in args.workloads.split(",") for link in links]
    print("\nworkload  link        MAPE %  noise %  change  pred gain ms  measured gain ms  within 30 %")
    for r in rows:
        within = "-" if r["within"] is None else ("yes" if r["within"] else "no")
        print(f"{r['workload']:9} {r['link']:10} {r['mape']:7.1f} {r['noise']:8.1f}  {str(r['change']):6} "
              f"{r['pred_gain']:12.1f} {r['gained']:17.1f}  {within}")
    if args.keep:
        print(f"(runs kept in {work})")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
