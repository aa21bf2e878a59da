"""``ddpscope whatif RUN``'s report: the predicted table per cap, the advisor's search and
its recommendation (text or ``--json``), and after ``--apply`` the A/B report of the
traced run against its rerun."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pandas as pd

from ddpscope.tracer.format import RUN_FILE
from ddpscope.viz.trace import RunTrace, TraceError, load_run
from ddpscope.viz.whatif.advisor import SIMPLER, Advice, advise, flag_off_text, mark_within_noise, setting_text
from ddpscope.viz.whatif.layout import cap_label, is_cap_list
from ddpscope.viz.whatif.model import nodes

_SWEEP_COLS = ["bucket_cap_mb", "bucket_cap_mb_list", "first_bucket_mb", "buckets", "step_ms", "exposed_ms",
               "comm_ms", "backward_ms", "overlap_pct", "traced", "within_noise"]


def regime(trace: RunTrace) -> str:
    """Which regime the run was in, in a sentence: what bounds its communication, and
    whether communication competes with compute for the cores."""
    run = trace.run
    emu = run.get("emulation") if isinstance(run.get("emulation"), dict) else None
    device = str(run.get("device") or "cpu")
    cores = ("gloo's threads share the CPU cores with autograd, so overlapping communication costs compute"
             if device == "cpu" else "NCCL runs beside the compute on its own stream")
    if emu:
        where = f"{emu.get('nodes')} emulated nodes, each over a {emu.get('link')} link (bandwidth-bound)"
    elif nodes(run) > 1:
        where = f"{run.get('nnodes')} nodes: all-reduces cross the network"
    else:
        where = "one machine (loopback): communication is nearly free and bucket sizes matter little"
    return f"Regime: {where}; {cores}."


def _safe(v):
    """NaN as null: JSON has no NaN."""
    if isinstance(v, dict):
        return {k: _safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_safe(x) for x in v]
    return None if isinstance(v, float) and math.isnan(v) else v


def whatif_report(path: str, caps: str | None, as_json: bool, cap_list: str | None = None
                  ) -> tuple[int, tuple[RunTrace, Advice] | None]:
    """Print the report; returns (exit code, (trace, advice)). ``TraceError`` or
    ``ValueError`` (one line, naming the flag) on bad input."""
    from ddpscope.tracer.options import WHATIF_CAP_LIST, mib_list, parse_caps
    from ddpscope.viz.sources import KINETO, folder_kind
    from ddpscope.viz.whatif.cost import read_calibration
    from ddpscope.viz.whatif.sweep import DEFAULT_CAPS, compute_cap_sweep, compute_replay_check, replay_check_text

    wanted = parse_caps(caps) if caps is not None else list(DEFAULT_CAPS)
    if cap_list is not None:
        WHATIF_CAP_LIST.validate(cap_list)  # ValueError naming --cap-list
    lists = [mib_list(cap_list)] if cap_list is not None else []
    kind = folder_kind(path)
    if kind == KINETO:
        raise TraceError(f"{path} holds profiler traces; what-if needs a ddpscope trace (gradient ready times): "
                         "trace the job with `ddpscope run`")
    if kind == "sharded":  # `ddpscope whatif` predicts these with their own settings (cli/sharded_whatif.py)
        raise TraceError(f"{path} is a sharded ({_framework(path) or 'FSDP2'}) run; bucket_cap_mb's what-if needs a "
                         "DDP training run")
    if kind not in (None, "ddp"):
        raise TraceError(f"{path} is a {kind} run; what-if needs a DDP training run")
    trace = load_run(path)
    sweep = compute_cap_sweep(trace, wanted, lists=lists)
    model = sweep.attrs["model"]
    advice = advise(trace, model, caps=wanted, lists=lists)
    sweep = mark_within_noise(sweep, advice.noise_ms)
    check = compute_replay_check(trace, sweep)
    if as_json:
        top = advice.candidates.head(10)
        print(json.dumps(_safe({"path": str(trace.path), "world_size": trace.world_size,
                                "traced_bucket_cap_mb": trace.run.get("bucket_cap_mb"),
                                "caps": sweep[_SWEEP_COLS].astype(object).to_dict("records"),
                                "recommended": advice.as_json(),
                                "replay_check": {k: {c: float(v) for c, v in row.items()}
                                                 for k, row in check.iterrows()},
                                "candidates": [{"kind": r.kind, "setting": r.label, "buckets": int(r.buckets),
                                                "step_ms": float(r.step_ms), "within_noise": bool(r.within_noise)}
                                               for r in top.itertuples()],
                                "all_reduce_cost": {"latency_us": model.cost.fixed_us,
                                                    "bandwidth_gbps": model.cost.applied_gbps,
                                                    "latency_fitted": model.cost.latency_fitted,
                                                    "calibrated": model.cost.calibrated,
                                                    "source": model.cost.source},
                                "model_notes": list(model.notes),
                                "notes": [n for n in (sweep.attrs.get("note"),) if n]}), indent=1, default=float))
        return 0, (trace, advice)
    print(f"{trace.path}  ranks={trace.world_size}  traced at {setting_text(advice.traced)}  "
          "(predicted medians over steps, each step the rank it waited for, ms)")
    print(regime(trace))
    print(sweep[_SWEEP_COLS].round(2).fillna({"bucket_cap_mb_list": "-"}).to_string(index=False))
    if math.isfinite(advice.noise_ms):
        print(f"  within_noise: the step cannot be told from the fastest's, {advice.noise_ms:.1f} ms (this run's "
              "step-to-step noise, two medians)")
    if len(check):
        print(f"  measured: {replay_check_text(check)}")
    for note in model.notes:
        print(f"  model: {note}")
    if sweep.attrs.get("note"):
        print(f"  note: {sweep.attrs['note']}")
    if read_calibration(trace.path) is None:
        print(f"  hint: `ddpscope calibrate {path}` measures all-reduce times and contention on these ranks; "
              "without it they are fitted to this trace's buckets alone")
    print_advice(advice)
    return 0, (trace, advice)


def print_advice(advice: Advice) -> None:
    n = advice.searched
    order = "in gradient-ready order" if advice.note is None else "in registration order"
    print(f"advisor: searched {searched_text(n)} (local search), {order}; best found "
          f"{setting_text(advice.best)}")
    if advice.note:
        print(f"  note: {advice.note}")
    if advice.flag_off is not None:
        print(f"  flag: {flag_off_text(advice)}")
    cands = advice.candidates
    chosen = setting_text(advice.best)
    shown = cands.head(5)
    if chosen not in set(shown["label"]):
        shown = pd.concat([shown, cands[cands["label"] == chosen]])
    for r in shown.itertuples():
        mark = "  <- best found (the simplest within {:.1f} % of the fastest)".format(100 * SIMPLER) \
            if r.label == chosen else ""
        mark += "  (within the noise of the fastest)" if r.within_noise and advice.change else ""
        print(f"  {r.step_ms:9.2f} ms  {r.buckets:3d} {'bucket ' if r.buckets == 1 else 'buckets'}  {r.kind:15s} {r.label}{mark}")
    lo, hi = advice.interval_ms
    noise = f"95 % interval {lo:.1f}..{hi:.1f} ms from this run's step-to-step noise" if math.isfinite(lo) else \
        "too few steps to measure the noise"
    if advice.change:
        print(f"recommended: {setting_text(advice.setting)}  predicted step {advice.step_ms:.1f} ms against "
              f"{advice.traced_step_ms:.1f} ms at the traced setting (measured {advice.measured_step_ms:.1f}): "
              f"{advice.gain_ms:.1f} ms ({advice.gain_pct:.1f} %) faster, {noise}")
        if advice.in_code:
            print(f"  {advice.in_code}")
    else:
        print(f"recommended: keep {setting_text(advice.traced)}: {advice.why}")


def print_ab(a: RunTrace, advice: Advice, b_path: str | Path) -> None:
    """After ``--apply``: predicted against measured, and bucket by bucket, A beside B."""
    from ddpscope.viz.ddp.compare import conditions_text, layout_text
    from ddpscope.viz.whatif.ab import compute_ab_steps, compute_bucket_ab
    from ddpscope.viz.whatif.simulate import predict_run, traced_cap

    b = load_run(b_path)
    pred = advice.prediction
    if traced_cap(b) != advice.setting:  # the script overrode it after all: predict what ran
        pred = predict_run(a, traced_cap(b))
    print(f"\nA = {a.path} ({setting_text(advice.traced)}), B = {b.path} ({setting_text(traced_cap(b))})")
    if b.run.get("status") != "complete":
        print(f"B is {b.run.get('status')}: the comparison is of what it finished")
    steps = compute_ab_steps(a, pred, b)
    print(steps.round(2).to_string(index=False))
    print("bucket by bucket (medians over steps and ranks; ms from the rank's backward start):")
    print(compute_bucket_ab(a, b).round(2).to_string(index=False, na_rep="-"))
    row = steps.set_index("median").loc["step_ms"]
    gained = row["A measured"] - row["B measured"]
    lo, hi = advice.interval_ms
    inside = "inside" if lo <= gained <= hi else "outside"
    mlo, mhi = -row["B - A hi"], -row["B - A lo"]  # of A - B: the gain
    measured = (f"95 % interval {mlo:.1f}..{mhi:.1f} ms over every step" + (", inside the noise: not a difference "
                "these runs can show" if row["within noise"] else "")) if math.isfinite(mlo) else "too few steps " \
        "for an interval"
    print(f"measured: B {gained:.1f} ms a step {'faster' if gained >= 0 else 'slower'} than A "
          f"({100 * gained / row['A measured']:.1f} %; {measured}); predicted {advice.gain_ms:.1f} ms, {inside} the "
          f"interval {lo:.1f}..{hi:.1f} ms")
    if layout_text(a) != layout_text(b):
        print(f"layouts: A {layout_text(a)}, B {layout_text(b)}")
    ca, cb = conditions_text(a), conditions_text(b)
    if ca and cb and ca != cb:
        print(f"conditions differ (part of the difference is theirs): A {ca}, B {cb}")
    print(f"the diff timeline: `ddpscope dashboard {Path(b.path).parent}`, open B, What-if tab")


def cap_argument(cap) -> dict:
    """``RunConfig`` keyword for a setting: ``bucket_cap_mb`` or ``bucket_cap_mb_list``."""
    if is_cap_list(cap):
        return {"bucket_cap_mb_list": cap_label(cap)}
    return {"bucket_cap_mb": float(cap)}


def _framework(path) -> str | None:
    """A sharded run's framework (``fsdp2``, ``deepspeed``) from its run.json, or None."""
    try:
        with open(os.path.join(path, RUN_FILE)) as f:
            sharding = json.load(f).get("sharding")
    except (OSError, ValueError, AttributeError):
        return None
    return sharding.get("framework") if isinstance(sharding, dict) else None


def searched_text(searched: dict[str, int]) -> str:
    """``Advice.searched`` in words: "12 uniform caps, 40 growing lists and 1 per-bucket layout"."""
    said = [f"{searched[k]} {word}{'' if searched[k] == 1 else 's'}" for k, word in
            (("uniform", "uniform cap"), ("growing list", "growing list"), ("per-bucket list", "per-bucket layout"))]
    return f"{', '.join(said[:-1])} and {said[-1]}"
