"""Predict a sharded run under other FSDP2 settings, or a DeepSpeed run's peak at another
``reduce_bucket_size`` (``predict_deepspeed_peak``; its step: ``deepspeed_buckets``),
from one trace of it.

Memory: a measured step's samples (one per unit boundary) are replayed with which units
are gathered under the new ``reshard_after_forward`` and prefetch depths; everything
else the samples hold (shards, gradients, optimizer state, activations, buffers) is
kept as measured, since those settings do not change it. A unit is gathered from its
forward's start (or when a unit before it prefetches it) and, when it reshards after
forward, released at its forward's end (resharded to N ranks: 1/N of it kept until its
backward, FSDP's post-forward shard); in backward it is gathered again at its
backward's start (or prefetched by the unit before it in backward order: FSDP's
default depth is one) and released at its backward's end. On shard groups of one rank
(stage 0: nothing to gather) a prefetch allocates nothing: FSDP2 then copies a unit's
parameters into its unsharded storage in the unit's own wait (``wait_for_unshard``),
not at the prefetch's ``unshard``. The root keeps the setting it ran with. A unit the
script gathers or releases itself (its own ``unshard()``, ``set_reshard_after_backward``)
stays as measured where the samples say so (``predict_memory``). The result has the
columns of ``sharded.metrics.compute_memory_over_step``, so the same figure draws it.

Step time: on a backend that runs collectives on the training thread (gloo), a unit
that stays gathered from forward to backward saves its backward all-gather (and the
wait for it); one that reshards pays one as long as its forward all-gather. Prefetching
moves an all-gather earlier and hides nothing there. NCCL overlaps all-gathers with
compute: this model's step time is then an upper bound (said on the page).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from ddpscope.viz.sharded.deepspeed_buckets import predict_deepspeed_step_ms
from ddpscope.viz.sharded.deepspeed_states import measured_states, predict_states
from ddpscope.viz.sharded.exposed import exposed_per_step, with_exposed
from ddpscope.viz.sharded.metrics import (
    compute_memory_over_step,
    compute_sharded_steps,
    real_sharded_steps,
    reshard_setting,
)
from ddpscope.viz.sharded.trace import real_steps, shard_group_size
from ddpscope.viz.whatif.where_to_set import deepspeed_bucket_elements


def _reshards(setting: bool | int) -> bool:
    return setting is not False


def own_prefetch(trace) -> tuple[int, int]:
    """The prefetch depths (units ahead: forward, backward) the run's units ran with, which a
    rerun keeps unless told otherwise; FSDP's defaults (0, 1) where the script set per-unit
    lists that no one depth describes."""
    sh = trace.shards
    return (0 if sh.forward_prefetch is None else sh.forward_prefetch,
            1 if sh.backward_prefetch is None else sh.backward_prefetch)


def predict_memory(trace, rank: int, reshard_after_forward: bool | int | None = None,
                   forward_prefetch: int | None = None, backward_prefetch: int | None = None,
                   step: int | None = None) -> pd.DataFrame:
    """A measured step's memory samples with the gathered parameters replayed under the
    settings (None: the run's own, ``own_prefetch``); ``unsharded_params_bytes`` and
    ``total_bytes`` change, ``peak`` marks the new largest. Where the samples say which
    units held gathered parameters (``unsharded_by_unit``), a unit whose measured state at
    a sample is not what the replay at the run's own settings gives there is one the
    script gathered, kept or released itself (torchtitan's chunked loss ``unshard()``s its
    lm_head and keeps it through its chunks' backwards, then sets it back to resharding):
    it stays as measured at that sample under any setting, which no rerun's flag changes."""
    sh = trace.shards
    own = own_prefetch(trace)
    forward_prefetch = own[0] if forward_prefetch is None else forward_prefetch
    backward_prefetch = own[1] if backward_prefetch is None else backward_prefetch
    samples = compute_memory_over_step(trace, rank, step)
    if samples.empty:
        return samples
    replay = _replay(trace, samples, reshard_after_forward, forward_prefetch, backward_prefetch)
    measured_units = samples["unsharded_by_unit"].tolist() if "unsharded_by_unit" in samples else [None]
    split = replay  # a trace before the per-unit split: the replay alone
    if all(isinstance(m, dict) for m in measured_units):
        at_own = reshard_after_forward is None and (forward_prefetch, backward_prefetch) == own
        as_run = replay if at_own else _replay(trace, samples, None, *own)
        size = sh.units.set_index("unit")["unsharded_bytes"].to_dict()
        split = []
        for measured, ran, new in zip(measured_units, as_run, replay):
            now = {}
            for u in sorted(set(measured) | set(ran) | set(new)):
                held = measured.get(u, 0)
                # 0.5 %: FSDP pads each parameter to the group, the replay counts the unit's padded whole / N
                n = held if abs(held - ran.get(u, 0.0)) > 0.005 * size.get(u, 0) + 1 else new.get(u, 0.0)
                if n:
                    now[u] = n
            split.append(now)
    out = samples.copy()
    # what the measured sample held gathered at the same point is replaced by the replay
    measured = out["unsharded_params_bytes"].to_numpy()
    out["unsharded_by_unit"] = split
    out["unsharded_params_bytes"] = [sum(now.values()) for now in split]
    out["total_bytes"] = out["total_bytes"] - measured + out["unsharded_params_bytes"]
    out["peak"] = False
    out.loc[out["total_bytes"].idxmax(), "peak"] = True
    return out


def _replay(trace, samples: pd.DataFrame, reshard_after_forward: bool | int | None, forward_prefetch: int,
            backward_prefetch: int) -> list[dict[int, float]]:
    """Per sample, each unit's gathered parameters (bytes) under the settings, as FSDP2
    gathers and releases them (the module's docstring)."""
    units = trace.shards.units.set_index("unit")
    if shard_group_size(trace) == 1:  # no all-gather: a unit's copy-in is in its own wait, never a prefetch's
        forward_prefetch = backward_prefetch = 0
    size = units["unsharded_bytes"].to_dict()
    root = {int(u) for u in units.index[units["root"]]}
    reshard = {int(u): (bool(r) if isinstance(r, bool) else int(r)) if (reshard_after_forward is None or u in root)
               else reshard_after_forward for u, r in units["reshard_after_forward"].items()}
    forward_order = [int(u) for u in units.index if int(u) not in root]
    backward_order = forward_order[::-1]
    gathered: set[int] = set()
    kept: dict[int, float] = {}  # resharded to N ranks after forward: the 1/N shard each rank keeps
    replayed = []
    for row in samples.itertuples():
        unit, phase, at = int(row.unit), row.phase, row.at
        if at == "end" and unit >= 0:  # the sample is taken after FSDP's own post-hook
            setting = reshard.get(unit, True)
            if phase == "backward" or _reshards(setting):
                gathered.discard(unit)
            if phase == "forward" and not isinstance(setting, bool):
                kept[unit] = 1 / setting
        now = {u: float(size[u]) for u in gathered}
        for u, part in kept.items():
            now[u] = now.get(u, 0.0) + size[u] * part
        replayed.append(now)
        if at == "start" and unit >= 0:  # the unit (and what it prefetches) is gathered right after
            gathered.add(unit)
            if phase == "backward":  # its kept shard lives until its own gather is copied out (a prefetch
                kept.pop(unit, None)  # reads from it), at its backward's start
            order, depth = (forward_order, forward_prefetch) if phase == "forward" else (backward_order,
                                                                                          backward_prefetch)
            if unit in order and depth:
                k = order.index(unit)
                gathered.update(order[k + 1:k + 1 + depth])
            elif unit in root and phase == "backward" and depth and order:
                gathered.update(order[:depth])  # the root's backward prefetches the last unit
        if phase == "optimizer":
            gathered.clear()
            kept.clear()
    return replayed


def predict_peak(trace, **settings) -> pd.DataFrame:
    """Per rank: the measured peak and the predicted one under ``settings`` (bytes)."""
    rows = []
    for rank in sorted(trace.shards.memory["rank"].unique()):
        measured = compute_memory_over_step(trace, int(rank))
        pred = predict_memory(trace, int(rank), **settings)
        rows.append({"rank": int(rank), "measured_peak_bytes": float(measured["total_bytes"].max()),
                     "predicted_peak_bytes": float(pred["total_bytes"].max()),
                     "predicted_peak_where": str(pred.loc[pred["peak"], "where"].iloc[0])})
    return pd.DataFrame(rows)


def predict_step_ms(trace, reshard_after_forward: bool | int | None = None) -> pd.DataFrame:
    """Per rank: the measured median step (ms, non-warm-up steps) and the predicted one
    when every non-root unit reshards after forward (True / N) or not (False). A unit
    whose measured steps gather it again in backward where its setting says they would
    not, or not where it says they would, is run the script's own way (torchtitan's
    chunked loss sets its last unit, built not to reshard, to reshard at every step's
    end; a rerun's flag does not change that): its gathers stay as measured."""
    sh = trace.shards
    real = real_steps(trace)
    steps = real_sharded_steps(trace)
    colls = with_exposed(trace)
    colls = colls[colls["step"].isin(real) & (colls["collective"] == "all_gather")]
    waits = sh.waits[sh.waits["step"].isin(real)]
    segs = sh.segments[sh.segments["step"].isin(real)]
    # per unit, phase and rank, summed over its steps: the gathers and the waits for them as
    # time, less compute (the steps table's exposed)
    exposed = exposed_per_step(colls, waits, segs, by=("unit", "phase"))
    exposed = exposed.groupby(level=["unit", "phase", "rank"]).sum() if len(exposed) else exposed
    units = sh.units.set_index("unit")
    backward = colls[colls["phase"] == "backward"]
    regathered = set(zip(backward["unit"].astype(int), backward["rank"].astype(int)))
    rows = []
    for rank, mine in steps.groupby("rank"):
        delta = 0.0
        n_steps = max(1, mine["step"].nunique())
        for u, setting in units["reshard_after_forward"].items():
            if bool(units.loc[u, "root"]) or reshard_after_forward is None:
                continue
            if _reshards(setting) == _reshards(reshard_after_forward):
                continue
            if _reshards(setting) != ((int(u), int(rank)) in regathered):  # the script's own way: as measured
                continue
            fwd, bwd = (float(exposed.get((u, ph, rank), 0.0)) for ph in ("forward", "backward"))
            # resharding now: a backward all-gather as long as the forward one; kept: it is gone
            delta += (fwd if _reshards(reshard_after_forward) else -bwd) / n_steps
        measured = float(mine["step_ms"].median())
        rows.append({"rank": int(rank), "measured_step_ms": measured, "predicted_step_ms": max(0.0, measured + delta)})
    return pd.DataFrame(rows)


def predict_deepspeed_peak(trace, reduce_bucket_bytes: float) -> pd.DataFrame:
    """Per rank: the measured peak of its last measured step (``compute_memory_over_step``,
    as ``predict_peak`` reads one) and the peak predicted at another ``reduce_bucket_size``,
    given in bytes of the communication dtype (``reduce_bucket_bytes``). DeepSpeed allocates its
    gradient buckets (``ipg_buckets``, the trace's communication buffers) as
    ``reduce_bucket_size`` elements whatever the model's size, so at every sample of
    the step they scale by new / old and nothing else moves (measured: ZeRO-3 traced at
    20,000, 200,000 and 2,000,000 elements, the peak less the buffers the same to the
    byte; tests/viz/sharded/test_deepspeed_peak.py). Where the run holds no buffer at its
    samples (stages 1-2 without contiguous buffers) the peak stays. Columns: rank,
    measured_peak_bytes, predicted_peak_bytes (bytes). Raises ``ValueError`` where the
    run did not record its bucket size or ``reduce_bucket_bytes`` is not > 0."""
    now = (trace.run.get("deepspeed") or {}).get("reduce_bucket_bytes")
    if not isinstance(now, (int, float)) or now <= 0:
        raise ValueError("the run did not record DeepSpeed's reduce_bucket_size")
    if not (np.isfinite(reduce_bucket_bytes) and reduce_bucket_bytes > 0):
        raise ValueError(f"reduce_bucket_size must be > 0 bytes, got {reduce_bucket_bytes}")
    rows = []
    for rank in sorted(trace.shards.memory["rank"].unique()):
        step = compute_memory_over_step(trace, int(rank))
        comm = step["comm_buffers_bytes"].fillna(0.0)
        predicted = step["total_bytes"] - comm + comm * (reduce_bucket_bytes / now)
        rows.append({"rank": int(rank), "measured_peak_bytes": float(step["total_bytes"].max()),
                     "predicted_peak_bytes": float(predicted.max())})
    return pd.DataFrame(rows, columns=["rank", "measured_peak_bytes", "predicted_peak_bytes"])


def reshard_choices(trace) -> list[bool | int]:
    """The ``reshard_after_forward`` settings a rerun of this FSDP2 run can take, as the
    Run page offers them: True (ZeRO-3), False (ZeRO-2) and every rank count N that
    divides the shard group S between 2 and S - 1 (resharded to N ranks, a hybrid). S, not
    the world size: FSDP2 refuses an N that does not divide the shard group's size and
    reads N = S as True (``_get_post_forward_mesh_info``), which under HSDP (S = world /
    replicas) rules out some of the world's divisors and makes another the same as True."""
    shard = shard_group_size(trace)
    return [True, False, *(n for n in range(2, shard) if shard % n == 0)]


def setting_name(setting: bool | int | None) -> str:
    """A ``reshard_after_forward`` setting as the flag takes it (``ddpscope run
    --reshard-after-forward``): "true", "false", "N"; None: "as the script sets it"."""
    return "as the script sets it" if setting is None else str(setting).lower()


def compute_reshard_whatif(trace, settings: list[dict] | None = None) -> pd.DataFrame:
    """An FSDP2 run under other settings: one row per setting and rank, first this run as
    measured (``predicted`` False; its ``reshard_after_forward`` as ``reshard_setting``
    names it), then each of ``settings`` (``predict_peak`` and ``predict_step_ms`` keywords;
    default: ``reshard_choices`` at the run's own prefetch, ``own_prefetch``, which a rerun
    keeps; a setting's prefetch left out or None is that too) predicted. Columns:
    reshard_after_forward (text), forward_prefetch, backward_prefetch, rank, predicted,
    peak_bytes (bytes; NaN where the run measured no memory), step_ms (ms, median over
    non-warm-up steps; NaN where it finished none). The page's Run tab draws the same
    functions, so a row is the metric it shows for that choice."""
    if settings is None:
        settings = [{"reshard_after_forward": s} for s in reshard_choices(trace)]
    fwd, bwd = own_prefetch(trace)
    settings = [{**kw, "forward_prefetch": fwd if kw.get("forward_prefetch") is None else kw["forward_prefetch"],
                 "backward_prefetch": bwd if kw.get("backward_prefetch") is None else kw["backward_prefetch"]}
                for kw in settings]
    measured_memory = len(trace.shards.memory) > 0
    tables = [(predict_peak(trace, **kw).set_index("rank") if measured_memory else None,
               predict_step_ms(trace, kw.get("reshard_after_forward")).set_index("rank") if len(trace.steps) else None)
              for kw in settings]
    ranks = {int(r) for r in trace.shards.memory["rank"].unique()}
    if len(trace.steps):
        ranks |= {int(r) for r in compute_sharded_steps(trace)["rank"].unique()}
    # every prediction's table holds the run as measured too: the first row is read from the first
    first = {"reshard_after_forward": reshard_setting(trace), "forward_prefetch": fwd, "backward_prefetch": bwd}
    rows = []
    for kw, (peaks, steps), which in [(first, tables[0], "measured"),
                                      *((kw, t, "predicted") for kw, t in zip(settings, tables))]:
        name = kw["reshard_after_forward"] if which == "measured" else setting_name(kw.get("reshard_after_forward"))
        for rank in sorted(ranks):
            rows.append({"reshard_after_forward": name, "forward_prefetch": kw["forward_prefetch"],
                         "backward_prefetch": kw["backward_prefetch"], "rank": rank, "predicted": which != "measured",
                         "peak_bytes": at_rank(peaks, rank, f"{which}_peak_bytes"),
                         "step_ms": at_rank(steps, rank, f"{which}_step_ms")})
    return pd.DataFrame(rows, columns=["reshard_after_forward", "forward_prefetch", "backward_prefetch", "rank",
                                       "predicted", "peak_bytes", "step_ms"])


#: the reduce_bucket_size values (MiB) the Run page's slider and ``ddpscope whatif`` offer
#: for a DeepSpeed run, beside the run's own
DEEPSPEED_BUCKET_MIB = (0.25, 1.0, 4.0, 16.0, 64.0)
#: the model states a DeepSpeed rerun at another stage is predicted on (bytes per rank)
STATE_COLUMNS = ["params_bytes", "grads_bytes", "optimizer_state_bytes", "persistent_bytes", "host_persistent_bytes"]


def compute_deepspeed_stage_whatif(trace, stages=(1, 2, 3)) -> pd.DataFrame:
    """A DeepSpeed run's model states beside a rerun's at each of ``stages``: a row per
    rank as measured (``row`` "this run (stage S, rank r)", ``predicted`` False), then a
    row per stage predicted (``predict_states``; ``rank`` None). Columns: row, stage, rank,
    predicted and ``STATE_COLUMNS`` (bytes per rank)."""
    measured = measured_states(trace)
    rows = [{"row": f"this run (stage {trace.shards.stage}, rank {int(r['rank'])})", "stage": trace.shards.stage,
             "rank": int(r["rank"]), "predicted": False, **{k: float(r[k]) for k in STATE_COLUMNS}}
            for r in measured.to_dict("records")]
    for stage in stages:
        pred = predict_states(trace, stage, measured)
        rows.append({"row": f"stage {stage}, predicted", "stage": stage, "rank": None, "predicted": True,
                     **{k: float(pred[k]) for k in STATE_COLUMNS}})
    return pd.DataFrame(rows, columns=["row", "stage", "rank", "predicted", *STATE_COLUMNS])


def compute_deepspeed_bucket_whatif(trace, bucket_mib: list[float]) -> pd.DataFrame:
    """A DeepSpeed run at other ``reduce_bucket_size`` values (MiB of the communication
    dtype), at its own stage: one row per size and rank, first the run's own size as
    measured (``predicted`` False), then each other size of ``bucket_mib``. Columns:
    reduce_bucket_MiB, reduce_bucket_size (what the DeepSpeed config takes: elements of the
    communication dtype; None where the run did not record it), rank, predicted,
    peak_bytes (bytes, ``predict_deepspeed_peak``; NaN where the run measured no memory),
    buckets (reductions a step) and step_ms (ms, median over real steps;
    ``deepspeed_buckets.predict_deepspeed_step_ms``; NaN where the trace lists no bucket
    sizes). ``ValueError`` where the run did not record its bucket size."""
    now = (trace.run.get("deepspeed") or {}).get("reduce_bucket_bytes")
    if not isinstance(now, (int, float)) or now <= 0:
        raise ValueError("the run did not record DeepSpeed's reduce_bucket_size")
    measured_memory = len(trace.shards.memory) > 0
    sizes = [now / 2**20, *(m for m in dict.fromkeys(float(m) for m in bucket_mib) if m * 2**20 != now)]
    rows = []
    for k, mib in enumerate(sizes):
        which = "predicted" if k else "measured"
        peaks = predict_deepspeed_peak(trace, mib * 2**20).set_index("rank") if measured_memory else None
        steps = predict_deepspeed_step_ms(trace, mib).set_index("rank")
        ranks = sorted(set(steps.index) | (set(peaks.index) if peaks is not None else set()))
        for rank in ranks:
            rows.append({"reduce_bucket_MiB": mib,
                         "reduce_bucket_size": deepspeed_bucket_elements(trace.run, mib),  # the config's unit
                         "rank": int(rank), "predicted": bool(k),
                         "peak_bytes": at_rank(peaks, rank, f"{which}_peak_bytes"),
                         "buckets": at_rank(steps, rank, f"{which}_buckets"),
                         "step_ms": at_rank(steps, rank, f"{which}_step_ms")})
    return pd.DataFrame(rows, columns=["reduce_bucket_MiB", "reduce_bucket_size", "rank", "predicted", "peak_bytes",
                                       "buckets", "step_ms"])


def at_rank(table: pd.DataFrame | None, rank: int, column: str) -> float:
    """``table.loc[rank, column]`` (a table indexed by rank) as a float, NaN where there is
    no such row or no table."""
    if table is None or rank not in table.index:
        return float("nan")
    return float(table.loc[rank, column])
