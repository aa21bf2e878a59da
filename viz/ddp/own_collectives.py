"""The collectives of a DDP step that are not buckets: DDP's all-reduce of its
unused-parameter map (``find_unused_parameters``), its broadcast of the module's buffers
(BatchNorm's statistics), and the others DDP or the script issued in the step (a loss
averaged for logging, join's flags, the all-reduce of ``delay_all_reduce_named_params``).
None of them is in the buckets' figures or the what-if's cost fit; here they are on
their own, from the steps table (a summary-first trace has them too)."""

from __future__ import annotations

import pandas as pd

from ddpscope.viz.trace import RunTrace

#: kind -> (the steps table's field prefix, what it is, in words)
KINDS = {"unused_map": ("ddp_own", "DDP's unused-parameter map"),
         "buffer_broadcast": ("buffer_sync", "DDP's buffer broadcast"),
         "other": ("other_comm", "other collectives (the script's own, DDP's outside its buckets)")}
COLUMNS = ["kind", "what", "steps", "per_step", "ms", "bytes", "pct_of_step"]


def compute_own_collectives(trace: RunTrace) -> pd.DataFrame:
    """One row per kind the run issued (non-warm-up steps where there are any; medians
    over the steps and ranks that had it): ``steps`` (rank-steps with it), ``per_step``
    (collectives a step; 1 for DDP's own), ``ms`` (from the first's start to the last's
    end, host clock), ``bytes`` (summed in the step), ``pct_of_step`` (``ms`` against
    that step's length)."""
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
        rows.append({"kind": kind, "what": what, "steps": len(have), "per_step": float(count.median()),
                     "ms": float(ms.median()), "bytes": float(have[f"{prefix}_bytes"].median()),
                     "pct_of_step": float((100.0 * ms / step_ms).median())})
    return pd.DataFrame(rows, columns=COLUMNS)


def own_collectives_lines(table: pd.DataFrame) -> list[str]:
    """A line per kind of ``compute_own_collectives``'s table."""
    return [f"{r['what']}: {r['per_step']:g} a step, {r['ms']:.2f} ms ({r['pct_of_step']:.1f} % of the step), "
            f"{r['bytes']:.0f} bytes (medians; not buckets)" for _, r in table.iterrows()]
