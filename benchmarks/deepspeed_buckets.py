"""DeepSpeed's step at another reduce_bucket_size: predicted from one trace against real reruns.

    python -m benchmarks.deepspeed_buckets [--stages 2,3] [--sizes 0.5,1.5,4,16,64]
                                           [--layers 16] [--dim 512] [--steps 30] [--keep DIR] [--smoke]

Workload: an MLP of ``--layers`` ``--dim``-wide layers (16 x 512: 4.2 M parameters, a
1 MiB weight and a 2 KiB bias each), a client AdamW, DeepSpeed's engine at each ZeRO stage
(fp32, CPU accelerator, gloo), 2 ranks, written below as a user would, with no ddpscope in
it. For each stage it is run by ``ddpscope run`` once at each ``--sizes`` (MiB, as
``--bucket-cap-mb`` sets ``reduce_bucket_size``), and the first size once more (the noise
floor: the same setting twice). Every run is then a trace to predict every other size
from (``viz.sharded.deepspeed_buckets.predict_deepspeed_step_ms``, what ``ddpscope whatif``
and the Run page show): for each pair it prints the buckets a step predicted and
measured, and the step predicted against the rerun's measured median (non-warm-up
steps, rank 0), three ways that differ only where a run's own buckets give no fixed cost
a reduction (its buckets all one size, or a few large ones): "own line" takes none
(bandwidth only); "in situ", what ``whatif`` does, the fixed cost of the run's own small
all-reduces (``in_situ_latency``); "with calibration" a calibration of these ranks
(``ddpscope calibrate`` on the first run, copied into every folder) instead. The summary
is the mean absolute error over pairs, beside the noise floor. Goal: buckets exact; step
error within twice the noise floor or 5 %.

Benchmarks are not tests: nothing is asserted; ``--smoke`` runs tiny sizes once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("own line", "in situ", "with calibration")

SCRIPT = textwrap.dedent('''
    import argparse, os
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed, torch
    import torch.distributed as dist
    from torch import nn

    p = argparse.ArgumentParser()
    for flag in ("--stage", "--layers", "--dim", "--steps", "--bucket"):
        p.add_argument(flag, type=int)
    a = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(a.layers) for m in (nn.Linear(a.dim, a.dim), nn.ReLU())])
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9,
              "zero_optimization": {"stage": a.stage, "reduce_bucket_size": a.bucket,
                                    "stage3_param_persistence_threshold": 0}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    x = torch.randn(8, a.dim)
    for _ in range(a.steps):
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    engine.destroy()
    dist.barrier()
    dist.destroy_process_group()
''')


def run(tmp: Path, stage: int, mib: float, name: str, args) -> Path:
    """One traced 2-rank job at ``mib`` MiB; its folder."""
    script = tmp / "train_mlp.py"
    script.write_text(SCRIPT)
    out = tmp / name
    cmd = [sys.executable, "-m", "ddpscope.cli", "run", "--nproc", "2", "--bucket-cap-mb", repr(mib), "--out",
           str(out), "--quiet", "--", str(script), "--stage", str(stage), "--layers", str(args.layers),
           "--dim", str(args.dim), "--steps", str(args.steps), "--bucket", "1000"]
    proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if proc.returncode != 0:
        raise SystemExit(f"stage {stage} at {mib} MiB failed:\n{proc.stderr[-3000:]}")
    return out


def measured(trace) -> tuple[float, float]:
    """Rank 0's (median step ms, buckets a step) over real steps."""
    from ddpscope.viz.sharded.deepspeed_buckets import reductions
    from ddpscope.viz.sharded.metrics import compute_sharded_steps
    from ddpscope.viz.sharded.trace import real_steps

    real = real_steps(trace)
    steps = compute_sharded_steps(trace)
    steps = steps[(steps["rank"] == 0) & steps["step"].isin(real)]
    table = reductions(trace)
    per_step = table[table["rank"] == 0].groupby("step").size()
    return float(steps["step_ms"].median()), float(per_step.median())


def stage_table(tmp: Path, stage: int, args) -> dict[str, tuple[list[float], list[int]]]:
    from ddpscope.viz.sharded.deepspeed_buckets import bucket_cost, predict_deepspeed_step_ms
    from ddpscope.viz.trace import load_run

    sizes = [float(s) for s in args.sizes.split(",")]
    runs = {mib: load_run(run(tmp, stage, mib, f"s{stage}-{mib:g}", args)) for mib in sizes}
    again = load_run(run(tmp, stage, sizes[0], f"s{stage}-{sizes[0]:g}-again", args))
    truth = {mib: measured(t) for mib, t in runs.items()}
    noise = abs(measured(again)[0] / truth[sizes[0]][0] - 1) * 100
    print(f"\nZeRO stage {stage}: measured (rank 0, median over non-warm-up steps)")
    for mib in sizes:
        print(f"  {mib:>8g} MiB  {truth[mib][1]:4.0f} buckets  step {truth[mib][0]:8.2f} ms")
    print(f"  noise floor: {sizes[0]:g} MiB twice: {measured(again)[0]:.2f} against {truth[sizes[0]][0]:.2f} ms "
          f"({noise:.1f} %)")
    out = {}
    # side by side on the same runs, where a run's own buckets give no fixed cost a reduction: nothing
    # (bandwidth only), the run's own small all-reduces (what whatif uses), a calibration of these ranks
    # (`ddpscope calibrate`, copied into every folder; in_situ off so that it is the one read)
    for model in MODELS:
        if model == "with calibration":
            calibration = calibrate(tmp, runs[sizes[0]].path)
            for t in runs.values():
                if t.path != calibration.parent:
                    shutil.copy(calibration, t.path / "calibration.json")
        print(f"  predicted with {model}:")
        print(f"  {'from':>8} {'to':>8} {'buckets p/m':>12} {'step pred':>10} {'measured':>9} {'err %':>7}  cost")
        errors, exact = [], []
        for src, trace in runs.items():
            line = bucket_cost(trace, in_situ=model == "in situ")
            for mib in sizes:
                if mib == src:
                    continue
                row = predict_deepspeed_step_ms(trace, mib, cost=line).set_index("rank").loc[0]
                err = (row["predicted_step_ms"] / truth[mib][0] - 1) * 100
                errors.append(abs(err))
                exact.append(int(row["predicted_buckets"] == truth[mib][1]))
                print(f"  {src:>8g} {mib:>8g} {row['predicted_buckets']:5.0f}/{truth[mib][1]:<6.0f} "
                      f"{row['predicted_step_ms']:10.2f} {truth[mib][0]:9.2f} {err:+7.1f}  "
                      f"{line.latency_us * line.scale:.0f} us fixed ({_origin(line)})")
        out[model] = (errors, exact)
    out["noise"] = ([noise], [])
    return out


def _origin(line) -> str:
    """Where a cost line's fixed cost came from, in a word."""
    if line.points:
        return "calibration"
    return "small all-reduces" if line.source.startswith("fixed: ") else "own buckets"


def calibrate(tmp: Path, folder: Path) -> Path:
    """``ddpscope calibrate`` on ``folder`` (up to 16 MiB); the calibration's path."""
    proc = subprocess.run([sys.executable, "-m", "ddpscope.cli", "calibrate", "--max-mb", "16", "--quiet",
                           str(folder)], cwd=tmp, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"calibrate failed:\n{proc.stderr[-3000:]}")
    return folder / "calibration.json"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", default="2,3")
    p.add_argument("--sizes", default="0.5,1.5,4,16,64", help="reduce_bucket_size values, MiB")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--keep", help="keep the runs in this folder (new or empty), to read them again")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, stage 2 only")
    args = p.parse_args()
    if args.smoke:
        args.stages, args.sizes, args.layers, args.dim, args.steps = "2", "0.01,0.1", 3, 64, 5
    print(f"DeepSpeed step at another reduce_bucket_size: {args.layers} x {args.dim} MLP, 2 ranks, gloo, "
          f"{args.steps} steps a run")
    if args.keep:
        Path(args.keep).mkdir(parents=True, exist_ok=True)
    with (contextlib.nullcontext(args.keep) if args.keep else tempfile.TemporaryDirectory(prefix="ddpscope-dsb-")
          ) as tmp:
        for stage in (int(s) for s in args.stages.split(",")):
            table = stage_table(Path(tmp), stage, args)
            for model in MODELS:
                errors, exact = table[model]
                print(f"stage {stage}, {model}: buckets exact {sum(exact)}/{len(exact)}; step MAE "
                      f"{statistics.mean(errors):.1f} % (max {max(errors):.1f} %) over {len(errors)} predictions; "
                      f"noise floor {table['noise'][0][0]:.1f} %")


if __name__ == "__main__":
    main()
