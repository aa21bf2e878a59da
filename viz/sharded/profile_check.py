"""A sharded run's collectives checked against torch.profiler on the same run
(``ddpscope run --profile``).

Both record every collective of the profiled steps: the tracer each FSDP2 unit's
all-gather and reduce-scatter (and HSDP's all-reduce), from an event before the call to
the collective's end; the profiler the collective's span: on NCCL its kernel, on gloo
its span on gloo's worker thread (``gloo:all_gather``; gloo has no reduce-scatter, so a
reduce-scatter runs, and is profiled, as an all-reduce: ``sent_as``). Profile times go
onto the trace's clock as DDP's check puts them (``viz.sources.run_profile``).

Within a rank and profiled step, the k-th collective of a kind (in start order) is
matched to the tracer's k-th of that kind. The profiler's bytes are the collective's
input (Kineto's ``In msg nelems``): an all-gather's input is the rank's shard, the
gathered bytes over the unit's shard group; a reduce-scatter's, and an all-reduce's,
the whole.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sources.kineto import collective_kind
from ddpscope.viz.sources.run_profile import on_trace_clock, profiled_steps
from ddpscope.viz.trace import RunTrace

COLUMNS = ["rank", "step", "collective", "index", "unit", "name", "tracer_bytes", "expected_profile_bytes",
           "profile_bytes", "start_us", "end_us", "profile_start_us", "profile_end_us", "start_after_ms",
           "end_before_ms"]


def compute_sharded_profile_agreement(trace: RunTrace, profile: RunTrace) -> pd.DataFrame:
    """One row per rank, profiled step and collective (``COLUMNS``): the tracer's unit,
    bytes, start and end, the profiler's bytes, start and end (µs, the trace's clock),
    the bytes the profiler should show (``expected_profile_bytes``), ``start_after_ms``
    (from the tracer's start to the collective running: queueing) and ``end_before_ms``
    (from the collective's end to the tracer's). Unmatched rows keep NaN on the side
    that is missing. Empty for a run that is not sharded or not profiled."""
    if trace.shards is None:
        return pd.DataFrame(columns=COLUMNS)
    colls, units = trace.shards.colls, trace.shards.units.set_index("unit")
    kinds = [collective_kind(s if isinstance(s, str) and s else c) for s, c in zip(colls["sent_as"], colls["collective"])]
    colls = colls.assign(kind=kinds)
    k = profile.kernels
    comm = k[(k["kind"] == "comm") & (k["step"] >= 0) & (k["collective"] != "")]
    rows = []
    for rank, meta in sorted(trace.ranks.items()):
        host = on_trace_clock(meta, profile.ranks.get(rank))
        if host is None:
            continue
        mine = comm[comm["rank"] == rank]
        raw = mine["ts_raw"].to_numpy(float)
        pr = pd.DataFrame({"step": mine["step"].to_numpy(), "kind": mine["collective"].to_numpy(),
                           "start": host(raw), "end": host(raw + mine["dur_raw"].to_numpy(float)),
                           "bytes": mine["bytes"].to_numpy(float)})
        steps = profiled_steps(meta)
        ours = dict(list(colls[(colls["rank"] == rank) & colls["step"].isin(steps)].groupby(["step", "kind"])))
        theirs = dict(list(pr[pr["step"].isin(steps)].groupby(["step", "kind"])))
        for step, kind in sorted(ours.keys() | theirs.keys()):  # a side may be missing: its rows NaN
            t = ours[step, kind].sort_values("start_us") if (step, kind) in ours else []
            p = theirs[step, kind].sort_values("start") if (step, kind) in theirs else []
            for i in range(max(len(t), len(p))):
                rows.append(_row(rank, int(step), kind, i, t.iloc[i] if i < len(t) else None,
                                 p.iloc[i] if i < len(p) else None, units))
    return pd.DataFrame(rows, columns=COLUMNS).sort_values(["rank", "step", "start_us"], ignore_index=True)


def _row(rank: int, step: int, kind: str, i: int, a, b, units: pd.DataFrame) -> dict:
    row = {"rank": rank, "step": step, "collective": kind, "index": i, "unit": np.nan, "name": None,
           "tracer_bytes": np.nan, "expected_profile_bytes": np.nan, "profile_bytes": np.nan,
           "start_us": np.nan, "end_us": np.nan, "profile_start_us": np.nan, "profile_end_us": np.nan}
    if a is not None:
        row.update(unit=a["unit"], name=a["name"], tracer_bytes=float(a["bytes"]), start_us=a["start_us"],
                   end_us=a["end_us"])
        shards = int(units.loc[a["unit"], "shard_size"]) if a["unit"] in units.index else 0
        if kind != "allgather":
            row["expected_profile_bytes"] = float(a["bytes"])
        elif shards > 0:
            row["expected_profile_bytes"] = float(a["bytes"]) / shards
    if b is not None:
        row.update(profile_bytes=b["bytes"], profile_start_us=b["start"], profile_end_us=b["end"])
    row["start_after_ms"] = (row["profile_start_us"] - row["start_us"]) / 1e3
    row["end_before_ms"] = (row["end_us"] - row["profile_end_us"]) / 1e3
    return row
