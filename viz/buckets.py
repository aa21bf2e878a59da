"""DDP's gradient buckets as the trace saw them."""

from __future__ import annotations

import pandas as pd

from viz.trace import RunTrace


def compute_bucket_layout(trace: RunTrace) -> pd.DataFrame:
    """One row per bucket of the final layout (after DDP's rebuild): index, size in MiB
    and bytes, number of parameters and their names (in the order DDP packed them)."""
    cols = ["bucket", "mib", "bytes", "num_params", "params"]
    b = trace.buckets
    if len(b) == 0:
        return pd.DataFrame(columns=cols)
    last = b[b["step"] == b["step"].max()].drop_duplicates("bucket").sort_values("bucket")
    return pd.DataFrame({
        "bucket": last["bucket"].to_numpy(), "mib": last["bytes"].to_numpy() / 2**20,
        "bytes": last["bytes"].to_numpy(), "num_params": last["num_params"].to_numpy(),
        "params": [", ".join(p) for p in last["params"]],
    })
