"""The collectives of a DDP step that are not buckets: DDP's all-reduce of its
unused-parameter map (``find_unused_parameters``), its broadcast of the module's buffers
(BatchNorm's statistics), and the others DDP or the script issued in the step (a loss
averaged for logging, join's flags, the all-reduce of ``delay_all_reduce_named_params``).
None of them is in the buckets' figures or the what-if's cost fit; here they are on
their own, from the steps table (a summary-first trace has them too)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.trace import RunTrace

#: kind -> (the steps table's field prefix, what it is, in words)
KINDS = {"unused_map": ("ddp_own", "DDP's unused-parameter map"),
         "buffer_broadcast": ("buffer_sync", "DDP's buffer broadcast"),
         "other": ("other_comm", "other collectives (the script's own, DDP's outside its buckets)")}
COLUMNS = ["kind", "what", "steps", "per_step", "ms", "bytes", "pct_of_step", "beside_buckets_ms"]


def compute_own_collectives(trace: RunTrace) -> pd.DataFrame:
    """One row per kind the run issued (non-warm-up steps where there are any; medians
    over the steps and ranks that had it): ``steps`` (rank-steps with it), ``per_step``
    (collectives a step; 1 for DDP's own), ``ms`` (from the first's start to the last's
    end, host clock), ``bytes`` (summed in the step), ``pct_of_step`` (``ms`` against
    that step's length), ``beside_buckets_ms`` (the part of ``ms`` between the step's
    first bucket launch and its last bucket's end: DDP's unused-parameter map is launched
    after the last bucket on the same process group and runs behind them, so its span is
    mostly their time, not its own)."""
    s = trace.steps
    if len(s) and "warmup" in s and (~s["warmup"].astype(bool)).any():
        s = s[~s["warmup"].astype(bool)]
    rows = []
    for kind, (prefix, what) in KINDS.items():
        start, end = f"{prefix}_start_us", f"{prefix}_end_us"
        if start not in s:
            continue
        have = s.dropna(subset=[start, end])
        if not len(have):
            continue
        ms = (have[end] - have[start]) / 1e3
        step_ms = (have["end_us"] - have["start_us"]) / 1e3
        count = have["other_comm_count"] if kind == "other" else pd.Series(1, index=have.index)
        beside = _beside_buckets_ms(have, start, end)
        rows.append({"kind": kind, "what": what, "steps": len(have), "per_step": float(count.median()),
                     "ms": float(ms.median()), "bytes": float(have[f"{prefix}_bytes"].median()),
                     "pct_of_step": float((100.0 * ms / step_ms).median()),
                     "beside_buckets_ms": float(beside.median())})
    return pd.DataFrame(rows, columns=COLUMNS)


def _beside_buckets_ms(steps: pd.DataFrame, start: str, end: str) -> pd.Series:
    """Per step: ms of ``[start, end]`` inside ``[first_launch_us, last_done_us]`` (0 where
    the step had no bucket)."""
    if "first_launch_us" not in steps or "last_done_us" not in steps:
        return pd.Series(0.0, index=steps.index)
    lo = np.maximum(steps[start].to_numpy(float), steps["first_launch_us"].to_numpy(float))
    hi = np.minimum(steps[end].to_numpy(float), steps["last_done_us"].to_numpy(float))
    return pd.Series(np.nan_to_num(np.clip(hi - lo, 0.0, None), nan=0.0) / 1e3, index=steps.index)


def own_collectives_lines(table: pd.DataFrame) -> list[str]:
    """A line per kind of ``compute_own_collectives``'s table; where at least half of a
    kind's time ran beside the buckets, it says so (that time is theirs as much as its own)."""
    lines = []
    for _, r in table.iterrows():
        beside = r.get("beside_buckets_ms", 0.0)
        queued = (f"; {beside:.2f} ms of it inside the buckets' all-reduces (first launch to last end), queued "
                  "behind them") if beside == beside and r["ms"] > 0 and beside >= 0.5 * r["ms"] else ""
        lines.append(f"{r['what']}: {r['per_step']:g} a step, {r['ms']:.2f} ms ({r['pct_of_step']:.1f} % of the "
                     f"step), {r['bytes']:.0f} bytes (medians; not buckets){queued}")
    return lines
