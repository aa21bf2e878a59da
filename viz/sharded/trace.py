"""A sharded (FSDP2) run's own tables, read beside the step tables every training trace
has (``viz.trace.load_run`` fills ``RunTrace.shards``).

Tables (times µs on rank 0's clock, bytes):

- ``units``: unit, name, numel, sharded_bytes, unsharded_bytes, reshard_after_forward, root,
  shard_size and replicate_size (HSDP: > 1; 0 and 1 in traces older than them)
- ``segments``: rank, step, unit, name, phase (forward / backward), start_us, end_us:
  the rank's compute, cut per unit (the innermost unit running)
- ``waits``: rank, step, unit, name, phase, start_us, end_us: compute waiting for a
  unit's all-gather (its copy-out included)
- ``colls``: rank, step, unit, name, collective (all_gather / reduce_scatter, and HSDP's
  all_reduce of the reduced shard across replicas, on the reduce-scatter lane; unit -1,
  name "(no unit)": one no unit issued), phase,
  bytes (the collective's message: all-gather output, reduce-scatter input), prefetch,
  sent_as (what the backend ran instead: gloo runs a reduce-scatter as an all-reduce),
  start_us, end_us; DeepSpeed's also say what issued each (``issued_by``: grad_bucket,
  param_fetch, param_allgather, other; an FSDP2 run's collective of no unit is
  "other", and ``by`` names who issued it: ``all_reduce (torch.nn.utils.clip_grad...)``,
  the script's file and line, DeepSpeed's gathers after the step ``AFTER_STEP_GATHER``)
  and, for a gradient bucket, its number in the
  step (``bucket``), its parameters' count and its first and last parameter, and each
  parameter's elements in the bucket's order (``bucket_numels``, a tuple; None in traces
  before it) and its whole reduction on the training thread (``bucket_reduce_us``, µs:
  DeepSpeed's own work around its collectives; NaN in traces before it)
- ``memory``: rank, step, ts_us, unit, name, phase, at (start / end of the unit's
  phase), and bytes per category (``tracer.format.MEMORY_CATEGORIES``; "other" on CUDA
  only), total_bytes, and ``unsharded_by_unit``: the gathered parameters' bytes by unit,
  ``{unit: bytes}`` for the units holding any (None in traces before it and DeepSpeed's);
  with DeepSpeed's offload the categories are the device's and ``offloaded`` ({category:
  bytes}, None without offload) what is kept of each in host memory, ``host_bytes`` its sum

``real_steps``: the steps every table and prediction counts; ``shard_group_size`` and
``replicas``: the ranks a unit is sharded over and HSDP's replicas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pandas as pd

from ddpscope.tracer import format as fmt

UNIT_COLUMNS = ["unit", "name", "numel", "sharded_bytes", "unsharded_bytes", "reshard_after_forward", "root",
                "shard_size", "replicate_size"]
SEGMENT_COLUMNS = ["rank", "step", "unit", "name", "phase", "start_us", "end_us"]
COLL_COLUMNS = ["rank", "step", "unit", "name", "collective", "phase", "bytes", "prefetch", "sent_as", "start_us",
                "end_us", "issued_by", "by", "bucket", "micro", "bucket_params", "first_param", "last_param", "bucket_numels",
                "bucket_reduce_us"]
MEMORY_COLUMNS = ["rank", "step", "ts_us", "unit", "name", "phase", "at", *fmt.MEMORY_CATEGORIES, "total_bytes",
                  "unsharded_by_unit", "offloaded", "host_bytes"]
# who issued DeepSpeed's gathers after the optimizer's update (``issued_by`` param_allgather),
# by ZeRO stage: their ``by``, as the Timeline's hover and the no-unit table say it
AFTER_STEP_GATHER = {
    1: "ZeRO's gather of the updated partitions after the step",
    2: "ZeRO's gather of the updated partitions after the step",
    3: "ZeRO-3's gather of its persistent parameters after the step (stage3_param_persistence_threshold)",
}


@dataclass(frozen=True)
class ShardedTables:
    stage: int
    stage_reason: str
    framework: str
    units: pd.DataFrame
    segments: pd.DataFrame
    waits: pd.DataFrame
    colls: pd.DataFrame
    memory: pd.DataFrame
    reduce_scatter_sent_as: str | None
    # FSDP2: the prefetch depths the units ran with (units ahead; FSDP's defaults 0 and 1 in
    # traces before they were recorded); None: the script's own lists, no one depth
    forward_prefetch: int | None = 0
    backward_prefetch: int | None = 1


def _units(run: dict) -> pd.DataFrame:
    sharding = run.get("sharding")
    if not isinstance(sharding, dict) or not isinstance(sharding.get("units"), list) or not sharding["units"]:
        raise ValueError("run.json describes no FSDP units (sharding.units)")
    rows = []
    for k, u in enumerate(sharding["units"]):
        reshard = u.get("reshard_after_forward")
        if not (isinstance(u.get("name"), str) and isinstance(reshard, (bool, int))):
            raise ValueError(f"unit {k} has no name or reshard_after_forward setting")
        rows.append({"unit": k, "name": u["name"], "numel": _count(u.get("numel")),
                     "sharded_bytes": _count(u.get("sharded_bytes")), "unsharded_bytes": _count(u.get("unsharded_bytes")),
                     "reshard_after_forward": reshard, "root": bool(u.get("root")),
                     "shard_size": _count(u.get("shard_size", 0)), "replicate_size": _count(u.get("replicate_size", 1))})
    return pd.DataFrame(rows, columns=UNIT_COLUMNS)


def _count(v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**50:
        raise ValueError(f"{v!r} is not a count of bytes or elements")
    return v


# run.json's DeepSpeed settings the tables and predictions count with (engine_facts.py)
_DEEPSPEED_COUNTS = ("reduce_bucket_size", "reduce_bucket_bytes", "stage3_persistent_numel", "frozen_partition_numel",
                     "stage3_param_persistence_threshold", "gradient_accumulation_steps", "world_size")


def _check_deepspeed(run: dict) -> None:
    """run.json's ``deepspeed`` (a DeepSpeed run's engine settings) is an object whose
    counts are numbers >= 0 or null; ``ValueError`` naming the first that is not."""
    ds = run.get("deepspeed")
    if ds is None:
        return
    if not isinstance(ds, dict):
        raise ValueError(f"run.json's deepspeed is a {type(ds).__name__}, not an object")
    for key in _DEEPSPEED_COUNTS:
        v = ds.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or v < 0 or abs(v) > 2**62):
            raise ValueError(f"run.json's deepspeed.{key} is {str(v)[:40]!r}, not a count")


def _time(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{v!r} is not a time")
    return float(v)


def parse_sharded(run: dict, files: dict[int, tuple[dict, list]], align_of) -> ShardedTables:
    """The sharded tables of a run whose rank files are ``files`` ({rank: (meta, events)});
    ``align_of(meta)`` maps a rank's µs onto rank 0's clock. ``ValueError`` if malformed."""
    _check_deepspeed(run)
    units = _units(run)
    names = units["name"].tolist()
    n_units = len(names)
    segs, waits, colls, mem = [], [], [], []
    sharding = run["sharding"]
    stage = sharding.get("stage")
    framework = str(sharding.get("framework") or "fsdp2")
    # FSDP2: 2 or 3 by its reshard setting, 0 on shard groups of one rank (nothing sharded)
    if stage not in ((1, 2, 3) if framework == "deepspeed" else (0, 2, 3)):
        raise ValueError(f"sharding.stage {stage!r} is not a ZeRO stage {framework} runs")
    if stage == 0 and "shard_size" in units and (units["shard_size"] > 1).any():
        raise ValueError(f"sharding.stage 0 (nothing sharded) but units are sharded over "
                         f"{int(units['shard_size'].max())} ranks")
    after_step = AFTER_STEP_GATHER[stage] if framework == "deepspeed" else None
    for rank, (meta, events) in files.items():
        align = align_of(meta)
        for e in events:
            cat = e.get("cat")
            if cat not in (fmt.CAT_UNIT, fmt.CAT_WAIT, fmt.CAT_ALL_GATHER, fmt.CAT_REDUCE_SCATTER,
                           fmt.CAT_MEMORY_SAMPLE):
                continue
            a = e.get("args") or {}
            unit, step = a.get("unit"), a.get("step")
            if not (isinstance(step, int) and 0 <= step < 10**9 and isinstance(unit, int)
                    and -1 <= unit < n_units):
                raise ValueError(f"rank {rank}: a {cat} event names unit {unit!r} of {n_units} (step {step!r})")
            ts = _time(e.get("ts"))
            # a memory sample of no unit is the optimizer's; a collective of none, no unit's
            name = names[unit] if unit >= 0 else "optimizer" if cat == fmt.CAT_MEMORY_SAMPLE else "(no unit)"
            if cat == fmt.CAT_MEMORY_SAMPLE:
                row = {"rank": rank, "step": step, "ts_us": align(ts), "unit": unit, "name": name,
                       "phase": str(a.get("phase")), "at": str(a.get("at"))}
                for k in fmt.MEMORY_CATEGORIES:
                    row[k] = _count(a[k]) if k in a else (0 if k != "other_bytes" else math.nan)
                row["total_bytes"] = sum(row[k] for k in fmt.MEMORY_CATEGORIES if not math.isnan(row[k]))
                row["unsharded_by_unit"] = _by_unit(a.get("unsharded_by_unit"), n_units, row["unsharded_params_bytes"])
                row["offloaded"] = _offloaded(a.get("offloaded"))
                row["host_bytes"] = sum((row["offloaded"] or {}).values())
                mem.append(row)
                continue
            te = ts + _time(e.get("dur", 0.0))
            base = {"rank": rank, "step": step, "unit": unit, "name": name, "phase": str(a.get("phase")),
                    "start_us": align(ts), "end_us": align(te)}
            if cat == fmt.CAT_UNIT:
                segs.append(base)
            elif cat == fmt.CAT_WAIT:
                waits.append(base)
            else:
                kind = "all_gather" if cat == fmt.CAT_ALL_GATHER else \
                    "all_reduce" if a.get("collective") == "all_reduce" else "reduce_scatter"  # HSDP's, across replicas
                bucket, by = a.get("bucket"), a.get("by") if isinstance(a.get("by"), str) else None
                if by is None and a.get("zero") == "param_allgather":
                    by = after_step
                colls.append({**base, "collective": kind,
                              "bytes": _count(a.get("bytes")), "prefetch": bool(a.get("prefetch")),
                              "sent_as": a.get("sent_as") if isinstance(a.get("sent_as"), str) else None,
                              "issued_by": a.get("zero") if isinstance(a.get("zero"), str) else
                              "other" if isinstance(a.get("by"), str) else None,
                              "by": by,
                              "bucket": bucket if isinstance(bucket, int) and not isinstance(bucket, bool) else None,
                              # the micro-batch a bucket was reduced in (numbered in it); 0 in traces before it
                              "micro": _count(a.get("micro", 0)) if "bucket" in a else None,
                              "bucket_params": _count(a.get("params", 0)) if "bucket" in a else None,
                              "first_param": a.get("first_param") if isinstance(a.get("first_param"), str) else None,
                              "last_param": a.get("last_param") if isinstance(a.get("last_param"), str) else None,
                              "bucket_numels": _numels(a.get("numels")),
                              "bucket_reduce_us": _time(a["reduce_us"]) if "reduce_us" in a else math.nan})
    return ShardedTables(
        stage=stage, stage_reason=str(sharding.get("stage_reason") or ""),
        framework=framework, units=units,
        segments=_frame(segs, SEGMENT_COLUMNS, ["rank", "step", "start_us"]),
        waits=_frame(waits, SEGMENT_COLUMNS, ["rank", "step", "start_us"]),
        colls=_frame(colls, COLL_COLUMNS, ["rank", "step", "start_us"]),
        memory=_frame(mem, MEMORY_COLUMNS, ["rank", "step", "ts_us"]),
        reduce_scatter_sent_as=sharding.get("reduce_scatter_sent_as"),
        forward_prefetch=_depth(sharding, "forward_prefetch", 0), backward_prefetch=_depth(sharding, "backward_prefetch", 1))


def _depth(sharding: dict, key: str, default: int) -> int | None:
    """A recorded prefetch depth: ``default`` where the trace predates it, None where it is null
    (no one depth), else a count (``ValueError`` on anything else)."""
    if key not in sharding:
        return default
    value = sharding[key]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"sharding.{key} {value!r} is not a number of units")
    return value


_TEXT = ("name", "phase", "at", "collective", "sent_as", "issued_by", "by", "first_param", "last_param",
         "bucket_numels", "unsharded_by_unit")


def _by_unit(value, n_units: int, total: int) -> dict[int, int] | None:
    """A memory sample's gathered bytes by unit (``[[unit, bytes], ...]``) as ``{unit:
    bytes}``; None where the sample has none (a trace before them). Raises ``ValueError``
    where it names a unit the run does not have, repeats one, or does not add up to the
    sample's ``unsharded_params_bytes``."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise ValueError(f"unsharded_by_unit {str(value)[:80]} is not a list of [unit, bytes] pairs")
    out = {}
    for unit, n in value:
        if isinstance(unit, bool) or not isinstance(unit, int) or not 0 <= unit < n_units or unit in out:
            raise ValueError(f"unsharded_by_unit names unit {unit!r} of {n_units} (or twice)")
        out[unit] = _count(n)
    if sum(out.values()) != total:
        raise ValueError(f"unsharded_by_unit adds up to {sum(out.values())} bytes, not the sample's {total}")
    return out


def _offloaded(value) -> dict[str, int] | None:
    """A memory sample's bytes kept in host memory by category (DeepSpeed's offload); None
    where the sample has none. Raises ``ValueError`` on a category the format does not
    have or a size that is not a count."""
    if value is None:
        return None
    if not isinstance(value, dict) or not set(value) <= set(fmt.MEMORY_CATEGORIES):
        raise ValueError(f"offloaded {str(value)[:80]} is not bytes by memory category")
    return {k: _count(n) for k, n in value.items()}


def _numels(value) -> tuple[int, ...] | None:
    """A bucket's parameter sizes (elements) as the trace lists them; None where it lists
    none or anything but counts (a trace before them, or a damaged one: the bucket is then
    shown but not re-cut)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**53 for n in value):
        return None
    return tuple(value)


def _frame(rows: list[dict], columns: list[str], order: list[str]) -> pd.DataFrame:
    if not rows:
        return pd.DataFrame({c: pd.Series(dtype="object" if c in _TEXT else "float64") for c in columns})
    return pd.DataFrame(rows, columns=columns).sort_values(order, kind="stable").reset_index(drop=True)


def real_steps(trace) -> set[int]:
    """The steps every table counts: those neither warm-up nor incomplete (every step
    where there are none)."""
    steps = trace.steps
    real = steps[~steps["warmup"].astype(bool) & ~steps["incomplete"].astype(bool)]["step"]
    return set(real.astype(int)) or set(steps["step"].astype(int))


def shard_group_size(trace) -> int:
    """The ranks a unit is sharded over: N, or under HSDP N / replicas."""
    u = trace.shards.units
    size = int(u["shard_size"].max()) if "shard_size" in u and len(u) else 0
    return size if size > 0 else trace.world_size


def params_and_trainable(trace) -> tuple[float, float]:
    """(P, P_t): the model's parameters (its units') and those that train (run.json's
    ``trainable_params``; all of them for a trace that does not say, or says a count
    outside 0..P)."""
    params = float(trace.shards.units["numel"].sum())
    trained = trace.run.get("trainable_params")
    ok = isinstance(trained, (int, float)) and not isinstance(trained, bool) and 0 <= trained <= params
    return params, float(trained) if ok else params


def replicas(trace) -> int:
    """HSDP's replicas (1: plain FSDP)."""
    u = trace.shards.units
    return int(u["replicate_size"].max()) if "replicate_size" in u and len(u) else 1
