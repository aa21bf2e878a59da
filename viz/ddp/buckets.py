"""DDP's gradient buckets as the trace saw them."""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.trace import RunTrace


def bus_bandwidth_factor(world_size: int) -> float:
    """busbw / algbw for a ring all-reduce: 2(N-1)/N (nccl-tests' definition)."""
    return 2.0 * (world_size - 1) / world_size if world_size > 0 else 0.0


def run_start_us(trace: RunTrace) -> np.ndarray:
    """When each bucket all-reduce (``trace.buckets``' rows) began to run, µs. NCCL runs a
    group's collectives in order on one stream: a bucket launched while earlier ones still
    run waits behind them, so it starts at the later of its launch and the end of every
    all-reduce of its rank's step launched before it; the backend's own kernel time, where
    the trace has it (``TORCH_NCCL_ENABLE_TIMING=1``), gives the start directly. Gloo runs
    collectives on several threads at once, and a profiler trace's all-reduces are the
    kernels themselves: there a bucket runs from its launch."""
    b = trace.buckets
    launch, done = b["launch_us"].to_numpy(float), b["done_us"].to_numpy(float)
    fifo = [r for r, m in trace.ranks.items() if trace.source == "ddpscope" and m.get("backend") == "nccl"]
    start = launch.copy()
    if not fifo or len(b) == 0:
        return start
    order = b[b["rank"].isin(fifo)].sort_values(["rank", "step", "launch_us"], kind="stable")
    ends = order.groupby(["rank", "step"], sort=False)["done_us"]
    before = ends.cummax().groupby([order["rank"], order["step"]], sort=False).shift()  # earlier launches' end
    at = b.index.get_indexer(order.index)
    start[at] = np.fmax(launch[at], before.to_numpy(float))
    if "kernel_us" in b:  # the backend timed the kernel itself
        kernel = b["kernel_us"].to_numpy(float)
        timed = np.isfinite(kernel) & np.isin(b["rank"].to_numpy(), fifo)
        start[timed] = np.clip(done[timed] - kernel[timed], launch[timed], done[timed])
    return np.minimum(start, np.fmax(done, launch))


def compute_bucket_events(trace: RunTrace) -> pd.DataFrame:
    """Every bucket all-reduce with its timing against its step: ``launch_offset_ms``
    (from the rank's backward start; a profiler trace's: from the ProfilerStep's start),
    ``duration_ms`` (launch to done), ``queued_ms`` (launch to when it began to run: waiting
    behind the earlier buckets on NCCL's stream, ``run_start_us``) and ``run_ms`` (running),
    ``algbw_gbps`` (bytes / running time, GB/s decimal) and ``busbw_gbps`` (algbw x 2(N-1)/N):
    a queued bucket's bandwidth is not read low for its wait."""
    b = trace.buckets
    if len(b) == 0:
        return b.assign(launch_offset_ms=[], duration_ms=[], queued_ms=[], run_ms=[], algbw_gbps=[], busbw_gbps=[])
    s = trace.steps.set_index(["rank", "step"])
    # a profiler trace has no backward span: offsets are from the step's start there
    bwd = s["backward_start_us" if "backward_start_us" in s else "start_us"].reindex(pd.MultiIndex.from_frame(b[["rank", "step"]])).to_numpy()
    launch, done = b["launch_us"].to_numpy(float), b["done_us"].to_numpy(float)
    start = run_start_us(trace)
    run_us = done - start
    with np.errstate(divide="ignore", invalid="ignore"):  # a span of no running time has no bandwidth
        algbw = np.where(run_us > 0, b["bytes"].to_numpy() / (run_us * 1e-6) / 1e9, np.nan)
    return b.assign(
        launch_offset_ms=(launch - bwd) / 1e3,
        duration_ms=(done - launch) / 1e3,
        queued_ms=(start - launch) / 1e3,
        run_ms=run_us / 1e3,
        algbw_gbps=algbw,
        busbw_gbps=algbw * bus_bandwidth_factor(trace.world_size),
    )


def compute_bucket_table(trace: RunTrace, include_warmup: bool = False) -> pd.DataFrame:
    """One row per bucket index: MiB, parameters, and medians over steps and ranks of the
    launch offset from backward start (ms), all-reduce duration (ms; launch to done), of it
    the time queued behind earlier buckets and the time running (ms; ``compute_bucket_events``),
    and bandwidths over the running time (GB/s)."""
    cols = ["bucket", "mib", "num_params", "launch_offset_ms", "duration_ms", "queued_ms", "run_ms", "algbw_gbps",
            "busbw_gbps", "params"]
    ev = compute_bucket_events(trace)
    if len(ev) == 0:
        return pd.DataFrame(columns=cols)
    steps = trace.steps.set_index(["rank", "step"])
    keep = ~steps["incomplete"]
    if not include_warmup:
        keep &= ~steps["warmup"]
    ok = keep.reindex(pd.MultiIndex.from_frame(ev[["rank", "step"]])).fillna(False).to_numpy(bool)
    ev = ev[ok & ~ev["incomplete"].to_numpy(bool)]
    if len(ev) == 0:
        return pd.DataFrame(columns=cols)
    last = ev[ev["step"] == ev["step"].max()].drop_duplicates("bucket").set_index("bucket")
    med = ev.groupby("bucket")[["launch_offset_ms", "duration_ms", "queued_ms", "run_ms", "algbw_gbps",
                                "busbw_gbps"]].median()
    out = med.join(last[["bytes", "num_params", "params"]])
    out.insert(0, "mib", out.pop("bytes") / 2**20)
    out.insert(1, "num_params", out.pop("num_params"))
    # a profiler trace names no parameter; a bucket seen only in an earlier step (a repeated
    # kernel) has none in the last step's rows
    out["params"] = [", ".join(p) if isinstance(p, (list, tuple)) else "" for p in out["params"]]
    return out.reset_index()[cols]
