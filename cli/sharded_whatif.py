"""``ddpscope whatif RUN`` on a sharded run: the predictions the dashboard's Run page makes,
every choice at once, from the same functions (``viz.sharded.predict``), so the command
and the page read the same numbers.

- FSDP2: the peak and the step at each ``reshard_after_forward`` a rerun can take (or
  the one named with ``--reshard-after-forward`` and the prefetch flags);
- DeepSpeed: the model states a rerun at ZeRO stage 1, 2 and 3 would keep, and the peak,
  the buckets and the step at other ``reduce_bucket_size`` values (``--caps``, MiB, as
  ``ddpscope run --bucket-cap-mb`` sets it).

Each table prints rank 0 (the page's metric) and the largest rank; ``--json`` gives
every rank. ``ValueError`` naming the flag on a flag the run's kind does not take
(``--apply``: ``whatif_apply.py`` refuses it with ``apply_refusal``, from run.json).
"""

from __future__ import annotations

import json
import math

import pandas as pd

from ddpscope.tracer.capture.sharded.settings import parse_reshard
from ddpscope.tracer.options import (
    BACKWARD_PREFETCH,
    FORWARD_PREFETCH,
    RESHARD_AFTER_FORWARD,
    WHATIF_APPLY,
    WHATIF_CAP_LIST,
    WHATIF_CAPS,
    parse_caps,
)

MIB = 2**20
STEP_NOTE = ("step: the gathers a setting adds or saves, at the run's own speed; gloo runs collectives on the "
             "training thread, so all of that is exposed; on NCCL they overlap compute and the step is an upper bound")

HYBRID_STEP_NOTE = ("step resharded to N ranks: as true's (its backward all-gathers run within N ranks, but on gloo they "
                    "did not shrink by the bytes they no longer move: docs/sharded.md)")


def sharded_whatif(trace, args) -> int:
    """Print (or ``--json``) the predictions for a sharded run; returns the exit code."""
    if getattr(args, "cap_list", None) is not None:
        raise ValueError(f"{WHATIF_CAP_LIST.flag} is DDP's bucket_cap_mb_list; a sharded run has no such layout")
    if trace.shards.framework == "deepspeed":
        return _deepspeed(trace, args)
    return _fsdp2(trace, args)


def fsdp2_settings(args) -> list[dict] | None:
    """The settings the flags name (None: every choice at the run's own prefetch)."""
    reshard, fwd, bwd = (getattr(args, k, None) for k in ("reshard_after_forward", "forward_prefetch",
                                                            "backward_prefetch"))
    if reshard is None and fwd is None and bwd is None:
        return None
    for option, value in ((RESHARD_AFTER_FORWARD, reshard), (FORWARD_PREFETCH, fwd), (BACKWARD_PREFETCH, bwd)):
        option.validate(value)
    return [{"reshard_after_forward": parse_reshard(reshard), "forward_prefetch": fwd,  # None: the run's own
             "backward_prefetch": bwd}]


def refuse_fsdp2_flags(args, why: str) -> None:
    """``ValueError`` naming the first FSDP2 flag given for a run that is not FSDP2's."""
    for option in (RESHARD_AFTER_FORWARD, FORWARD_PREFETCH, BACKWARD_PREFETCH):
        if getattr(args, option.flag.lstrip("-").replace("-", "_"), None) is not None:
            raise ValueError(f"{option.flag} predicts an FSDP2 run; {why}")


def _fsdp2(trace, args) -> int:
    from ddpscope.viz.sharded.metrics import sharded_step_noise_ms
    from ddpscope.viz.sharded.predict import compute_reshard_whatif, reshard_choices
    from ddpscope.viz.sharded.trace import shard_group_size
    from ddpscope.viz.whatif.where_to_set import reshard_in_code

    if getattr(args, "caps", None) is not None:
        raise ValueError(f"{WHATIF_CAPS.flag} sets a bucket size; an FSDP2 run reduce-scatters per unit: "
                         f"predict it with {RESHARD_AFTER_FORWARD.flag} and the prefetch flags")
    world = trace.world_size
    settings = fsdp2_settings(args)  # ValueError naming the flag
    hybrids = [c for c in reshard_choices(trace) if not isinstance(c, bool)]  # not `in`: 1 == True
    shard = shard_group_size(trace)  # FSDP2's N divides the shard group, not the world (HSDP: world / replicas)
    group = f"the run's {world} ranks" if shard == world else f"the {shard} ranks each unit is sharded over"
    for kw in settings or ():
        n = kw["reshard_after_forward"]
        if not isinstance(n, bool) and n is not None and n not in hybrids:
            raise ValueError(f"{RESHARD_AFTER_FORWARD.flag} N must divide {group}, between 2 and "
                             f"{shard - 1} (FSDP2's rule: 1 is false, {shard} is true), got {n}" if hybrids else
                             f"{RESHARD_AFTER_FORWARD.flag} on a run whose units are sharded over {shard} rank"
                             f"{'s' if shard != 1 else ''} is true or false (FSDP2 takes N as a factor of them "
                             f"between 2 and {shard} - 1: there is none), got {n}")
    table = compute_reshard_whatif(trace, settings)
    keys = ["reshard_after_forward", "forward_prefetch", "backward_prefetch", "predicted"]
    noise = sharded_step_noise_ms(trace)
    in_code = reshard_in_code(trace.run) if shard > 1 else None  # sharded over 1 rank: nothing to reshard
    if args.json:
        return _print_json(trace, {"settings": _records(table), "step_noise_ms": _finite(noise), "in_code": in_code})
    print(f"{trace.path}  ranks={world}  FSDP2, ZeRO stage {trace.shards.stage}  (first row: this run, measured; "
          "the others predicted from it)")
    print(_rank0_and_largest(table, keys, {"peak_bytes": ("peak_MiB", MIB, "max"),
                                           "step_ms": ("step_ms", 1.0, "median")}).to_string(index=False,
                                                                                              na_rep="-"))
    if not len(trace.shards.memory):
        print("  peak: this run measured no step's memory: no peak is predicted")
    if not len(trace.steps):
        print("  step: this run finished no step: no step time is predicted")
    print("  peak_MiB, step_ms: rank 0's (the dashboard's Run page); largest_peak_MiB: the largest rank's; "
          "step_ms_median: over ranks; memory: which units are gathered when, the rest as measured")
    print(f"  {STEP_NOTE}")
    if hybrids:
        print(f"  {HYBRID_STEP_NOTE}")
    print(f"  {noise_line(noise)}")
    if in_code:
        print(f"  {in_code}")
    reshard = "|".join(["true", "false", *map(str, hybrids)])
    print(f"rerun one: {rerun_hint(trace.shards.framework, trace.run, reshard)}")
    return 0


def _deepspeed(trace, args) -> int:
    from ddpscope.viz.sharded.deepspeed_buckets import bucket_cost, cost_in_words
    from ddpscope.viz.sharded.metrics import sharded_step_noise_ms
    from ddpscope.viz.sharded.predict import (
        DEEPSPEED_BUCKET_MIB,
        STATE_COLUMNS,
        compute_deepspeed_bucket_whatif,
        compute_deepspeed_stage_whatif,
    )

    refuse_fsdp2_flags(args, f"a DeepSpeed run's settings are its ZeRO stage and reduce_bucket_size "
                             f"({WHATIF_CAPS.flag}, MiB)")
    caps = parse_caps(args.caps) if args.caps is not None else list(DEEPSPEED_BUCKET_MIB)
    states = compute_deepspeed_stage_whatif(trace)
    recorded = (trace.run.get("deepspeed") or {}).get("reduce_bucket_bytes")
    sizes = compute_deepspeed_bucket_whatif(trace, caps) if recorded else None
    why = None if recorded else "this run did not record DeepSpeed's reduce_bucket_size: nothing is predicted at another"
    cost = bucket_cost(trace) if recorded else None
    noise = sharded_step_noise_ms(trace)
    if args.json:
        return _print_json(trace, {"stages": _records(states),
                                   "bucket_sizes": [] if sizes is None else _records(sizes), "no_bucket_sizes": why,
                                   "bucket_cost": None if cost is None else cost_in_words(cost, trace.path),
                                   "step_noise_ms": _finite(noise)})
    size = f"reduce_bucket_size {recorded / MIB:.4g} MiB" if recorded else "reduce_bucket_size not recorded"
    print(f"{trace.path}  ranks={trace.world_size}  DeepSpeed ZeRO stage {trace.shards.stage}  {size}")
    print("model states a rerun at each stage would keep (MiB per rank):")
    view = states.drop(columns=["stage", "rank", "predicted"])
    for k in STATE_COLUMNS:
        view[k.removesuffix("_bytes") + "_MiB"] = view.pop(k) / MIB
    print(view.round(3).to_string(index=False))
    print("  persistent: parameters, the fp32 master and Adam's moments; gradients live in buffers sized by the "
          "bucket layout" + ("; host_persistent: what of them ZeRO-Offload keeps in host memory (the script's "
                             "offload, kept by a rerun)" if states["host_persistent_bytes"].any() else ""))
    if sizes is None:
        print(f"at another reduce_bucket_size: {why}")
    else:
        print(f"at other reduce_bucket_size values, at stage {trace.shards.stage} (first row: this run, measured; "
              "buckets: reductions a step):")
        print(_rank0_and_largest(sizes, ["reduce_bucket_MiB", "reduce_bucket_size", "predicted"],
                                 {"peak_bytes": ("peak_MiB", MIB, "max"), "buckets": ("buckets", 1, "max"),
                                  "step_ms": ("step_ms", 1.0, "max")}).round(4).to_string(index=False))
        mem = trace.shards.memory
        held = len(mem) and mem["comm_buffers_bytes"].fillna(0).max() > 0
        print("  peak: " + ("this run recorded no memory: not predicted" if not len(mem) else
                            "DeepSpeed allocates its gradient buckets whole (reduce_bucket_size elements): they scale, "
                            "nothing else moves" + ("" if held else "; this run's memory samples hold no bucket, so "
                                                    "the peak stays at any size")))
        print("  step: " + ("this trace lists no bucket's parameter sizes (traced before ddpscope recorded them): "
                            "not predicted" if cost is None else
                            "the buckets cut again from the order ZeRO took the gradients in (exact); the step a model (its "
                            "accuracy: docs/sharded.md#predictions), each reduction costed at "
                            f"{cost_in_words(cost, trace.path)}"))
        print(f"  {noise_line(noise)}")
        dtype = (trace.run.get("deepspeed") or {}).get("communication_dtype") or "the communication dtype"
        print(f"  in your code: the DeepSpeed config's zero_optimization.reduce_bucket_size, in elements of {dtype} "
              "(the reduce_bucket_size column); `--bucket-cap-mb MIB` sets it for a traced rerun only")
    print("  a rerun at another stage is predicted in memory only: the rerun measures its step")
    print(f"rerun one: {rerun_hint(trace.shards.framework, trace.run)}")
    return 0


def _rank0_and_largest(table: pd.DataFrame, keys: list[str], values: dict) -> pd.DataFrame:
    """One row per setting (``keys``, in the table's order): each value column's rank 0
    (``name``) and over ranks (``largest_name`` for max, ``name_median`` for median),
    scaled by 1 / ``scale``."""
    rows = []
    for key, group in table.groupby(keys, sort=False, dropna=False):
        row = dict(zip(keys, key))
        row = {"": "predicted" if row.pop("predicted") else "measured", **row}
        first = group[group["rank"] == 0]
        for column, (name, scale, over) in values.items():
            row[name] = float(first[column].iloc[0]) / scale if len(first) else math.nan
            if over == "max":
                row[f"largest_{name}"] = float(group[column].max()) / scale
            else:
                row[f"{name}_median"] = float(group[column].median()) / scale
        rows.append(row)
    return pd.DataFrame(rows).round(3)


def noise_line(noise_ms: float) -> str:
    """The run's step noise in words (``sharded_step_noise_ms``)."""
    if not math.isfinite(noise_ms):
        return "noise: this run has fewer than 2 real steps: how far a rerun may land from it is not known"
    from ddpscope.viz.sharded.metrics import STEP_NOISE_MEANING

    return f"noise: a predicted step within ±{noise_ms:.1f} ms of this run's cannot be told from it ({STEP_NOISE_MEANING})"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _records(table: pd.DataFrame) -> list[dict]:
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()}
            for r in table.astype(object).to_dict("records")]


def _print_json(trace, body: dict) -> int:
    print(json.dumps({"path": str(trace.path), "kind": "sharded", "framework": trace.shards.framework,
                      "world_size": trace.world_size, "stage": trace.shards.stage, **body},
                     indent=1, default=lambda v: v.item() if hasattr(v, "item") else str(v)))
    return 0


def apply_refusal(framework: str | None, run: dict | None = None) -> str:
    """Why ``--apply`` does not take a sharded run, and how to rerun it."""
    return f"{WHATIF_APPLY.flag} reruns DDP runs; rerun this one with the setting you choose: " \
           f"{rerun_hint(framework, run)}"


#: the flags of ``ddpscope run`` a sharded rerun sets again, with how many values each takes
_RESET = {"--out": 1, "--zero-stage": 1, "--bucket-cap-mb": 1, RESHARD_AFTER_FORWARD.flag: 1,
          FORWARD_PREFETCH.flag: 1, BACKWARD_PREFETCH.flag: 1}


def rerun_hint(framework: str | None, run: dict | None = None, reshard: str = "true|false|N") -> str:
    """The command that reruns a sharded run at another setting: the run's own ``ddpscope
    run`` line (run.json's ``command``) with the setting's flags in place of its own, or a
    template where the run did not record one; and the page that does it. ``reshard``: the
    ``reshard_after_forward`` values an FSDP2 rerun can take, as the line writes them."""
    flags = ["--zero-stage", "S", "--bucket-cap-mb", "MIB"] if framework == "deepspeed" else \
        [RESHARD_AFTER_FORWARD.flag, reshard]
    words = _command_words((run or {}).get("command"))
    if words is None:
        line = " ".join(["ddpscope run", *flags, "--out DIR -- SCRIPT"])
    else:
        head, script = words
        line = " ".join([*head, *flags, "--out", "DIR", "--", *script])
    return f"`{line}`, or the dashboard's Run tab (its Compare table sets the rerun beside this run)"


def _command_words(command) -> tuple[list[str], list[str]] | None:
    """``ddpscope run`` options (less those a rerun sets again) and the script's words,
    from run.json's ``command``; None where it is not such a line."""
    import shlex

    try:
        words = shlex.split(command) if isinstance(command, str) else None
    except ValueError:
        return None
    if not words or words[:2] != ["ddpscope", "run"] or "--" not in words:
        return None
    at = words.index("--")
    head, script, k = [], words[at + 1:], 0
    options = words[:at]
    while k < len(options):
        word = options[k]
        name = word.split("=", 1)[0]
        if name in _RESET:
            k += 1 + (_RESET[name] if "=" not in word else 0)
            continue
        head.append(shlex.quote(word))
        k += 1
    return head, [shlex.quote(w) for w in script]
