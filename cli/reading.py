"""The reading commands: ``ddpscope summary PATH [--json]``, the figures of a run folder;
``ddpscope whatif PATH`` (``viz.whatif.report``; a sharded run's: ``sharded_whatif.py``); ``ddpscope perfetto PATH --out FILE``,
every rank in one Perfetto trace (``viz.perfetto``); ``ddpscope merge``.

- a DDP run: per rank, medians over non-warm-up steps: step, forward, backward compute,
  optimizer, all-reduce busy time, overlapped and exposed communication (ms), overlap %;
- a ring run: per tensor size, the ring beside ``dist.all_reduce`` (ms, GB/s);
- a ZeRO run: per stage and rank, measured model states beside the ZeRO model, the
  step's peak and the bytes sent (bytes).

Exit 2 with a one-line message on bad input.
"""

from __future__ import annotations

import json
import math
import os
import sys


def add_viz_commands(sub) -> None:
    """``summary`` and ``perfetto`` on a subparsers object (the ``ddpscope`` command's too)."""
    s = sub.add_parser("summary", help="per-rank medians over non-warm-up steps",
                       description="The figures of a run folder: a DDP run's per-rank medians, a ring or ZeRO "
                                   "run's summary table.")
    s.add_argument("path", help="a run folder (run.json + rank-<r>.json)")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    w = sub.add_parser("whatif", help="predict a run at other settings (DDP: bucket_cap_mb; FSDP2, DeepSpeed)",
                       description="Replay a traced DDP run's steps with the buckets DDP would build at other "
                                   "bucket_cap_mb values (MiB) and print predicted step time and exposed "
                                   "communication per cap; then search uniform caps and per-bucket "
                                   "bucket_cap_mb_list layouts for the least predicted step time and recommend one "
                                   "when its gain exceeds the run's own noise. --apply reruns the script with it. "
                                   "Uses the run's calibration.json when `ddpscope calibrate` made one. "
                                   "A sharded run: the dashboard's Run-page predictions, every choice (FSDP2: peak "
                                   "and step per reshard_after_forward; DeepSpeed: model states per ZeRO stage, "
                                   "peak per reduce_bucket_size).")
    w.add_argument("path", help="a traced run folder (DDP, FSDP2 or DeepSpeed)")
    from ddpscope.tracer.options import (
        BACKWARD_PREFETCH,
        FORWARD_PREFETCH,
        RESHARD_AFTER_FORWARD,
        WHATIF_APPLY,
        WHATIF_CAP_LIST,
        WHATIF_CAPS,
        WHATIF_OUT,
    )

    w.add_argument(WHATIF_CAPS.flag, dest="caps", help=WHATIF_CAPS.help, metavar=WHATIF_CAPS.metavar)
    w.add_argument(WHATIF_CAP_LIST.flag, dest="cap_list", help=WHATIF_CAP_LIST.help, metavar=WHATIF_CAP_LIST.metavar)
    w.add_argument(WHATIF_APPLY.flag, dest="apply", action="store_true", help=WHATIF_APPLY.help)
    w.add_argument(WHATIF_OUT.flag, dest="apply_out", help=WHATIF_OUT.help, metavar=WHATIF_OUT.metavar)
    for option in (RESHARD_AFTER_FORWARD, FORWARD_PREFETCH, BACKWARD_PREFETCH):  # an FSDP2 run's what-if
        w.add_argument(option.flag, type=option.type, help=option.help.replace("scripts:", "runs: predict with"),
                       metavar=option.metavar)
    w.add_argument("--json", action="store_true", help="print JSON instead of a table")
    m = sub.add_parser("perfetto", help="merge a run's rank files into one Perfetto trace on rank 0's clock")
    m.add_argument("path", help="a run folder (run.json + rank-<r>.json)")
    m.add_argument("--out", required=True, help="the merged trace to write (a new .json file)")
    j = sub.add_parser("merge", help="join the folders the nodes of one multi-node run wrote apart into one run",
                       description="Join the run folders that the nodes of one multi-node `ddpscope run` wrote "
                                   "apart (each node given its own --out) into one run folder: every node and "
                                   "rank once, node 0's run.json. Nothing is changed in the node folders.")
    j.add_argument("folders", nargs="+", metavar="FOLDER", help="every node's run folder")
    j.add_argument("--out", required=True, help="the merged run folder to make (new)")


def run_viz_command(args, prog: str) -> int:
    """Run ``summary``, ``whatif`` or ``perfetto``; one line and exit 2 on bad input."""
    from ddpscope.viz.trace import TraceError

    try:
        if args.command == "merge":
            from ddpscope.viz.sources.merge import merge_runs

            print(merge_runs(args.folders, args.out))
            code = 0
        elif args.command == "perfetto":
            from ddpscope.viz.perfetto import write_merged

            size = write_merged(args.path, args.out)
            print(f"{args.out} ({size / 2**20:.2f} MiB): open it at https://ui.perfetto.dev")
            code = 0
        elif args.command == "whatif" and _is_sharded(args.path):  # the Run page's predictions, every choice
            from ddpscope.cli.sharded_whatif import sharded_whatif
            from ddpscope.viz.trace import load_run

            code = sharded_whatif(load_run(args.path), args)
        elif args.command == "whatif":
            from ddpscope.cli.sharded_whatif import refuse_fsdp2_flags
            from ddpscope.viz.whatif.report import whatif_report

            refuse_fsdp2_flags(args, "a DDP run's setting is its bucket layout (--caps, --cap-list)")

            code, _ = whatif_report(args.path, args.caps, args.json, getattr(args, "cap_list", None))
        else:
            code = _summary(args.path, args.json)
        sys.stdout.flush()  # here, where a reader that left (a pipe) is caught, not at exit
        return code
    except (TraceError, ValueError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `ddpscope whatif RUN | head`: the reader left early; nothing went wrong here
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0
    except OSError as e:  # a folder that cannot be read or written (the merge leaves nothing half-made)
        print(f"{prog}: error: {e.strerror or e}: {e.filename or ''}", file=sys.stderr)
        return 2


def _is_sharded(path: str) -> bool:
    from ddpscope.viz.sources import folder_kind

    return folder_kind(path) == "sharded"


#: ``summary`` prints a row per rank up to this many ranks (and reads their events)
TABLE_RANKS = 16


def _summary(path: str, as_json: bool) -> int:
    from ddpscope.viz.ddp.overlap import compute_rank_medians
    from ddpscope.viz.sources import folder_kind, load_training_trace
    from ddpscope.viz.sources.rank_events import with_events

    kind = folder_kind(path)
    if kind in ("ring", "zero"):
        return _summary_table(path, kind, as_json)
    trace = load_training_trace(path, events_for=())  # summary first: every rank's steps, no events
    if trace.source == "ddpscope" and trace.world_size <= TABLE_RANKS:  # a few ranks: their buckets too
        trace = with_events(trace, trace.ranks, missing_ok=True)  # a folder may hold summaries only
    if trace.shards is not None:
        return _sharded_summary(trace, as_json)
    med = compute_rank_medians(trace)
    hta = None
    if trace.source == "kineto":
        from ddpscope.viz.ddp.kernel_overlap import compute_hta_breakdown

        hta = compute_hta_breakdown(trace)
    stragglers = line = None
    if trace.source == "ddpscope" and trace.all_events:  # who each bucket waited for: every rank's buckets
        from ddpscope.viz.ddp.stragglers import compute_straggler_summary, straggler_line

        stragglers = compute_straggler_summary(trace)
        line = straggler_line(stragglers)
    slow = None
    if trace.world_size > 2:  # every rank at once (viz.ddp.rank_overview): who holds the others back
        from ddpscope.viz.ddp.rank_overview import compute_rank_overview, compute_slow_ranks, slow_rank_line

        slow = compute_slow_ranks(compute_rank_overview(trace))
        line = "\n".join(x for x in (line, slow_rank_line(slow)) if x) or None
    zero1 = _zero1_summary(trace) if trace.source == "ddpscope" else None
    own = None
    if trace.source == "ddpscope":  # the step's collectives that are not buckets
        from ddpscope.viz.ddp.own_collectives import compute_own_collectives

        own = compute_own_collectives(trace)
    buckets = None
    if trace.source == "ddpscope" and len(trace.buckets):  # each bucket's all-reduce (the events of the ranks read)
        from ddpscope.viz.ddp.buckets import compute_bucket_table

        buckets = compute_bucket_table(trace)
    models = trace.run.get("models") or []  # a job of several DDP models: each its own run folder
    if as_json:
        out = {"path": str(trace.path), "source": trace.source, "status": trace.status,
               "unfinished": trace.unfinished, "world_size": trace.world_size, "bucket_cap_mb": trace.run.get("bucket_cap_mb"),
               "ranks": _by_rank(med)}
        if stragglers is not None:
            out["stragglers"] = _by_rank(stragglers)
        if slow is not None:
            out["slow_ranks"] = [_json_safe(r) for r in slow.astype(object).to_dict("records")]
        if zero1:
            out["zero1"] = zero1
        if own is not None and len(own):
            out["not_buckets"] = [_json_safe(r) for r in own.to_dict("records")]
        if buckets is not None and len(buckets):
            out["buckets"] = [_json_safe(r) for r in buckets.astype(object).to_dict("records")]
        if models:
            out["models"] = models
        if isinstance(trace.run.get("torch_compile"), dict):
            out["torch_compile"] = trace.run["torch_compile"]
        if isinstance(trace.run.get("grad_marks_every"), int):
            out["grad_marks_every"] = trace.run["grad_marks_every"]
        if hta is not None:
            out.update(ranks_present=trace.run["ranks_present"], hta=_by_rank(hta), clock=trace.run["clock"],
                       notes=trace.run["notes"])
        print(json.dumps(out, indent=1, default=float))
        return 0
    if hta is None:
        compiled = trace.run.get("torch_compile")
        compiled = f"  torch.compile'd (optimize_ddp={compiled.get('optimize_ddp')})" if isinstance(compiled, dict) else ""
        every = trace.run.get("grad_marks_every")
        marks = f"  gradient marks on 1 step in {every}" if isinstance(every, int) and every > 1 else ""
        print(f"{trace.path}  status={trace.status}  ranks={trace.world_size}  "
              f"bucket_cap_mb={_mib(trace.run.get('bucket_cap_mb'))}{compiled}{marks}  "
              "(medians over non-warm-up steps, ms)")
        if trace.unfinished:
            print(f"{trace.status}: {trace.unfinished}")
    else:
        print(f"{trace.path}  profiler trace, ranks {trace.run['ranks_present']} of {trace.world_size}  "
              "(medians over ProfilerSteps, ms)")
    if len(med) > TABLE_RANKS:  # a thousand rows say less than their spread and the slowest ranks
        spread = med.drop(columns=["rank"]).quantile([0.0, 0.5, 0.9, 1.0]).rename(index=lambda q: f"p{q * 100:g}")
        print(f"over the {len(med)} ranks (min p0, median p50, p90, max p100 of the ranks' medians):")
        print(spread.round(2).to_string())
        if slow is not None and len(slow):
            print("the ranks that held the others back most:")
            print(slow.head(5).round(2).to_string(index=False))
    else:
        print(med.round(2).to_string(index=False) if len(med) else "no finished non-warm-up steps")
    if line:
        print(line)
    if len(models) > 1:
        others = ", ".join(f"{m['model']} ({trace.path / m['folder']})" for m in models[1:])
        print(f"this job trained {len(models)} DDP models: this folder holds {models[0]['model']}'s; "
              f"each other has a run folder of its own: {others}")
    if zero1:
        print(f"ZeRO-1 (ZeroRedundancyOptimizer): parameter broadcast {zero1['param_sync_ms']:.2f} ms a step "
              f"(median, {zero1['pct_of_step']:.1f} % of the step; the step waits for all of it), "
              f"{zero1['bytes'] / 2**20:.3f} MiB")
        for text in zero1["volume"]:
            print("  " + text)
    if buckets is not None and len(buckets):
        ranks = "every rank" if trace.all_events else f"ranks {', '.join(map(str, sorted(trace.event_ranks)))}"
        print(f"buckets (medians over {ranks} and non-warm-up steps; launch_offset_ms from backward's start; "
              "queued_ms behind earlier buckets, run_ms running):")
        print(buckets.drop(columns=["params"]).round(3).to_string(index=False))
    if own is not None and len(own):
        from ddpscope.viz.ddp.own_collectives import own_collectives_lines

        print("collectives outside the buckets:")
        for text in own_collectives_lines(own):
            print("  " + text)
    if hta is not None:
        print("as Holistic Trace Analysis computes them (last ProfilerStep left out; %):")
        print(hta[["rank", "comp_comm_overlap_pct", "idle_pct", "compute_pct", "non_compute_pct",
                   "ddpscope_overlap_pct", "hta_rounded"]].round(2)
              .to_string(index=False))
        for note in trace.run["notes"]:
            print(f"  note: {note}")
    return 0


def _zero1_summary(trace) -> dict | None:
    """A ZeRO-1 run's parameter broadcasts (medians over non-warm-up steps) and its
    communication volume in words; None for plain DDP."""
    from ddpscope.viz.ddp.stages import ddp_comm_lines, ddp_stage, param_sync_medians

    if ddp_stage(trace).get("stage") != 1:
        return None
    sync = param_sync_medians(trace)
    if sync is None:
        return None
    return {"param_sync_ms": sync["sync_ms"], "pct_of_step": sync["pct_of_step"], "bytes": sync["bytes"],
            "volume": ddp_comm_lines(trace)[1:]}


def _by_rank(table) -> dict:
    return {str(int(r["rank"])): _json_safe({k: v for k, v in r.items() if k != "rank"})
            for r in table.astype(object).to_dict("records")}


def _json_safe(row: dict) -> dict:
    """NaN (no communication: no overlap %) as null: JSON has no NaN."""
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}


def _sharded_summary(trace, as_json: bool) -> int:
    """A sharded run: per-step medians, the units, the ZeRO stage's model states and what
    was really sent (gloo's reduce-scatter is an all-reduce)."""
    from ddpscope.viz.sharded.buckets import compute_bucket_table
    from ddpscope.viz.sharded.comm_volume import comm_honesty_lines, compute_comm_volume
    from ddpscope.viz.sharded.metrics import (
        NO_UNIT,
        UNTIMED_UNITS,
        active_units,
        compute_no_unit_table,
        compute_sharded_steps,
        compute_stage_comparison,
        compute_unit_table,
        idle_units_line,
        stage_differences,
    )

    steps = compute_sharded_steps(trace)
    real = steps[~steps["warmup"] & ~steps["incomplete"]]
    med = real.drop(columns=["step", "warmup", "incomplete"]).groupby("rank").median().reset_index()
    units, stages, volume = compute_unit_table(trace), compute_stage_comparison(trace), compute_comm_volume(trace)
    no_unit = compute_no_unit_table(trace)
    sh = trace.shards
    buckets = compute_bucket_table(trace)
    notes = stage_differences(trace)  # why the model states differ from the ZeRO model's
    framework = "DeepSpeed" if sh.framework == "deepspeed" else "FSDP2"
    if as_json:
        out = {"path": str(trace.path), "source": trace.source, "kind": "sharded", "framework": sh.framework,
               "status": trace.status, "deepspeed": trace.run.get("deepspeed"), "buckets": buckets.to_dict("records"),
               "unfinished": trace.unfinished, "world_size": trace.world_size, "stage": sh.stage,
               "stage_reason": sh.stage_reason, "ranks": _by_rank(med),
               "units": [_json_safe(r) for r in units.astype(object).to_dict("records")],
               "no_unit": [_json_safe(r) for r in no_unit.to_dict("records")],
               "model_states": stages.to_dict("records"), "model_state_notes": notes,
               "comm_volume": volume.to_dict("records"),
               "comm_D_bytes": volume.attrs["D_bytes"], "comm": comm_honesty_lines(trace)}
        print(json.dumps(out, indent=1, default=lambda v: None if v != v else float(v)))
        return 0
    print(f"{trace.path}  status={trace.status}  ranks={trace.world_size}  {framework} units={len(sh.units)}  "
          f"ZeRO stage {sh.stage}  (medians over non-warm-up steps, ms; peak bytes)")
    if trace.unfinished:
        print(f"{trace.status}: {trace.unfinished}")
    print(med.round(2).to_string(index=False) if len(med) else "no finished non-warm-up steps")
    print("per unit (ms per step, bytes per step):")
    hsdp = ["all_reduce_bytes", "all_reduce_ms"] if "all_reduce_ms" in units else []  # HSDP's, no unit's
    active = active_units(units)
    print(active[["unit", "params", "all_gathers", "all_gather_bytes", "all_gather_ms", "reduce_scatter_bytes",
                 "reduce_scatter_ms", *hsdp, "wait_ms", "exposed_ms", "forward_ms", "backward_ms"]].round(3)
          .to_string(index=False, na_rep="-"))
    if len(active) < len(units):
        print(f"{idle_units_line(len(units) - len(active))}; `--json` lists every unit")
    if sh.framework == "deepspeed":
        print(UNTIMED_UNITS)
    if len(no_unit):
        print(f"the {NO_UNIT} row by who issued it (per step):")
        print(no_unit.round(3).to_string(index=False))
    if len(buckets):
        print(f"gradient buckets ({framework}; ms and bytes per step; start_ms after the step's start):")
        print(buckets.round(3).to_string(index=False))
    print("model states (bytes) beside ZeRO stages 0-3:")
    # ZeRO-Offload: what of the persistent states is in host memory
    host = ["host_persistent_bytes"] if stages.get("host_persistent_bytes") is not None \
        and stages["host_persistent_bytes"].fillna(0).any() else []
    print(stages[["row", "params_bytes", "grads_bytes", "optimizer_state_bytes", "model_state_bytes", *host,
                  "measured/predicted"]].round(3).to_string(index=False))
    for line in notes:
        print(f"  {line}")
    for line in comm_honesty_lines(trace):
        print(line)
    setting = "ZeRO stage or reduce_bucket_size" if sh.framework == "deepspeed" else "reshard_after_forward"
    print(f"at another {setting}: `ddpscope whatif {trace.path}`")
    return 0


def _summary_table(path: str, kind: str, as_json: bool) -> int:
    """Ring or ZeRO runs: one table (TraceError propagates to the caller)."""
    if kind == "ring":
        from ddpscope.viz.ring.metrics import compute_ring_summary
        from ddpscope.viz.ring.trace import load_ring

        trace = load_ring(path)
        table, title = compute_ring_summary(trace), f"ring all-reduce, {trace.world_size} ranks (medians, ms, GB/s)"
    else:
        from ddpscope.viz.zero.trace import compute_zero_comparison, load_zero

        trace = load_zero(path)
        table = compute_zero_comparison(trace)
        title = f"ZeRO stages, {trace.params} parameters, {trace.world_size} ranks (bytes)"
    if as_json:
        print(json.dumps({"path": str(trace.path), "kind": kind, "status": trace.run.get("status"),
                          "rows": table.astype(object).to_dict("records")}, indent=1, default=float))
    else:
        print(f"{trace.path}  status={trace.run.get('status')}  {title}")
        print(table.round(4).to_string(index=False))
        if kind == "ring":
            _ring_fit(trace)
    return 0


def _ring_fit(trace) -> None:
    """The alpha-beta fit of a ring run, and how well it fits each size."""
    from ddpscope.viz.ring.cost import compute_ring_fit, describe_fit, fit_ring_cost

    try:
        model = fit_ring_cost(trace)
    except ValueError as e:
        print(f"no alpha-beta fit: {e}")
        return
    print(describe_fit(trace, model))
    print(compute_ring_fit(trace, model).round(3).to_string(index=False))


def _mib(value) -> str:
    """A cap in MiB, 6 significant digits (read back from the whole bytes DDP used, a
    requested 0.0001 is 104 bytes: ``9.91821e-05``, not ``9.918212890625e-05``)."""
    return f"{value:.6g}" if isinstance(value, (int, float)) else str(value)
