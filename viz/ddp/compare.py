"""Runs side by side, over all their measured steps: medians with 95 % intervals, a
difference inside the step-to-step noise said so, and what differs besides the setting.

A run's one number per quantity is a median over its non-warm-up, finished steps, each
step the numbers of the rank it waited for (``waited_rows``; Compare, the What-if and its
advisor, and the sharded runs' Compare read it). Ranks meet at every collective of a step
(DDP's bucket all-reduces, FSDP2's and DeepSpeed's gathers and reductions), and a
collective ends at one time on every rank, so the rank whose compute ended last is the
one that saw least of it exposed; every other rank's exposed time holds, besides, its
wait for that rank. That rank's row is the step: its compute and exposed communication,
what a setting can change. Pooled over ranks, a straggler's run reads an exposed time
between the fast ranks' and the straggler's that no rank had (a 2-rank GPT run, 30 ms of
sleep in rank 1's forward: 59.04 ms exposed on rank 0, 8.41 on rank 1, 34.50 pooled;
docs/whatif.md). The step's time is the mean over its ranks: a rank's steps add up to
the others' over a run (they meet every step) and differ step to step only by where each
drew a step's boundary; the longest of each step would read the job slower than it ran,
and noisier.

A median's interval, and the interval of a difference between two runs, come from one
bootstrap, the advisor's too (``viz.whatif.advisor.step_noise_ms``): whole steps
resampled with replacement, each run on its own, ``BOOTSTRAP`` times; the 2.5th and
97.5th percentiles. A difference whose interval holds 0 cannot be told apart from noise:
``within_noise``. One step of each run is never the comparison: a single step on a busy
machine can be 3x the median (measured: a rank-0 forward of 30 ms against a median of
8.7 ms).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.ddp.overlap import compute_step_breakdown
from ddpscope.viz.trace import RunTrace

BOOTSTRAP = 2000
COLUMNS = ("step_ms", "exposed_ms", "comm_ms", "backward_ms", "overlap_pct")


def waited_rows(per_rank: pd.DataFrame) -> pd.DataFrame:
    """One row per step of ``per_rank`` (rows per rank and step with ``step_ms`` and
    ``exposed_ms``, ms): the row of the rank with the least exposed communication, the
    one the step waited for (ties, and a step no rank measured: the lowest rank), its
    ``step_ms`` the step's mean over its ranks; sorted by step."""
    if not len(per_rank):
        return per_rank.reset_index(drop=True)
    exposed = per_rank["exposed_ms"].astype(float).fillna(np.inf)
    order = per_rank.assign(_exposed=exposed).sort_values(["step", "_exposed", "rank"], kind="stable")
    out = order.drop_duplicates("step").drop(columns="_exposed").sort_values("step").reset_index(drop=True)
    out["step_ms"] = out["step"].map(per_rank.groupby("step")["step_ms"].mean())
    return out


def compute_waited_steps(trace: RunTrace) -> pd.DataFrame:
    """Per non-warm-up, finished step of a DDP run, one ``compute_step_breakdown`` row:
    the rank the step waited for, its ``step_ms`` the step's mean over ranks
    (``waited_rows``). A bucket's all-reduce ends at one time on every rank, so every
    other rank's exposed time holds its wait for that rank (``viz.ddp.stragglers``'s wait
    caused)."""
    return waited_rows(compute_step_breakdown(trace))


def _by_step(breakdown: pd.DataFrame, column: str) -> np.ndarray:
    """(steps, ranks) matrix of ``column``, NaN where a rank lacks a step."""
    if not len(breakdown):
        return np.empty((0, 0))
    wide = breakdown.pivot_table(index="step", columns="rank", values=column, aggfunc="first")
    return wide.to_numpy(float)


def _boot_medians(m: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """``BOOTSTRAP`` medians of ``m``'s values, its rows (steps) resampled."""
    if m.shape[0] < 2 or np.isnan(m).all():
        return np.full(BOOTSTRAP, np.nan)
    picks = rng.integers(0, m.shape[0], size=(BOOTSTRAP, m.shape[0]))
    return np.nanmedian(m[picks].reshape(BOOTSTRAP, -1), axis=1)


def median_interval(breakdown: pd.DataFrame, column: str = "step_ms", seed: int = 0) -> tuple[float, float, float]:
    """(median, 2.5 %, 97.5 %) of ``column`` over a breakdown's steps (and its ranks, where
    it holds several a step); the
    interval NaN with fewer than 2 steps."""
    m = _by_step(breakdown, column)
    if not m.size or np.isnan(m).all():
        return (np.nan, np.nan, np.nan)
    boot = _boot_medians(m, np.random.default_rng(seed))
    lo, hi = (np.nan, np.nan) if np.isnan(boot).all() else np.percentile(boot, [2.5, 97.5])
    return float(np.nanmedian(m)), float(lo), float(hi)


def difference_interval(a: pd.DataFrame, b: pd.DataFrame, column: str = "step_ms", seed: int = 0
                        ) -> tuple[float, float, float]:
    """(median of ``b`` - median of ``a``, 2.5 %, 97.5 %): each run's steps resampled on
    their own (the runs are independent)."""
    ma, mb = _by_step(a, column), _by_step(b, column)
    if not ma.size or not mb.size or np.isnan(ma).all() or np.isnan(mb).all():
        return (np.nan, np.nan, np.nan)
    rng = np.random.default_rng(seed)
    boot = _boot_medians(mb, rng) - _boot_medians(ma, rng)
    lo, hi = (np.nan, np.nan) if np.isnan(boot).all() else np.percentile(boot, [2.5, 97.5])
    return float(np.nanmedian(mb) - np.nanmedian(ma)), float(lo), float(hi)


def within_noise(lo: float, hi: float) -> bool | None:
    """Whether an interval of a difference holds 0 (None: no interval, too few steps)."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return None
    return bool(lo <= 0.0 <= hi)


def layout_text(t: RunTrace) -> str:
    """A run's bucket layout in a few words: buckets, and its first bucket's cap."""
    run = t.run
    n = len(run.get("bucket_layout") or [])
    first = run.get("first_bucket_cap_bytes")
    return f"{n} bucket{'s' if n != 1 else ''}" + (f", first bucket ≤ {first / 2**20:g} MiB"
                                                    if isinstance(first, (int, float)) and n > 1 else "")


def conditions_text(t: RunTrace) -> str | None:
    """The conditions rank 0 ran under (run.json ``conditions``: torch threads, cores it
    could use, nice value) in a few words; None for runs that predate them."""
    c = t.run.get("conditions")
    if not isinstance(c, dict):
        return None
    try:
        threads, cores, nice = int(c["torch_threads"]), int(c["cores_allowed"]), int(c["nice"])
    except (KeyError, TypeError, ValueError):
        return None
    return (f"{threads} torch thread{'s' if threads != 1 else ''} a rank, {cores} core{'s' if cores != 1 else ''} "
            f"allowed, nice {nice}")


def same_job(a: RunTrace, b: RunTrace) -> bool:
    """Whether two runs train the same model the same way (world size, parameters, script
    or demo): then their difference is the setting's."""
    def key(r: dict) -> tuple:
        script = r.get("script") if isinstance(r.get("script"), dict) else {}
        demo = r.get("demo") or (r.get("model") if not script else None)  # older demo runs name only the model
        what = ("demo", demo) if demo else ("script", script.get("path"))
        return (r.get("world_size"), tuple(r.get("param_bytes") or ()), what)

    return key(a.run) == key(b.run)


#: run.json's settings a bucket-cap prediction holds fixed: a run of the same job that differs
#: in one ran another setting, not another cap of this one (``find_unused_parameters=True``:
#: DDP never rebuilds its buckets and all-reduces its unused-parameter map every step)
HELD_SETTINGS = ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "comm_hook", "backend", "device")


def settings_apart(a: RunTrace, b: RunTrace) -> str:
    """The settings of ``HELD_SETTINGS`` in which ``b`` differs from ``a``, as ``b`` ran them
    (``"find_unused_parameters=False"``); "" when none. A setting one of them did not record
    (an older trace) is not told apart."""
    apart = [f"{k}={b.run[k]}" for k in HELD_SETTINGS
             if k in a.run and k in b.run and a.run[k] != b.run[k]]
    return ", ".join(apart)


def compute_run_comparison(traces: dict[str, RunTrace]) -> pd.DataFrame:
    """One row per run: bucket cap, buckets, steps compared, and the medians over
    non-warm-up steps (each step its waited-for rank's, ``compute_waited_steps``) of step
    time (with its 95 % interval, ``step_ms_lo``/``_hi``), communication, exposed
    communication (ms) and overlap %; against the first run: the step and exposed
    differences (ms), the step difference's interval and whether it is ``within_noise``,
    whether it is the ``same_job``, the ``settings`` besides the cap it ran apart from
    the first (``settings_apart``), its ``layout`` and the ``conditions`` its ranks ran
    under (``conditions_text``)."""
    rows = []
    items = list(traces.items())
    first = compute_waited_steps(items[0][1]) if items else None
    for k, (name, t) in enumerate(items):
        b = compute_waited_steps(t) if k else first
        med, lo, hi = median_interval(b)
        row = {"run": name, "bucket_cap_mb": t.run.get("bucket_cap_mb"),
               "buckets": len(t.run.get("bucket_layout") or []), "steps": int(b["step"].nunique()) if len(b) else 0,
               "step_ms": med, "step_ms_lo": lo, "step_ms_hi": hi,
               **{c: float(b[c].median()) if len(b) else np.nan for c in COLUMNS if c != "step_ms"}}
        d, dlo, dhi = difference_interval(first, b) if k else (0.0, np.nan, np.nan)
        row.update(step_ms_vs_first=d, step_ms_vs_first_lo=dlo, step_ms_vs_first_hi=dhi,
                   within_noise=within_noise(dlo, dhi) if k else None,
                   exposed_ms_vs_first=row["exposed_ms"] - (float(first["exposed_ms"].median()) if len(first)
                                                            else np.nan),
                   same_job=same_job(items[0][1], t), settings=settings_apart(items[0][1], t),
                   layout=layout_text(t), conditions=conditions_text(t))
        rows.append(row)
    return pd.DataFrame(rows)


def differences_text(table: pd.DataFrame) -> list[str]:
    """What a reader must know before reading the differences: runs that are not the same
    job as the first, other settings than the cap, layouts that differ, differences inside
    the noise."""
    if len(table) < 2:
        return []
    ref = table.iloc[0]
    out = []
    for r in table.iloc[1:].itertuples():
        if not r.same_job:
            out.append(f"{r.run} is not the same job as {ref['run']} (another model, script or world size): its "
                       "difference is not a setting's effect")
        if r.settings:
            out.append(f"{r.run} ran other settings than {ref['run']} besides the bucket cap: {r.settings}")
        if r.layout != ref["layout"]:
            out.append(f"{r.run}'s buckets differ from {ref['run']}'s: {ref['layout']} → {r.layout}")
        known = isinstance(r.conditions, str) and isinstance(ref["conditions"], str)  # NaN: a run predating them
        if known and r.conditions != ref["conditions"]:
            out.append(f"{r.run} ran under other conditions than {ref['run']}: {ref['conditions']} → "
                       f"{r.conditions}; part of its difference is theirs, not the setting's")
        if r.within_noise:
            out.append(f"{r.run}: {r.step_ms_vs_first:+.1f} ms a step, inside the noise (95 % interval "
                       f"{r.step_ms_vs_first_lo:+.1f}..{r.step_ms_vs_first_hi:+.1f} ms): not a difference these runs "
                       "can show")
        elif r.within_noise is None:
            out.append(f"{r.run}: too few steps for an interval; its difference may be noise")
    return out


def median_step(trace: RunTrace) -> int | None:
    """The run's representative step: the non-warm-up, finished step whose time (its
    slowest rank's, what the job waited for) is the median one; None if there is none."""
    b = compute_step_breakdown(trace)
    if not len(b):
        return None
    per_step = b.groupby("step")["step_ms"].max().sort_values(kind="stable")
    return int(per_step.index[(len(per_step) - 1) // 2])
