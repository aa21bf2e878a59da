"""Sharded tracing: its overhead, and how well one trace predicts a rerun.

    python -m benchmarks.sharded [--rounds 4] [--steps 30] [--layers 8] [--dim 128] [--smoke]

Workload: ``tests/workers/fsdp2_train.py``, a torchtitan-style FSDP2 script (blocks
``fully_shard``-ed, then the root; AdamW), 2 ranks, gloo on CPU.

1. Overhead. Untraced jobs (torchrun alone) and traced ones (``ddpscope run``)
   alternate, ``--rounds`` of each, the order flipping every round, so the machine's
   drift hits both alike. Step times come from the script's own clock (rank 0, the
   first 3 steps of a job left out). Printed: each mode's median step, and the ratio
   traced / untraced of the medians with a bootstrap 95 % interval (steps resampled).
   Goal: <= 1.02.
2. Prediction. One traced job per ``reshard_after_forward`` (true, false); from each
   trace the other setting's peak memory and step time are predicted and set beside
   what the other job measured. Goal: peak within 5 %; the step time's error printed.

Benchmarks are not tests: nothing is asserted; ``--smoke`` runs tiny sizes once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "workers" / "fsdp2_train.py"


def _job(traced: bool, out: Path, report: Path, script_args: list[str], ddpscope_args: list[str] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DDPSCOPE_CAPTURE")}
    if traced:
        cmd = [sys.executable, "-m", "ddpscope.tracer", "run", "-q", "--nproc", "2", *ddpscope_args, "--out", str(out),
               "--", str(SCRIPT), *script_args, "--report", str(report)]
    else:
        from ddpscope.tracer.launch.torchrun import free_port

        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "static",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(SCRIPT), *script_args, "--report", str(report)]
    proc = subprocess.run(cmd, cwd="/", env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"benchmark job failed ({'traced' if traced else 'untraced'}): {proc.stderr[-2000:]}")
    return json.loads((report / "rank0.json").read_text())


def _ratio_ci(traced: list[float], base: list[float], n: int = 2000) -> tuple[float, float, float]:
    rng = random.Random(0)
    ratio = statistics.median(traced) / statistics.median(base)
    boots = sorted(statistics.median(rng.choices(traced, k=len(traced))) /
                   statistics.median(rng.choices(base, k=len(base))) for _ in range(n))
    return ratio, boots[int(0.025 * n)], boots[int(0.975 * n)]


def overhead(args, tmp: Path) -> None:
    script = ["--steps", str(args.steps), "--layers", str(args.layers), "--dim", str(args.dim), "--seq", "64"]
    steps = {"untraced": [], "traced": []}
    for k in range(args.rounds):
        for mode in (("untraced", "traced") if k % 2 == 0 else ("traced", "untraced")):
            rep = _job(mode == "traced", tmp / f"o-{mode}-{k}", tmp / f"o-{mode}-{k}-report", script)
            steps[mode] += rep["step_ms"][3:]
    print(f"overhead: {args.rounds} jobs per mode x {args.steps} steps, rank 0, the script's own step times (ms)")
    print(f"{'mode':>9} {'median':>8} {'steps':>6}")
    for mode, v in steps.items():
        print(f"{mode:>9} {statistics.median(v):8.2f} {len(v):6d}")
    r, lo, hi = _ratio_ci(steps["traced"], steps["untraced"])
    print(f"traced / untraced median step: {r:.3f} (95 % CI {lo:.3f}-{hi:.3f}); goal <= 1.02")


def prediction(args, tmp: Path) -> None:
    from ddpscope.viz.sharded_predict import predict_peak, predict_step_ms
    from ddpscope.viz.trace import load_run

    script = ["--steps", str(args.steps), "--layers", str(args.layers), "--dim", str(args.dim), "--seq", "64"]
    traces = {}
    for setting in ("true", "false"):
        out = tmp / f"p-{setting}"
        _job(True, out, tmp / f"p-{setting}-report", script, ["--reshard-after-forward", setting])
        traces[setting] = load_run(out)
    print("\nprediction: from one trace, the other reshard_after_forward (rank 0)")
    print(f"{'from':>6} {'to':>6} {'pred peak MiB':>14} {'meas peak MiB':>14} {'err %':>7} "
          f"{'pred step ms':>13} {'meas step ms':>13} {'err %':>7}")
    for src, dst in (("true", "false"), ("false", "true")):
        value = dst == "true"
        peak = predict_peak(traces[src], reshard_after_forward=value).iloc[0]
        measured = predict_peak(traces[dst]).iloc[0]["measured_peak_bytes"]
        step = predict_step_ms(traces[src], value).iloc[0]["predicted_step_ms"]
        meas_step = predict_step_ms(traces[dst]).iloc[0]["measured_step_ms"]
        print(f"{src:>6} {dst:>6} {peak['predicted_peak_bytes'] / 2**20:14.3f} {measured / 2**20:14.3f} "
              f"{(peak['predicted_peak_bytes'] / measured - 1) * 100:7.2f} {step:13.2f} {meas_step:13.2f} "
              f"{(step / meas_step - 1) * 100:7.2f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: the script runs, nothing more")
    args = p.parse_args(argv)
    if args.smoke:
        args.rounds, args.steps, args.layers, args.dim = 1, 5, 2, 32
    with tempfile.TemporaryDirectory(prefix="ddpscope-sharded-bench-") as tmp:
        overhead(args, Path(tmp))
        prediction(args, Path(tmp))


if __name__ == "__main__":
    main()
