"""What-if accuracy: predictions from one trace against real reruns at each cap.

    python -m benchmarks.whatif [--steps 20] [--rounds 2] [--models gpt,mlp,wide,compiled] [--no-calibrate]
                                [--base-cap MB] [--link loopback|1gbit|200mbit|...] [--work DIR] [--smoke]
    python -m benchmarks.whatif --from DIR [--models ...]

For each model (the demo GPT and MLP, and ``wide``: a script with a few large
parameters, an 8192-row embedding and 2048-wide layers, written below as a user would;
``compiled``, not run by default: six 256-wide MLP blocks ``torch.compile``'d and wrapped
in DDP as nanoGPT does, predicted at the caps of 1 MiB and more that it takes),
in each of ``--rounds`` rounds: trace it at its script's own bucket_cap_mb (DDP's
default), predict caps 0.25, 1, 4, 16, 64 and 256 MiB from that trace, then run each
for real. ``ddpscope calibrate`` runs once, on the first round's trace (its file is
copied to the later ones: same machine, same ranks). Printed per cap: predicted and
measured step time and exposed communication (medians over non-warm-up steps and ranks,
then over rounds, ms) and the mean absolute errors over rounds. This machine's speed
drifts by tens of percent within minutes (other tenants); forward compute, which no cap
changes, measures it: "drift-adj" is the error with the prediction scaled by the real
run's forward over the trace's. Every run goes through the ``ddpscope`` command, one
after another (nothing else should run on the machine meanwhile). ``--link RATE`` runs
every job (and the calibration) on 2 emulated nodes of 1 rank each over a link shaped to
RATE (the lab: ``docs/cluster.md``; root).

``--base-cap MB`` traces the base at that cap instead (a uniform cap's buckets are mostly
the cap: one size, which cannot tell a fixed cost per all-reduce from bandwidth). With a
calibration, each model's summary also says the step MAE of the same predictions made
without it ("uncalibrated"), side by side on the same real runs.

Goals (issues 10 and 33): replaying the traced cap within 5 %; mean absolute error over
the sweep <= 10 % on step time on loopback, <= 5 % in the lab; on exposed
communication, within 15 % or 2 ms.
Benchmarks are not tests: the numbers are printed, nothing is asserted; ``--smoke`` runs
the MLP at two caps, 4 steps, one round, no calibration: the script runs, nothing more.

The runs are kept (``--work DIR``, else a new temporary folder, named at the end; a smoke
run's is removed unless given). ``--from DIR`` predicts again from the traces and reruns a
previous run kept there, tracing and running nothing: a change to the model is compared
with the one before on the same runs, which no two rounds on this machine are.
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

# nanoGPT's way: the model compiled, then wrapped; torch.compile's DDPOptimizer splits its graph
# at DDP's buckets, so a cap also moves when gradients become ready (the what-if keeps them)
COMPILED_SCRIPT = textwrap.dedent('''
    import argparse
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.proj(nn.functional.gelu(self.fc(self.ln(x))))

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.compile(nn.Sequential(*[Block(256) for _ in range(6)], nn.Linear(256, 256))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(args.steps):
        model(torch.randn(256, 256, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    dist.destroy_process_group()
''')
SCRIPTS = {"wide": WIDE_SCRIPT, "compiled": COMPILED_SCRIPT}  # the models that are scripts, not demos
# what a model cannot be given: a torch.compile'd one no cap under 1 MiB (DDPOptimizer refuses it)
SMALLEST_CAP = {"compiled": 1.0}


def ddpscope(*args: str) -> None:
    cmd = [sys.executable, "-m", "ddpscope.cli", *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ))
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr[-2000:]}")


def trace(model: str, out: Path, cap: float | None, steps: int, work: Path, link: str = "loopback") -> float:
    t0 = time.perf_counter()
    capflag = [] if cap is None else ["--bucket-cap-mb", repr(cap)]
    where = ["--nproc", "2"] if link == "loopback" else ["--emulate-nodes", "2", "--nproc", "1", "--link", link]
    if model in SCRIPTS:
        script = work / f"{model}_train.py"
        ddpscope("run", *where, *capflag, "--out", str(out), "--", str(script), "--steps", str(steps))
    else:
        ddpscope("run", *where, "--demo", model, "--steps", str(steps), *capflag, "--out", str(out))
    return time.perf_counter() - t0


def medians(t) -> tuple[float, float, float]:
    """Step, exposed communication and forward (ms), medians over steps and ranks."""
    from ddpscope.viz.ddp.overlap import compute_step_breakdown

    b = compute_step_breakdown(t)
    return float(b["step_ms"].median()), float(b["exposed_ms"].median()), float(b["forward_ms"].median())


def _kept_runs(kept: Path) -> tuple[list[str], int, tuple[float, ...]]:
    """The models, rounds and caps of a previous run's folder (``--from``)."""
    if not kept.is_dir():
        raise SystemExit(f"--from {kept}: no such folder")
    bases = sorted(kept.glob("*-r*-base"))
    if not bases:
        raise SystemExit(f"--from {kept}: no runs of this benchmark in it (MODEL-rN-base folders)")
    models = list(dict.fromkeys(b.name.split("-r")[0] for b in bases))
    rounds = max(int(b.name.rsplit("-r", 1)[1].split("-")[0]) for b in bases) + 1
    caps = tuple(sorted({float(d.name.rsplit("-", 1)[1]) for d in kept.glob("*-r0-*")
                         if d.is_dir() and not d.name.endswith("-base")}))
    return models, rounds, caps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2, help="rounds of trace + real runs at every cap")
    p.add_argument("--models", help="comma-separated (default gpt,mlp,wide; with --from, every model kept there)")
    p.add_argument("--no-calibrate", action="store_true")
    p.add_argument("--base-cap", type=float, default=None,
                   help="trace the base at this bucket_cap_mb (MiB) instead of the script's own")
    p.add_argument("--link", default="loopback",
                   help="loopback (2 ranks on this machine) or a link rate (1gbit, 200mbit, ...): 2 emulated nodes "
                        "of 1 rank over it (root: network namespaces)")
    p.add_argument("--work", help="the folder to keep the runs in (default: a new temporary one)")
    p.add_argument("--from", dest="again", metavar="DIR",
                   help="predict again from the runs kept in DIR; nothing is traced or run")
    p.add_argument("--smoke", action="store_true", help="the MLP, 2 caps, 4 steps, one round, no calibration")
    args = p.parse_args()
    all_caps = CAPS
    if args.smoke:
        args.steps, args.rounds, args.no_calibrate, all_caps = 4, 1, True, (1.0, 64.0)
        args.models = args.models or "mlp"
    if args.again is not None:
        models, args.rounds, all_caps = _kept_runs(Path(args.again))
        args.models = ",".join(m for m in (args.models or ",".join(models)).split(",") if m in models)
    args.models = args.models or "gpt,mlp,wide"
    from ddpscope.viz.trace import load_run
    from ddpscope.viz.whatif.model import fit_model
    from ddpscope.viz.whatif.simulate import predict_run, traced_cap

    again = args.again is not None
    work = Path(args.again) if again else Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ddpscope-whatif-"))
    work.mkdir(parents=True, exist_ok=True)
    for name, text in SCRIPTS.items():
        if not again:
            (work / f"{name}_train.py").write_text(text)
    summary = []
    for model in args.models.split(","):
        cal, cal_s, notes = None, 0.0, []
        caps = tuple(c for c in all_caps if c >= SMALLEST_CAP.get(model, 0.0))
        rows: dict[object, list[tuple]] = {c: [] for c in ("replay", *caps)}  # (pred, meas, drift) per round
        bare: dict[float, list[float]] = {c: [] for c in caps}  # |step error| % predicted without the calibration
        predict_s = run_s = 0.0
        for rnd in range(args.rounds):
            base = work / f"{model}-r{rnd}-base"
            if not again:  # else traced (and calibrated) before
                trace(model, base, args.base_cap, args.steps, work, args.link)
                if rnd == 0 and not args.no_calibrate:
                    t0 = time.perf_counter()
                    ddpscope("calibrate", str(base))
                    cal_s, cal = time.perf_counter() - t0, base / "calibration.json"
                elif cal is not None:  # the same machine and ranks: measured once
                    shutil.copy(cal, base / "calibration.json")
            t = load_run(base)
            t0 = time.perf_counter()
            m = fit_model(t)
            traced = medians(t)
            preds = {c: medians(predict_run(t, c, m)) for c in caps}
            m_bare = fit_model(t, calibration=None) if (base / "calibration.json").exists() else None
            rows["replay"].append((medians(predict_run(t, traced_cap(t), m)), traced, 1.0))
            predict_s += time.perf_counter() - t0
            notes = list(m.notes)
            for cap in caps:
                out = work / f"{model}-r{rnd}-{cap:g}"
                run_s += 0.0 if again else trace(model, out, cap, args.steps, work, args.link)
                real = medians(load_run(out))
                rows[cap].append((preds[cap], real, real[2] / traced[2]))  # forward: the machine's speed
                if m_bare is not None:
                    bare[cap].append(abs(medians(predict_run(t, cap, m_bare))[0] - real[0]) / real[0] * 100)
        own = traced_cap(t)
        at = "its script's own cap" if own is None else f"bucket_cap_mb={own}"
        print(f"\n== {model} over {args.link}: traced at {at} ({len(t.run['bucket_layout'])} buckets), "
              f"{t.world_size} ranks, {args.steps} steps; {args.rounds} rounds of trace + a real run per cap"
              + (f"; predicted again from the runs kept in {work}" if again else
                 "" if args.no_calibrate else f"; calibrate took {cal_s:.1f} s"), flush=True)
        for note in notes:
            print(f"   model (last round): {note}")
        print(f"{'cap MiB':>8} {'step pred':>9} {'step meas':>9} {'|err| %':>7} {'drift-adj':>9} | "
              f"{'exp pred':>8} {'exp meas':>8} {'|err| ms':>8} {'ok':>4}")
        stats = {}
        for cap, got in rows.items():
            err = [abs(pr[0] - me[0]) / me[0] * 100 for pr, me, _ in got]
            adj = [abs(pr[0] * d - me[0]) / me[0] * 100 for pr, me, d in got]  # predicted x forward ratio
            e_ms = [abs(pr[1] - me[1]) for pr, me, _ in got]
            ok = [abs(pr[1] - me[1]) <= 2.0 or abs(pr[1] - me[1]) <= 0.15 * me[1] for pr, me, _ in got]
            stats[cap] = (statistics.mean(err), statistics.mean(adj), statistics.mean(e_ms), sum(ok), len(ok))
            med = lambda i, j: statistics.median(g[i][j] for g in got)  # noqa: E731
            print(f"{cap if cap == 'replay' else format(cap, 'g'):>8} {med(0, 0):9.1f} {med(1, 0):9.1f} "
                  f"{stats[cap][0]:7.1f} {stats[cap][1]:9.1f} | {med(0, 1):8.1f} {med(1, 1):8.1f} "
                  f"{stats[cap][2]:8.1f} {stats[cap][3]:>2}/{stats[cap][4]}")
        sweep = [stats[c] for c in caps]
        mae, mae_adj = statistics.mean(s[0] for s in sweep), statistics.mean(s[1] for s in sweep)
        ok, n = sum(s[3] for s in sweep), sum(s[4] for s in sweep)
        drift = [abs(d - 1) * 100 for c in caps for _, _, d in rows[c]]
        goal = 10 if args.link == "loopback" else 5
        print(f"replay |error| {stats['replay'][0]:.1f}% (goal <= 5%); step MAE {mae:.1f}% (goal <= {goal}% "
              f"{'on loopback' if goal == 10 else 'in the lab'}), "
              f"{mae_adj:.1f}% with the machine's drift taken out; exposed within 15% or 2 ms: {ok}/{n}, "
              f"MAE {statistics.mean(s[2] for s in sweep):.1f} ms")
        if all(bare.values()):
            print(f"uncalibrated (the same trace and runs, the calibration left out): step MAE "
                  f"{statistics.mean(statistics.mean(v) for v in bare.values()):.1f}% against {mae:.1f}% with it")
        print(f"noise: forward (untouched by the cap) moved {statistics.median(drift):.1f}% (median) between a "
              f"round's trace and its real runs; predicting took {predict_s:.2f} s, the real runs {run_s:.0f} s",
              flush=True)
        summary.append((model, stats["replay"][0], mae, mae_adj, ok, n, statistics.mean(s[2] for s in sweep),
                        statistics.median(drift)))
    print("\nmodel   replay%  stepMAE%  drift-adj%  exposed-ok  exposedMAE(ms)  forward-drift%")
    for model, rep, mae, adj, ok, n, emae, drift in summary:
        print(f"{model:6} {rep:8.1f} {mae:9.1f} {adj:11.1f} {ok:6d}/{n}  {emae:12.1f}  {drift:13.1f}")
    if args.smoke and not again and not args.work:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"(runs kept in {work})")


if __name__ == "__main__":
    main()
