"""Ring all-reduce metrics and chunk states, from a ``RingTrace``.

Bandwidths follow nccl-tests: algorithm bandwidth ``algbw = bytes / time`` and bus
bandwidth ``busbw = algbw * 2(N-1)/N`` (what each link carries), in GB/s (10^9 bytes/s).
Times are ms unless a column says ``_us``.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.tracer.format import REDUCE_SCATTER
from ddpscope.viz.ring.trace import RingTrace
from ddpscope.viz.trace import TraceError


def ring_factor(n: int) -> float:
    """2(N-1)/N: bytes each rank sends (and receives) per byte of tensor in a ring all-reduce."""
    return 2.0 * (n - 1) / n


def compute_ring_rounds(trace: RingTrace) -> pd.DataFrame:
    """One row per round: round, repeat, bytes, calibration, warmup, ring_ms and ref_ms
    (the slowest rank's span: last end minus first start over ranks), ring and
    ``dist.all_reduce`` algbw/busbw (GB/s), max_abs_diff (largest over ranks)."""
    n = trace.world_size
    r = trace.rounds.groupby("round").agg(repeat=("repeat", "first"), bytes=("bytes", "first"),
                                          calibration=("calibration", "first"), warmup=("warmup", "first"),
                                          start=("start_us", "min"), end=("end_us", "max"),
                                          max_abs_diff=("max_abs_diff", "max"))
    ref = trace.refs.groupby("round").agg(start=("start_us", "min"), end=("end_us", "max"))
    out = pd.DataFrame({"round": r.index, "repeat": r["repeat"].to_numpy(), "bytes": r["bytes"].to_numpy(),
                        "calibration": r["calibration"].to_numpy(), "warmup": r["warmup"].to_numpy()})
    out["ring_ms"] = ((r["end"] - r["start"]) / 1e3).to_numpy()
    out["ref_ms"] = ((ref["end"] - ref["start"]) / 1e3).reindex(r.index).to_numpy()
    for col, t in (("ring", out["ring_ms"]), ("ref", out["ref_ms"])):
        out[f"{col}_algbw_GBps"] = out["bytes"] / (t * 1e-3) / 1e9
        out[f"{col}_busbw_GBps"] = out[f"{col}_algbw_GBps"] * ring_factor(n)
    out["max_abs_diff"] = r["max_abs_diff"].to_numpy()
    return out.reset_index(drop=True)


def compute_ring_summary(trace: RingTrace) -> pd.DataFrame:
    """Per tensor size, medians over timed rounds (no warm-up): rounds, bytes, MiB,
    ring_ms, ref_ms, ring/ref ratio, algbw and busbw (GB/s) of both."""
    r = compute_ring_rounds(trace)
    r = r[~r["warmup"]]
    cols = ["ring_ms", "ref_ms", "ring_algbw_GBps", "ring_busbw_GBps", "ref_algbw_GBps", "ref_busbw_GBps"]
    g = r.groupby("bytes")
    out = g[cols].median()
    out.insert(0, "rounds", g.size())
    out.insert(1, "MiB", out.index / 2**20)
    out.insert(4, "ring/ref", out["ring_ms"] / out["ref_ms"])
    return out.reset_index()


def compute_ring_traffic(trace: RingTrace) -> pd.DataFrame:
    """Bytes each rank sent and received in each round, counted from the traced steps,
    beside the ring's 2(N-1)/N x bytes."""
    s = trace.steps
    out = s.groupby(["round", "rank"], as_index=False).agg(size_bytes=("size_bytes", "first"),
                                                           steps=("step", "size"),
                                                           sent_bytes=("send_bytes", "sum"),
                                                           recv_bytes=("recv_bytes", "sum"))
    out["expected_bytes"] = out["size_bytes"] * ring_factor(trace.world_size)
    return out


def default_round(trace: RingTrace) -> int:
    """The timed round of the requested size whose ring time is the median one."""
    rounds = compute_ring_rounds(trace)
    main = rounds[rounds["round"].isin(trace.main_rounds())].sort_values("ring_ms")
    if not len(main):  # only warm-up or calibration rounds finished everywhere
        complete = trace.complete_rounds()
        if not complete:
            raise TraceError(f"{trace.path.name}: no ring round finished on every rank")
        return complete[-1]
    return int(main["round"].iloc[(len(main) - 1) // 2])


def compute_ring_step_times(trace: RingTrace, round_: int) -> pd.DataFrame:
    """Rows per step and rank of one round: step, phase, phase_step, rank, send_chunk,
    recv_chunk, send_to, recv_from, send_bytes, start_ms (from the round's first step start on any rank),
    dur_ms, comm_ms, reduce_ms."""
    s = trace.steps[trace.steps["round"] == round_]
    if not len(s):
        raise ValueError(f"round {round_} has no traced steps")
    t0 = s["start_us"].min()
    out = s[["step", "phase", "phase_step", "rank", "send_chunk", "recv_chunk", "send_to", "recv_from",
             "send_bytes"]].copy()
    out["start_ms"] = (s["start_us"] - t0) / 1e3
    out["dur_ms"] = (s["end_us"] - s["start_us"]) / 1e3
    out["comm_ms"] = s["comm_us"] / 1e3
    out["reduce_ms"] = s["reduce_us"] / 1e3
    return out.sort_values(["step", "rank"]).reset_index(drop=True)


def step_durations_ms(step_times: pd.DataFrame) -> np.ndarray:
    """Each step's time (ms), the median over ranks, in step order."""
    return step_times.groupby("step")["dur_ms"].median().sort_index().to_numpy()


def replay_chunk_states(step_times: pd.DataFrame, n: int) -> np.ndarray:
    """Contributions held per (frame, rank, chunk): replays the sends and receives a
    trace recorded. Frame 0 is the start (every slot holds its own rank's data: 1);
    frame k holds the state after step k. A reduce-scatter step adds the sender's
    contributions to the receiver's; an all-gather step overwrites. Raises ``ValueError``
    if a step would count a rank's data twice or a step is missing for some rank."""
    n_steps = 2 * (n - 1)
    # One bit per rank's data: exact, and double counting shows.
    masks = [[1 << r for _ in range(n)] for r in range(n)]
    frames = [_popcounts(masks)]
    by_step = {int(k): g for k, g in step_times.groupby("step")}
    for k in range(n_steps):
        g = by_step.get(k)
        if g is None or len(g) != n or sorted(g["rank"]) != list(range(n)):
            raise ValueError(f"step {k} is not recorded for all {n} ranks")
        before = [row[:] for row in masks]
        for rank, src, chunk, phase in zip(g["rank"], g["recv_from"], g["recv_chunk"], g["phase"]):
            incoming = before[int(src)][int(chunk)]
            if phase == REDUCE_SCATTER:
                if before[int(rank)][int(chunk)] & incoming:
                    raise ValueError(f"step {k}: rank {rank} would add rank data into chunk {chunk} twice")
                masks[int(rank)][int(chunk)] = before[int(rank)][int(chunk)] | incoming
            else:
                masks[int(rank)][int(chunk)] = incoming
        frames.append(_popcounts(masks))
    return np.stack(frames)


def _popcounts(masks: list[list[int]]) -> np.ndarray:
    return np.array([[m.bit_count() for m in row] for row in masks], dtype=np.int64)


def expected_chunk_states(n: int) -> np.ndarray:
    """The ring algorithm's contributions per (frame, rank, chunk), in closed form:
    in reduce-scatter, chunk c starts at rank c and reaches rank c+d after d steps with
    d+1 contributions; rank c-1 then owns it fully reduced, and in all-gather it reaches
    rank c-1+e after e more steps."""
    out = np.ones((2 * n - 1, n, n), dtype=np.int64)
    for f in range(2 * n - 1):
        rs_done, ag_done = min(f, n - 1), max(0, f - (n - 1))
        for r in range(n):
            for c in range(n):
                d = (r - c) % n
                count = d + 1 if 1 <= d <= rs_done else 1
                e = (r - (c - 1)) % n
                if e != 0 and e <= ag_done:
                    count = n
                out[f, r, c] = count
    return out
