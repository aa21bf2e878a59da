"""Many caps from one trace: predicted step time and exposed communication per cap, the
recommended cap, and the measured runs of the same script placed on the same axes."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.ddp.compare import compute_waited_steps
from ddpscope.viz.trace import RunTrace
from ddpscope.viz.whatif.layout import cap_label, compile_note, is_cap_list, runnable
from ddpscope.viz.whatif.model import WhatIfModel, fit_model
from ddpscope.viz.whatif.simulate import predict_run, traced_cap

DEFAULT_CAPS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 25.0, 32.0, 64.0, 128.0, 256.0)
#: a cap must beat the traced one by this much (fraction of step time) to be recommended
MIN_GAIN = 0.02


class _Shared(list):
    """The sweep's predicted runs in ``df.attrs``, shared and not copied: pandas deep-copies
    a frame's ``attrs`` into every frame derived from it (a column, a rounded copy), and a
    copy of every predicted run's tables each time cost the dashboard's What-if page and
    ``whatif`` most of a second. They are read, never changed."""

    def __deepcopy__(self, memo) -> "_Shared":
        return self


def _medians(trace: RunTrace) -> dict:
    """Medians over the run's steps, each step its waited-for rank's numbers
    (``compute_waited_steps``): step, backward, communication, exposed (ms), overlap %."""
    b = compute_waited_steps(trace)
    return {k: float(b[k].median()) if len(b) else np.nan
            for k in ("step_ms", "backward_ms", "comm_ms", "exposed_ms", "overlap_pct")}


def compute_cap_sweep(trace: RunTrace, caps=DEFAULT_CAPS, model: WhatIfModel | None = None,
                      fitted: WhatIfModel | None = None, lists=()) -> pd.DataFrame:
    """One row per cap (MiB), and per ``bucket_cap_mb_list`` in ``lists`` (its
    ``bucket_cap_mb`` column the largest limit, ``bucket_cap_mb_list`` the list as text,
    None for a uniform cap): buckets, first bucket's cap (MiB), and the predicted medians
    over steps (each step its waited-for rank's: ``compute_waited_steps``) of step,
    backward compute, communication and exposed communication (ms), overlap %; ``traced``
    marks the trace's own setting, replayed
    (added when not among ``caps``; DDP's default, 25 MiB with a 1 MiB first bucket, is a
    row of its own beside an explicit 25). ``df.attrs``: ``predictions`` (RunTrace per
    row) and ``model``. Caps must be > 0; those the model cannot be given are left out
    (``layout.runnable``: a torch.compile'd model takes none under 1 MiB), and
    ``df.attrs["note"]`` says so. ``fitted``: see ``predict_run``."""
    model = model or fit_model(trace)
    own = traced_cap(trace)
    label = float(trace.run.get("bucket_cap_mb") or 25.0) if own is None or is_cap_list(own) else own
    settings = {(float(c), float(c)) for c in caps} | {(label, own)}
    settings |= {(max(map(float, c)), tuple(map(float, c))) for c in lists}
    settings = {s for s in settings if s[1] == own or runnable(trace.run, s[1])}  # torch.compile: >= 1 MiB
    rows, preds = [], []
    for shown, cap in sorted(settings, key=lambda s: (s[0], s[1] is not None, is_cap_list(s[1]), str(s[1]))):
        pred = predict_run(trace, cap, model, fitted)
        preds.append(pred)
        rows.append({"bucket_cap_mb": shown, "bucket_cap_mb_list": cap_label(cap) if is_cap_list(cap) else None,
                     "buckets": len(pred.run["bucket_layout"]),
                     "first_bucket_mb": pred.run["first_bucket_cap_bytes"] / 2**20, **_medians(pred),
                     "traced": cap == own})
    df = pd.DataFrame(rows)
    df.attrs["predictions"] = _Shared(preds)
    df.attrs["model"] = model
    df.attrs["note"] = compile_note(trace.run)
    return df


def recommend_cap(sweep: pd.DataFrame) -> dict:
    """The cap with the lowest predicted step time, with its gain over the traced cap
    (ms and %). When no cap beats the traced one by ``MIN_GAIN``, the traced cap stays."""
    best = sweep.loc[sweep["step_ms"].idxmin()]
    base = sweep[sweep["traced"]]
    base_ms = float(base["step_ms"].iloc[0]) if len(base) else float("nan")
    gain = base_ms - float(best["step_ms"])
    if len(base) and gain < MIN_GAIN * base_ms:
        best = base.iloc[0]
        gain = 0.0
    return {"bucket_cap_mb": float(best["bucket_cap_mb"]),
            "bucket_cap_mb_list": best.get("bucket_cap_mb_list") if pd.notna(best.get("bucket_cap_mb_list")) else None,
            "step_ms": float(best["step_ms"]),
            "exposed_ms": float(best["exposed_ms"]), "traced_step_ms": base_ms, "gain_ms": gain,
            "gain_pct": 100.0 * gain / base_ms if base_ms > 0 else float("nan")}


#: what ``compute_replay_check`` sets side by side
CHECKED = ("step_ms", "exposed_ms", "comm_ms", "backward_ms")


def compute_replay_check(trace: RunTrace, sweep: pd.DataFrame) -> pd.DataFrame:
    """The run's own setting, replayed (the sweep's ``traced`` row) against what the run
    measured, medians over steps of the rank each waited for (ms): per quantity (index: step_ms,
    exposed_ms, comm_ms, backward_ms) ``replayed``, ``measured`` (as the advisor's
    measured step) and ``miss`` (replayed - measured). The miss is the model's at the
    setting it knows best, and it is in every other row of the sweep too: a row is read
    against the traced row, not against the measurement (on 2 shared CPU cores the
    replay reads exposed communication low: docs/whatif.md). Empty where the sweep has
    no traced row."""
    own = sweep[sweep["traced"]] if "traced" in sweep else sweep.iloc[0:0]
    if not len(own):
        return pd.DataFrame(columns=["replayed", "measured", "miss"], dtype=float)
    measured = _medians(trace)
    rows = {k: {"replayed": float(own[k].iloc[0]), "measured": measured[k]} for k in CHECKED}
    df = pd.DataFrame.from_dict(rows, orient="index")
    df["miss"] = df["replayed"] - df["measured"]
    return df


def replay_check_text(check: pd.DataFrame) -> str:
    """``compute_replay_check`` in one sentence (the CLI's line, the What-if page's caption)."""
    if not len(check):
        return ""
    step, ex = check.loc["step_ms"], check.loc["exposed_ms"]
    return (f"at its own setting the replay reads {step['replayed']:.1f} ms a step and {ex['replayed']:.1f} ms "
            f"exposed where this run measured {step['measured']:.1f} and {ex['measured']:.1f} ms (medians over "
            f"steps, each step the rank it waited for): the model's miss there ({step['miss']:+.1f} and "
            f"{ex['miss']:+.1f} ms) is in every row, so read a setting against the traced row")


def measured_setting(trace: RunTrace) -> str:
    """The bucket setting a measured run ran with, as its point on the axes says it: DDP's
    default and an explicit 25 MiB both sit at 25 and are other layouts (a 1 MiB first
    bucket or not); "" where run.json does not say."""
    cap = traced_cap(trace)
    if is_cap_list(cap):
        return f"bucket_cap_mb_list={cap_label(cap)}"
    if cap is None:
        return "DDP's default (25 MiB, first bucket 1)" if trace.run.get("bucket_cap_default") else ""
    return f"{float(cap):g} MiB"


def compute_measured_points(traces: dict[str, RunTrace]) -> pd.DataFrame:
    """Measured runs as points for the sweep's axes: run, bucket_cap_mb, the setting
    (``measured_setting``) and medians (ms)."""
    rows = [{"run": name, "bucket_cap_mb": t.run.get("bucket_cap_mb"), "setting": measured_setting(t), **_medians(t)}
            for name, t in traces.items()]
    return pd.DataFrame(rows, columns=["run", "bucket_cap_mb", "setting", "step_ms", "backward_ms", "comm_ms",
                                       "exposed_ms", "overlap_pct"])
