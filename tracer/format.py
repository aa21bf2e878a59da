"""The trace format: file names, lanes and event categories shared by writer and readers.

Light on purpose (no torch): readers in ``viz/`` import it to parse what the tracer wrote.

A run folder holds ``run.json`` (run metadata, written by rank 0 and updated by the
runner) and one ``rank-<r>.json`` per rank: Chrome Trace Event JSON that Perfetto and
chrome://tracing open as they are. Since version 2 it is the format's *array* form,
appended to while the run goes and left unterminated until the rank closes it (the
format allows that; a reader drops a torn last line): ``[``, one line per flush of
events, and a metadata event (``ph: "M"``, ``name: META_EVENT``) each time the rank's
metadata changed; the last one holds the rank's metadata, including its clock offset
to rank 0 (readers add it to align ranks). Version 1 files are the object form, with
the metadata in ``otherData.ddpscope``; readers take both. Timestamps (``ts``) and
durations (``dur``) are µs on that rank's own host clock.
"""

from __future__ import annotations

import re

FORMAT = "ddpscope-trace"
VERSION = 2
META_EVENT = "ddpscope"  # the name of the metadata event in a rank file (array form)
RUN_FILE = "run.json"
RANK_FILE_RE = re.compile(r"^rank-(\d+)\.json$")


def started_at() -> str:
    """Now, UTC, to the second (ISO 8601): run.json's ``started_at``."""
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def rank_file(rank: int) -> str:
    return f"rank-{rank}.json"


# Beside each rank file, its summary (``tracer/step_summary.py``, written by the same
# writer at the same flushes): JSON Lines, one object per line: ``{"meta": {...}}``
# whenever the rank's metadata changed (the last one counts; the per-parameter lists
# below are left out: run.json holds them), and one row per step otherwise. A viewer of
# many ranks reads these instead of the events; a folder may hold only summaries.
SUMMARY_VERSION = 1
SUMMARY_FILE_RE = re.compile(r"^rank-(\d+)\.summary\.jsonl$")
SUMMARY_META_LEFT_OUT = frozenset({"param_names", "param_bytes", "param_dtypes", "bucket_layouts"})


def summary_file(rank: int) -> str:
    return f"rank-{rank}.summary.jsonl"


# Where each rank is now (``tracer/capture/live.py`` writes, the launcher's hang watchdog
# reads): RUN/live/rank-<r>.json. On SIGUSR1 a rank of ``ddpscope run`` writes every
# thread's Python stack to RUN/logs/stacks-rank-<r>.txt (faulthandler).
LIVE_DIR = "live"
PROFILE_DIR = "profile"  # ddpscope run --profile: torch.profiler's traces, one per rank
STACKS_SIGNAL_NAME = "SIGUSR1"


# A multi-node run (``tracer/launch/nodes.py``): each node's launcher keeps its record in
# RUN/nodes/node-<k>.json and its torchrun logs in RUN/logs/node-<k>/; node 0 owns run.json.
NODES_DIR = "nodes"
# a job with several DDP models (a GAN, teacher-student): the first is the run folder's own,
# each further one a run folder of its own at models/<k>-<ModuleClass> (run.json "models")
MODELS_DIR = "models"
LOGS_DIR = "logs"


def node_file(node_rank: int) -> str:
    return f"{NODES_DIR}/node-{node_rank}.json"


def node_logs(node_rank: int, nnodes: int) -> str:
    """Where a node's torchrun logs go: ``logs`` alone, ``logs/node-<k>`` of several."""
    return LOGS_DIR if nnodes == 1 else f"{LOGS_DIR}/node-{node_rank}"


def live_file(rank: int) -> str:
    return f"{LIVE_DIR}/rank-{rank}.json"


def stacks_file(rank: int) -> str:
    return f"logs/stacks-rank-{rank}.txt"


# Lanes (Chrome trace thread ids) inside one rank's process.
TID_COMPUTE = 1  # step span with forward / backward / optimizer nested inside
TID_GRADS = 2  # one instant event per parameter when its gradient is ready
TID_BUCKET_BASE = 100  # bucket b's all-reduces on tid 100 + b (a bucket never overlaps itself)
# DDP's own collectives on the reducer's group that are not buckets: the all-reduce of its
# map of locally used parameters (int32, one per parameter) under find_unused_parameters
# and in a static graph's first iteration. The compiled capture sees them; never buckets.
TID_DDP_OWN = 7

# Event categories ("cat").
CAT_STEP = "step"
CAT_FORWARD = "forward"
CAT_BACKWARD = "backward"
CAT_GRAD_SYNC = "grad_sync"  # end of backward compute -> DDP has every averaged gradient
CAT_OPTIMIZER = "optimizer"
CAT_GRAD = "grad_ready"
CAT_ALLREDUCE = "allreduce"
CAT_MEMORY = "memory"
CAT_DDP_OWN = "ddp_collective"  # args: step, bytes (see TID_DDP_OWN)
UNUSED_MAP = "unused-parameter map"  # the name of that all-reduce
BUFFER_BROADCAST = "buffer broadcast"  # DDP's broadcast of the module's buffers before a syncing forward

# Status of a rank file or a run.
RUNNING = "running"
COMPLETE = "complete"
FAILED = "failed"
UNTRACED = "untraced"  # the script ran, but built nothing ddpscope could trace
# The files were not finished though the job ended (a rank file still "running", a rank
# file missing, run.json left "running"): readers say so; the launcher writes it too
# when it still can.
INCOMPLETE = "incomplete"

# Ring all-reduce runs (``ddpscope ring``): ``run.json`` says ``"kind": "ring"``.
KIND_DDP = "ddp"  # the default when run.json has no "kind"
KIND_RING = "ring"
TID_RING = 10  # one span per ring all-reduce, its 2(N-1) steps nested inside
TID_RING_REF = 11  # dist.all_reduce of the same tensor, for comparison
CAT_RING = "ring"
CAT_RING_STEP = "ring_step"
CAT_RING_REF = "allreduce_ref"
REDUCE_SCATTER = "reduce-scatter"  # the two phases of a ring step ("phase" in its args)
ALL_GATHER = "all-gather"
KIND_ZERO = "zero"  # ddpscope zero: memory and communication per ZeRO stage

# Sharded training (``ddpscope run`` of an FSDP2 script): ``run.json`` says ``"kind":
# "sharded"`` and describes the units (``sharding``). Per rank, beside the step, pass and
# optimizer spans of a DDP trace: compute cut per FSDP unit, the waits for all-gathers,
# and one lane per collective kind (a collective no unit issued: args unit -1; FSDP2's
# clip_grad_norm_ or the script's own say who in "by" and the function in "op"; DeepSpeed's
# say what of ZeRO's in "zero", and its "other" ones, like the script's, who in "by").
# ZeRO-1 (DDP + ZeroRedundancyOptimizer) stays a DDP trace (kind "ddp") with its
# parameter broadcasts on TID_PARAM_SYNC and ``sharding`` in run.json.
KIND_SHARDED = "sharded"
# A DeepSpeed engine (``deepspeed.initialize``): run.json says ``"kind": "deepspeed"`` and
# holds the engine's settings (``deepspeed``: stage, dtypes, buckets; see
# tracer/capture/deepspeed/engine_facts.py).
KIND_DEEPSPEED = "deepspeed"
TID_UNITS = 3  # compute, cut per FSDP unit (innermost unit running), and the waits
TID_ALL_GATHER = 4
TID_REDUCE_SCATTER = 5
TID_PARAM_SYNC = 6  # ZeRO-1: parameters broadcast after the optimizer step
CAT_UNIT = "unit"  # compute of one unit: args unit, phase (forward / backward)
CAT_WAIT = "wait"  # compute waits for a unit's all-gather (copy-out included)
CAT_ALL_GATHER = "all_gather"
CAT_REDUCE_SCATTER = "reduce_scatter"
CAT_PARAM_SYNC = "param_sync"
CAT_MEMORY_SAMPLE = "memory_sample"  # a counter at a unit boundary: bytes by category
MEMORY_CATEGORIES = ("sharded_params_bytes", "unsharded_params_bytes", "sharded_grads_bytes",
                     "unsharded_grads_bytes", "optimizer_state_bytes", "activations_bytes", "comm_buffers_bytes",
                     "other_bytes")
