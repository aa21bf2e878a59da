"""A sharded step's Chrome trace events (the format is in ``tracer/format.py``).

Per step: the step span, its passes' forward and backward spans and the optimizer on the
compute lane, as in a DDP trace (so Perfetto and every per-step reader see the same
shape); compute cut per unit and the waits for all-gathers on the units lane; one span
per collective on its kind's lane; an instant per memory sample on measured steps.
"""

from __future__ import annotations

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.rank_files import thread_meta
from ddpscope.tracer.capture.sharded.recorder import ShardedStep

_TID = {"all_gather": fmt.TID_ALL_GATHER, "reduce_scatter": fmt.TID_REDUCE_SCATTER,
        "all_reduce": fmt.TID_REDUCE_SCATTER}
NO_UNIT = "(no unit)"  # a collective no unit issued (DeepSpeed: after the step, the gradient norm); one
# collective_timer timed is named for who issued it (its "by")
_CAT = {"all_gather": fmt.CAT_ALL_GATHER, "reduce_scatter": fmt.CAT_REDUCE_SCATTER,
        "all_reduce": fmt.CAT_REDUCE_SCATTER}


def lane_events(rank: int) -> list[dict]:
    """Names of the sharded lanes, for Perfetto."""
    return [*thread_meta(rank, fmt.TID_UNITS, "compute per FSDP unit (and waits for all-gathers)"),
            *thread_meta(rank, fmt.TID_ALL_GATHER, "all-gather"),
            *thread_meta(rank, fmt.TID_REDUCE_SCATTER, "reduce-scatter")]


def _span(cat: str, name: str, pid: int, tid: int, ts: float | None, te: float | None, args: dict) -> dict | None:
    if ts is None:
        return None
    te = ts if te is None or te < ts else te
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": round(te - ts, 3),
            "args": args}


def step_events(s: ShardedStep, rank: int, names: list[str], sent_as: str | None) -> list[dict]:
    """``names``: unit names by index. ``sent_as``: what the backend really runs for a
    reduce-scatter when it has none (gloo: ``"all_reduce"``), or None."""
    step, pid = s.step, rank
    args = {"step": step, "micro_batches": len(s.passes), "warmup": step == 0}
    if s.incomplete:
        args["incomplete"] = True
    ev = [_span(fmt.CAT_STEP, f"step {step}", pid, fmt.TID_COMPUTE, s.start, s.end, args)]
    many = len(s.passes) > 1
    for k, p in enumerate(s.passes):
        suffix = f" (micro-batch {k}{'' if p.reduce_grads else ', no reduction'})" if many else ""
        pa = {"step": step, "micro": k, "sync": p.reduce_grads}
        ev.append(_span(fmt.CAT_FORWARD, "forward" + suffix, pid, fmt.TID_COMPUTE, p.forward[0], p.forward[1], pa))
        if p.backward_start is not None:
            ev.append(_span(fmt.CAT_BACKWARD, "backward" + suffix, pid, fmt.TID_COMPUTE, p.backward_start,
                            p.backward_end if p.backward_end is not None else s.end, pa))
    if s.optimizer:
        ev.append(_span(fmt.CAT_OPTIMIZER, "optimizer.step", pid, fmt.TID_COMPUTE, *s.optimizer, {"step": step}))
    for unit, phase, ts, te in s.segments:
        if te > ts:
            ev.append(_span(fmt.CAT_UNIT, f"{names[unit]} {phase}", pid, fmt.TID_UNITS, ts, te,
                            {"step": step, "unit": unit, "phase": phase}))
    for unit, phase, ts, te in s.waits:
        ev.append(_span(fmt.CAT_WAIT, f"wait: {names[unit]} all-gather", pid, fmt.TID_UNITS, ts, te,
                        {"step": step, "unit": unit, "phase": phase}))
    for c in s.colls:
        a = {"step": step, "unit": c.unit, "phase": c.phase, "bytes": c.nbytes, "collective": c.kind,
             "prefetch": c.prefetch}
        if c.kind == "reduce_scatter" and sent_as:
            a["sent_as"] = sent_as
        if c.extra:
            a.update(c.extra)
        if c.end is None:
            a["incomplete"] = True
        name = f"{c.kind.replace('_', '-')} {names[c.unit] if c.unit >= 0 else NO_UNIT}"
        ev.append(_span(_CAT[c.kind], a.get("by", name),
                        pid, _TID[c.kind], c.start,
                        c.end if c.end is not None else s.end, a))
    for m in s.memory:
        # an instant, not a counter: its unit and phase are text, which Perfetto's counters refuse
        ev.append({"ph": "i", "s": "t", "cat": fmt.CAT_MEMORY_SAMPLE, "name": "memory by category", "pid": pid,
                   "tid": fmt.TID_UNITS, "ts": m["ts"],
                   "args": {k: v for k, v in m.items() if k != "ts"} | {"step": step}})
    return [e for e in ev if e is not None]
