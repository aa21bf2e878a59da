"""Replay a traced run's steps with another bucket layout: the prediction.

Each step is simulated on every rank at once, event by event (times µs):
- backward compute advances each rank's work from its measured start at rate 1, less
  what the all-reduces in flight take: each takes ``model.steal_us(its MiB)``, spread
  over the time it is in flight beside compute;
- bucket j is ready on a rank when its last gradient's work is done; DDP launches buckets
  in index order, ``launch_us`` after ready;
- the process group runs all-reduces in bucket order, at most ``lanes`` at once; one
  starts when every rank has launched it and a lane is free, takes the fitted cost of its
  size, and goes 1 + comm_slowdown times slower while any rank computes (on one machine
  lanes do not share the link: on gloo a small all-reduce is mostly waiting on its peer,
  and what sharing there is shows in the fitted cost; across nodes they split it, each
  at 1/n of its rate while n are in flight: ``model.shared_link``);
- after backward, each rank waits for its last all-reduce, then DDP's finalize and the
  rest of the step (optimizer, data) take what they took in the trace.

``predict_run`` returns a ``RunTrace`` whose tables (steps, passes, buckets, grads) are
built like a measured trace's, so every metric and figure takes a prediction as it is.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pandas as pd

from ddpscope.tracer.step_summary import COMM_FIELDS
from ddpscope.viz.trace import (
    BUCKET_COLUMNS,
    GRAD_COLUMNS,
    PASS_COLUMNS,
    STEP_COLUMNS,
    RunTrace,
    TraceError,
    fill_comm_columns,
    frame_of,
)
from ddpscope.viz.whatif.layout import (
    Cap,
    assign_buckets,
    bucket_limits,
    cap_limits,
    first_layout,
    is_cap_list,
    rebuilds,
    smallest_cap_bytes,
)
from ddpscope.viz.whatif.model import StepInputs, WhatIfModel, fit_model, step_inputs

_EPS = 1e-6


def ready_order(trace: RunTrace) -> list[int]:
    """Parameters in the order DDP's rebuild sees their gradients: rank 0's first traced
    backward (every parameter that has a gradient; any missing go last, in reverse
    registration order, as DDP's initial buckets have them); a torch.compile'd model's in
    the order of DDPOptimizer's pieces (``compiled.graph_order``)."""
    n = len(trace.run.get("param_bytes") or [])
    g = trace.grads
    first = g[(g["rank"] == g["rank"].min())]
    first = first[first["step"] == first["step"].min()]
    first = first[first["micro"] == first["micro"].min()].sort_values("ready_us", kind="stable")
    seen = [int(p) for p in dict.fromkeys(first["param"]) if 0 <= int(p) < n]
    if smallest_cap_bytes(trace.run):  # torch.compile'd: inside a piece the order is not the graph's
        from ddpscope.viz.whatif.compiled import graph_order

        ready = dict(zip(first["param"].astype(int), first["ready_us"].astype(float)))
        seen = [p for p in graph_order(ready, trace.run) if 0 <= p < n]
    rest = [p for p in reversed(range(n)) if p not in set(seen)]
    return seen + rest


def traced_cap(trace: RunTrace) -> Cap:
    """The cap to replay the trace as it ran: its ``bucket_cap_mb`` (MiB), its
    ``bucket_cap_mb_list`` (a tuple of MiB), or None when DDP ran with its default (25
    MiB and a 1 MiB first bucket), which an explicit 25 is not."""
    run = trace.run
    if run.get("bucket_cap_bytes_list"):
        return tuple(b / 2**20 for b in run["bucket_cap_bytes_list"])
    if run.get("bucket_cap_default"):
        return None
    cap = run.get("bucket_cap_mb")
    return float(cap) if cap else None


def predict_layout(trace: RunTrace, cap_mb: Cap) -> list[list[int]]:
    """The buckets DDP builds for ``cap_mb`` (MiB, or a per-bucket list) under the run's
    flags: rebuilt from this trace's ready order, or, where DDP never rebuilds
    (``find_unused_parameters`` in a dynamic graph), its first layout in registration
    order (``layout.rebuilds``)."""
    run = trace.run
    sizes = run.get("param_bytes") or []
    dtypes = run.get("param_dtypes") or ["float32"] * len(sizes)
    try:
        if not rebuilds(run):
            return first_layout(sizes, dtypes, bucket_limits(cap_mb))
        return assign_buckets(sizes, dtypes, ready_order(trace), bucket_limits(cap_mb))
    except ValueError as e:  # what the trace says of its parameters does not hold together
        raise TraceError(f"{trace.path.name}: cannot lay out its buckets: {e}") from None


def simulate_step(inputs: StepInputs, layout: list[list[int]], bucket_bytes: list[float],
                  model: WhatIfModel) -> dict:
    """One step on every rank. Returns ``{"ranks": {r: {"backward_end", "sync_end",
    "ready": [per bucket], "launch": [per bucket]}}, "start": [...], "done": [...]}``
    (µs, rank 0's clock)."""
    ranks = sorted(inputs.ranks)
    nb = len(layout)
    kappa, lanes = model.comm_slowdown, model.lanes
    cost = np.asarray(model.cost.time_us(bucket_bytes), float) if nb else np.zeros(0)
    # share of a core an all-reduce takes from compute while it runs beside it
    steal = np.minimum(model.steal_us(np.asarray(bucket_bytes, float) / 2**20)
                       / np.maximum(cost * (1.0 + kappa), 1e-9), 0.95) if nb else np.zeros(0)
    # The loop below runs per event of every replayed step (the advisor replays hundreds of
    # layouts): plain floats and lists, not numpy scalars (the same IEEE doubles, the same
    # operations in the same order, so the same numbers, ~3x faster).
    steal_l: list[float] = steal.tolist()
    rs = inputs.ranks
    b0 = {r: rs[r].b0 for r in ranks}
    # per rank: (work, kind, bucket) milestones in work order; kind 0 = bucket ready, 1 = backward end
    miles = {r: sorted([(float(max(rs[r].work.get(p, 0.0) for p in b)), 0, j) for j, b in enumerate(layout)]
                       + [(rs[r].work_end, 1, -1)]) for r in ranks}
    pos = {r: 0 for r in ranks}
    work = {r: 0.0 for r in ranks}
    bwd_end: dict[int, float] = {}
    nan = math.nan
    ready = {r: [nan] * nb for r in ranks}
    launch = {r: [nan] * nb for r in ranks}
    next_launch = {r: 0 for r in ranks}  # DDP launches buckets in index order
    start, done = [nan] * nb, [nan] * nb
    remaining: list[float] = cost.tolist()
    in_flight: list[int] = []
    next_start = 0
    launch_us = model.launch_us
    t = min(b0.values())

    for _ in range(100 * (nb + 2) * len(ranks) + 1000):
        # settle everything due at t
        changed = True
        while changed:
            changed = False
            for r in ranks:
                m, lr, rr = miles[r], launch[r], ready[r]
                if r not in bwd_end and t >= b0[r] - _EPS:  # computing
                    while pos[r] < len(m) and m[pos[r]][0] <= work[r] + _EPS:
                        _, kind, j = m[pos[r]]
                        pos[r] += 1
                        changed = True
                        if kind == 1:
                            bwd_end[r] = t
                            break
                        rr[j] = t
                while next_launch[r] < nb and rr[next_launch[r]] == rr[next_launch[r]]:  # ready (not NaN)
                    j = next_launch[r]
                    lr[j] = max(t + launch_us, lr[j - 1] if j else -math.inf)
                    next_launch[r] += 1
                    changed = True
            for j in list(in_flight):
                if remaining[j] <= _EPS:
                    in_flight.remove(j)
                    done[j] = t
                    changed = True
            # (a NaN launch compares False: not launched)
            while (next_start < nb and len(in_flight) < lanes
                   and all(launch[r][next_start] <= t + _EPS for r in ranks)):
                start[next_start] = t
                in_flight.append(next_start)
                next_start += 1
                changed = True
        if len(bwd_end) == len(ranks) and next_start == nb and not in_flight:
            break
        # rates until the next event
        computing = [r for r in ranks if r not in bwd_end and t >= b0[r] - _EPS]
        taken = min(0.95, float(sum(steal_l[j] for j in in_flight)))
        c_rate = {r: (1.0 - taken if r in computing else 0.0) for r in ranks}
        m_rate = 1.0 / (1.0 + kappa) if computing else 1.0
        if model.shared_link and in_flight:  # the all-reduces in flight split the link
            m_rate /= len(in_flight)
        compute_eta = {r: t + (miles[r][pos[r]][0] - work[r]) / c_rate[r] for r in computing
                       if pos[r] < len(miles[r])}
        comm_eta = {j: t + remaining[j] / m_rate for j in in_flight}
        t_next = min([math.inf, *compute_eta.values(), *comm_eta.values(),
                      *(b0[r] for r in ranks if r not in bwd_end and t < b0[r] - _EPS)])
        if next_start < nb and len(in_flight) < lanes:
            due = [launch[r][next_start] for r in ranks]
            if all(d == d for d in due):  # every rank launched it (no NaN)
                t_next = min(t_next, max(due))
        t_next = max(t_next, t)
        if not math.isfinite(t_next):
            raise TraceError("the what-if simulation cannot make progress (a bucket never becomes ready)")
        dt = t_next - t
        for r in ranks:
            work[r] += c_rate[r] * dt
        for j in in_flight:
            remaining[j] -= m_rate * dt
        # what was due now is done: times are ~1e10 µs, where rounding would leave a
        # milestone a hair short and the loop creeping towards it
        for r, eta in compute_eta.items():
            if eta <= t_next:
                work[r] = max(work[r], miles[r][pos[r]][0])
        for j, eta in comm_eta.items():
            if eta <= t_next:
                remaining[j] = 0.0
        t = t_next
    else:
        raise TraceError("the what-if simulation did not finish (a bug: please report it with the run folder)")
    out = {}
    for r in ranks:
        last = max([bwd_end[r], *[d for d in done if d == d]])
        out[r] = {"backward_end": bwd_end[r], "sync_end": last + rs[r].finalize, "ready": ready[r],
                  "launch": launch[r]}
    return {"ranks": out, "start": start, "done": done}


def predict_run(trace: RunTrace, cap_mb: Cap, model: WhatIfModel | None = None,
                fitted: WhatIfModel | None = None) -> RunTrace:
    """``trace``'s usable steps replayed at ``bucket_cap_mb`` = ``cap_mb`` (MiB; None:
    DDP's default; a tuple: ``bucket_cap_mb_list``) with ``model`` (fitted to ``trace`` when not given). ``fitted``: the
    model fitted to the trace, when ``model`` is another (a projection): the trace's
    compute is read with it. The result's ``run`` says ``"status": "predicted"`` and
    holds the layout and the model's notes."""
    if is_cap_list(cap_mb):
        bucket_limits(cap_mb)  # ValueError on a bad list
    elif cap_mb is not None and not (np.isfinite(cap_mb) and cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be > 0 MiB, got {cap_mb}")
    model = model or fit_model(trace)
    layout = predict_layout(trace, cap_mb)
    sizes = trace.run["param_bytes"]
    names = trace.run.get("param_names") or [f"param[{i}]" for i in range(len(sizes))]
    bucket_bytes = [float(sum(sizes[p] for p in b)) for b in layout]
    reader = fitted or model  # reads the trace's compute: the same for every cap of a sweep
    key = ("whatif_inputs", reader.steal_us_per_allreduce, reader.steal_us_per_mib)
    inputs = trace.cache.get(key) or trace.cache.setdefault(key, step_inputs(trace, reader))
    if not inputs:
        raise TraceError(f"{trace.path.name}: no step to replay")
    if smallest_cap_bytes(trace.run):  # torch.compile's DDPOptimizer: the cap moves when gradients are ready
        from ddpscope.viz.whatif.compiled import at_cap

        inputs = at_cap(inputs, trace.run, cap_mb)
    measured = trace.steps.set_index(["rank", "step"])
    rows: dict[str, list] = {"steps": [], "passes": [], "buckets": [], "grads": []}
    keep = set()
    for inp in inputs:
        sim = simulate_step(inp, layout, bucket_bytes, model)
        for r, res in sim["ranks"].items():
            keep.add((r, inp.step))
            _emit_rank_step(rows, measured.loc[(r, inp.step)], r, inp, res, sim, layout, bucket_bytes, names)
    # the non-syncing passes (gradient accumulation) and their gradients, as measured (the Gantt
    # cuts a pass's backward at its gradients): the same at every setting, taken once per trace
    unsynced = trace.cache.get(("whatif_unsynced", *key)) or \
        trace.cache.setdefault(("whatif_unsynced", *key), _unsynced(trace, keep))
    per_bucket = bucket_limits(cap_mb) if is_cap_list(cap_mb) else None
    first, cap_bytes = (max(per_bucket),) * 2 if per_bucket else cap_limits(cap_mb)
    run = {**trace.run, "status": "predicted", "bucket_cap_mb": cap_bytes / 2**20, "bucket_cap_bytes": cap_bytes,
           "first_bucket_cap_bytes": first, "bucket_cap_default": cap_mb is None, "bucket_layout": layout,
           "bucket_cap_bytes_list": per_bucket,
           "prediction": {"from": str(trace.path), "from_bucket_cap_mb": trace.run.get("bucket_cap_mb"),
                          "model": _model_json(model)}}
    memory = trace.memory
    if len(memory):
        memory = memory[[k in keep for k in memory.set_index(["rank", "step"]).index]].reset_index(drop=True)
    buckets = frame_of(rows["buckets"], ["rank", "step", "bucket"], BUCKET_COLUMNS)
    passes = _beside(frame_of(rows["passes"], ["rank", "step", "micro"], PASS_COLUMNS), unsynced[0],
                     ["rank", "step", "micro"])
    grads = _beside(frame_of(rows["grads"], ["rank", "step", "ready_us"], GRAD_COLUMNS), unsynced[1],
                    ["rank", "step", "ready_us"])
    return RunTrace(path=trace.path, run=run, ranks=trace.ranks,
                    steps=fill_comm_columns(frame_of(rows["steps"], ["rank", "step"], STEP_COLUMNS), buckets, passes),
                    buckets=buckets, grads=grads,
                    memory=memory, passes=passes)


def _emit_rank_step(rows, m, r, inp: StepInputs, res, sim, layout, bucket_bytes, names) -> None:
    rs = inp.ranks[r]
    micro = int(m.get("micro_batches", 1) or 1) - 1  # the syncing pass is the step's last
    shift = res["sync_end"] - float(m["sync_end_us"]) if pd.notna(m.get("sync_end_us")) else 0.0
    # what the measured all-reduces did is not the prediction's: computed from its buckets
    row = {k: m[k] for k in m.index if not k.startswith("optimizer") and k not in ("end_us", *COMM_FIELDS)}
    row.update(rank=r, step=inp.step, warmup=False, incomplete=False,
               backward_end_us=res["backward_end"], sync_start_us=res["backward_end"], sync_end_us=res["sync_end"],
               end_us=float(m["end_us"]) + shift)
    # the syncing pass's compute replaced by the prediction's (the others' stay measured)
    measured_end = float(m["compute_end_us"]) if pd.notna(m.get("compute_end_us")) else float(m["backward_end_us"])
    row["backward_us"] = float(m["backward_us"]) - (measured_end - float(m["backward_start_us"])) \
        + (res["backward_end"] - rs.b0)
    row["compute_end_us"] = res["backward_end"]  # the predicted span is compute only
    for k in ("optimizer_start_us", "optimizer_end_us"):
        if k in m.index and pd.notna(m[k]):
            row[k] = float(m[k]) + shift
    rows["steps"].append(row)
    rows["passes"].append({"rank": r, "step": inp.step, "micro": micro,
                           "sync": True, "forward_start_us": m["forward_start_us"],
                           "forward_end_us": m["forward_end_us"], "backward_start_us": rs.b0,
                           "backward_end_us": res["backward_end"], "sync_start_us": res["backward_end"],
                           "sync_end_us": res["sync_end"]})
    for j, params in enumerate(layout):
        rows["buckets"].append({"rank": r, "step": inp.step, "bucket": j, "bytes": int(bucket_bytes[j]),
                                "num_params": len(params), "params": [names[p] for p in params],
                                "launch_us": res["launch"][j], "done_us": sim["done"][j], "incomplete": False})
    # A gradient's predicted ready time: its bucket's for the bucket's last gradient; the
    # others placed by work between the backward start and that (approximate).
    for j, params in enumerate(layout):
        last = max(rs.work.get(q, 0.0) for q in params)
        for p in params:
            if p in rs.work:
                frac = rs.work[p] / last if last > 0 else 1.0
                rows["grads"].append({"rank": r, "step": inp.step, "micro": micro, "param": p,
                                      "name": names[p] if p < len(names) else str(p),
                                      "ready_us": rs.b0 + frac * (res["ready"][j] - rs.b0)})


def _unsynced(trace: RunTrace, keep: set) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The trace's passes and gradients of the non-syncing passes (every micro-batch but a
    step's last) of the replayed steps ``keep`` ({(rank, step)}), as measured."""
    steps = trace.steps
    micro = steps["micro_batches"] if "micro_batches" in steps else pd.Series(1, index=steps.index)
    syncing = pd.Series(micro.fillna(0).clip(lower=1).astype(int).to_numpy() - 1,
                        index=pd.MultiIndex.from_frame(steps[["rank", "step"]]))
    out = []
    for table in (trace.passes, trace.grads):
        if not len(trace.passes) or not len(table) or "micro" not in table:
            out.append(table.iloc[:0])
            continue
        at = pd.MultiIndex.from_frame(table[["rank", "step"]])
        mine = at.isin(list(keep)) & (table["micro"].to_numpy() != syncing.reindex(at).to_numpy())
        out.append(table[mine])
    return out[0], out[1]


def _beside(predicted: pd.DataFrame, measured: pd.DataFrame, order: list[str]) -> pd.DataFrame:
    """The predicted rows and the measured ones kept as they were, in ``order``."""
    if not len(measured):
        return predicted
    return pd.concat([predicted, measured], ignore_index=True).sort_values(order, kind="stable", ignore_index=True)


def _model_json(model: WhatIfModel) -> dict:
    d = dataclasses.asdict(model)
    d["cost"] = {k: v for k, v in d["cost"].items() if k != "points"}
    return d
