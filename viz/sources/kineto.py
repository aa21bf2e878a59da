"""A folder of PyTorch profiler (Kineto) traces, one file per rank, as a ``RunTrace``.

What is read (HTA's definitions, so the figures agree with Holistic Trace Analysis):

- **steps**: the CPU spans ``ProfilerStep#N``; a GPU event belongs to the step whose span
  holds its launch (the runtime call with the same ``correlation``);
- **kernels** (``RunTrace.kernels``): every event on a GPU stream with a correlation id,
  classed by name (``kind``): communication (``(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)``;
  ``hta_kind`` takes HTA 0.5.0's own ``^nccl.*Kernel``), memory
  (``^Memcpy|^Memset|^dma``), compute (anything not matching HTA's
  ``(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)``), other. A collective's kind, bytes,
  dtype and group size come from the kernel's args when Kineto recorded them, else its
  kind from the kernel name (``ncclDevKernel_AllReduce_...``);
- a **CPU-only** profile (gloo, no GPU events) reads CPU ops as compute and the CPU-side
  collective spans (``gloo:all_reduce``, run on gloo's worker threads) as communication;
  a GPU profile with no communication kernel (gloo on CUDA tensors) takes its
  communication from those CPU-side spans too (HTA's figures leave them out);
- **buckets**: for DDP, each all-reduce of a step, in start order, is a bucket.

Several big files are parsed on every core (``viz.parallel``): each worker reads a file
and builds its rank's tables; only the tables come back. Ranks come from each file's
``distributedInfo`` (else the file name). They are put on one
time axis by Kineto's per-rank base time (``baseTimeNanoseconds``), then by the ends of the
collectives every rank ran (a collective ends at about the same moment on every rank):
the median difference is each rank's shift, and what is left is reported as residual skew.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pandas as pd

from ddpscope.viz.parallel import map_on_cores
from ddpscope.viz.sources.kineto_file import COMM_PREFIXES, FILE_RE, KinetoFile, rank_from_name, read_kineto_file
from ddpscope.viz.trace import GRAD_COLUMNS, PASS_COLUMNS, STEP_COLUMNS, RunTrace, TraceError, frame_of

KIND = "kineto"
COMM_RE = re.compile(r"(^nccl.*)|(^hip)|(^hccl)|(.*ncclKernel.*)")
MEMORY_RE = re.compile(r"(^Memcpy)|(^Memset)|(^dma)")
NOT_COMPUTE_RE = re.compile(r"(^nccl.*Kernel)|(.*(Memcpy)|(Memset))|(.*Sync)")
STEP_RE = re.compile(r"^ProfilerStep\s*#\s*(\d+)$")
KERNEL_COLLECTIVE_RE = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+?)(?:_|\(|$)")
DTYPE_BYTES = {"float": 4, "float32": 4, "half": 2, "float16": 2, "bfloat16": 2, "double": 8, "float64": 8,
               "long": 8, "int64": 8, "int": 4, "int32": 4, "short": 2, "int16": 2, "byte": 1, "uint8": 1,
               "char": 1, "int8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1}
ALLREDUCE = "allreduce"
#: collectives that end together on every rank (no rank finishes before all contributed);
#: send/recv and all-to-all do not, so they never set the clock
SYNCHRONISING = {"allreduce", "allgather", "allgatherintocoalesced", "reducescatter", "barrier"}


#: HTA 0.5.0's own rule for a communication kernel (``hta/utils/utils.py``): the figures
#: called HTA's use it; ddpscope's wider ``COMM_RE`` also takes HIP/HCCL and odd NCCL names
HTA_COMM_RE = re.compile(r"^nccl.*Kernel")


def kernel_kind(name: str, comm_re: re.Pattern = COMM_RE) -> str:
    """Kernel classes: ``comm``, ``memory``, ``compute`` or ``other``, as HTA classes them
    (with ``comm_re`` = ``HTA_COMM_RE`` exactly HTA 0.5.0's ``get_kernel_type``)."""
    if comm_re.match(name):
        return "comm"
    if MEMORY_RE.match(name):
        return "memory"
    if not NOT_COMPUTE_RE.match(name):
        return "compute"
    return "other"


def collective_kind(label: str) -> str:
    """``allreduce``, ``allgather``, ``sendrecv``... from ``AllReduce``, ``all_reduce``,
    ``_allgather_base``; empty if unknown."""
    return re.sub(r"[^a-z0-9]", "", label.lower()).removesuffix("base")


def kineto_files(path: Path) -> list[Path]:
    """The candidate trace files of a folder: regular files named ``*.json[.gz]`` (links,
    FIFOs and devices are never opened)."""
    return sorted(p for p in path.iterdir() if FILE_RE.match(p.name) and not p.is_symlink() and p.is_file())


def load_kineto(path: str | Path) -> RunTrace:
    """Load a folder of Kineto traces (one per rank). Bad input: ``TraceError``."""
    path = Path(path)
    if not path.is_dir():
        raise TraceError(f"{path} is not a folder")
    files = kineto_files(path)
    if not files:
        raise TraceError(f"{path} holds no profiler traces (*.json, *.json.gz)")
    # a gzip file inflates ~8x: what the parse costs is what it reads
    parsed = map_on_cores(_parse_file, [(p,) for p in files],
                          [p.stat().st_size * (8 if p.name.endswith(".gz") else 1) for p in files])
    by_rank = _ranks(parsed)
    world = _world_size(by_rank)
    tables = {r: (f.steps, f.kernels) for r, f in by_rank.items()}
    shifts, clock = _align(by_rank, tables)
    cpu_only = not any(f.gpu_events for f in by_rank.values())
    rows: dict[str, list[pd.DataFrame]] = {"steps": [], "kernels": [], "buckets": []}
    for r, (steps, kernels) in tables.items():
        for name, df in (("steps", steps), ("kernels", kernels)):  # this load's own tables: shifted in place
            for c in ("start_us", "end_us", "launch_us"):
                if c in df:
                    df[c] += shifts[r]
            rows[name].append(df)
    steps = pd.concat(rows["steps"], ignore_index=True)
    kernels = pd.concat(rows["kernels"], ignore_index=True)
    # the per-rank tables go: the joined ones replace them (a big job's peak memory)
    by_rank = {r: dataclasses.replace(f, steps=None, kernels=None) for r, f in by_rank.items()}
    del parsed, tables, rows, df
    buckets = _buckets(kernels)
    notes = [clock["note"]]
    if cpu_only:
        notes.append("CPU-only profile (no GPU events): CPU ops are read as compute and the CPU-side collective "
                     "spans (gloo:..., nccl:...) as communication.")
    if not (kernels["kind"] == "comm").any():
        notes.append("no communication in this profile: overlap is not defined.")
    if len(by_rank) < world:
        notes.append(f"{len(by_rank)} of the job's {world} ranks are in this folder: ranks "
                     f"{', '.join(map(str, sorted(by_rank)))}.")
    first = next(iter(by_rank.values()))
    run = {"kind": KIND, "source": "torch.profiler (Kineto)", "status": "complete", "world_size": world,
           "ranks_present": sorted(by_rank), "backend": first.backend, "model": "profiler trace",
           "cpu_only": cpu_only, "clock": clock, "notes": notes, "bucket_layout": []}
    ranks = {r: {"rank": r, "file": f.path.name, "world_size": f.world_size, "offset_us": shifts[r],
                 "base_time_ns": f.base_time_ns, "hta_rounds": f.hta_rounds, "devices": f.devices}
             for r, f in by_rank.items()}
    return RunTrace(path=path, run=run, ranks=ranks,
                    steps=frame_of(steps.assign(grad_marks=False).to_dict("records"), ["rank", "step"], STEP_COLUMNS),
                    buckets=buckets, grads=frame_of([], [], GRAD_COLUMNS), memory=frame_of([], [], ["rank", "step"]),
                    passes=frame_of([], [], PASS_COLUMNS), kernels=kernels, source=KIND)


@dataclasses.dataclass(frozen=True)
class _ParsedFile:
    """One file, parsed (in a worker process when several are): what its rank's tables
    and the checks across ranks need, not its events."""

    path: Path
    rank: int | None  # its distributedInfo's
    named: int | None  # its file name's
    world_size: int | None
    backend: str | None
    base_time_ns: int | None
    devices: int
    hta_rounds: bool
    timed: bool  # it holds timed events
    gpu_events: bool
    steps: pd.DataFrame  # with the rank it says it is (0 if it says none)
    kernels: pd.DataFrame


def _parse_file(path: Path) -> _ParsedFile:
    f = read_kineto_file(path)
    named = rank_from_name(path.name)
    rank = f.rank if f.rank is not None else named if named is not None else 0
    timed = bool(len(f.ops["ts"]) or len(f.gpu["ts"]))
    steps, kernels = _rank_tables(rank, f) if timed else (None, None)
    return _ParsedFile(path=path, rank=f.rank, named=named, world_size=f.world_size, backend=f.backend,
                       base_time_ns=f.base_time_ns, devices=f.devices, hta_rounds=f.hta_rounds, timed=timed,
                       gpu_events=bool(len(f.gpu["ts"])), steps=steps, kernels=kernels)


def _ranks(files: list[_ParsedFile]) -> dict[int, _ParsedFile]:
    out: dict[int, _ParsedFile] = {}
    for f in files:
        p, named = f.path, f.named
        if f.rank is not None and named is not None and f.rank != named:
            raise TraceError(f"{p.name} says rank {f.rank} in its distributedInfo but its name says rank {named}")
        rank = f.rank if f.rank is not None else named
        if rank is None:
            if len(files) > 1:
                raise TraceError(f"cannot tell which rank {p.name} is (no distributedInfo.rank, no rank in its name)")
            rank = 0
        if rank < 0:
            raise TraceError(f"{p.name} says it is rank {rank}")
        if rank in out:
            raise TraceError(f"{out[rank].path.name} and {p.name} are both rank {rank}")
        if not f.timed:
            raise TraceError(f"{p.name} holds no timed events")
        out[rank] = f
    return dict(sorted(out.items()))


def _world_size(by_rank: dict[int, _ParsedFile]) -> int:
    sizes = {f.world_size for f in by_rank.values() if f.world_size is not None}
    if len(sizes) > 1:
        raise TraceError(f"the files disagree on the job's world size: {sorted(sizes)}")
    world = sizes.pop() if sizes else max(by_rank) + 1
    if world < 1 or max(by_rank) >= world:
        raise TraceError(f"rank {max(by_rank)} is outside a job of {world} ranks")
    return world


def _rank_tables(rank: int, f: KinetoFile) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(steps, kernels) of one rank on its own clock; kernels carry their raw times
    (``ts_raw``, ``dur_raw``) for HTA's figures and ``hta`` (inside HTA's window: launched
    before the last ProfilerStep began)."""
    ops, gpu = f.ops, f.gpu
    names = ops["name"]
    number = np.array([int(m.group(1)) if (m := STEP_RE.match(c)) else -1 for c in names.categories], np.int64)
    at = np.flatnonzero(number[names.codes] >= 0) if len(number) else np.empty(0, np.int64)
    step_rows = [(int(number[names.codes[i]]), ops["ts"][i], ops["ts"][i] + ops["dur"][i]) for i in at]
    if len({s for s, _, _ in step_rows}) != len(step_rows):
        raise TraceError(f"{f.path.name} has a ProfilerStep number twice")
    step_rows.sort(key=lambda r: r[1])
    steps = pd.DataFrame(step_rows, columns=["step", "start_us", "end_us"])
    steps.insert(0, "rank", rank)
    steps = steps.assign(warmup=False, incomplete=False, micro_batches=1)
    cpu_side = np.zeros(0, bool)
    if len(gpu["ts"]):
        kernels = _gpu_kernels(f, steps)
        if not (kernels["kind"] == "comm").any():  # gloo on CUDA tensors: its collectives run on the CPU
            cpu_comm = _cpu_as_kernels(f, steps)
            cpu_comm = cpu_comm[cpu_comm["kind"] == "comm"]
            cpu_side = np.r_[np.zeros(len(kernels), bool), np.ones(len(cpu_comm), bool)]
            kernels = pd.concat([kernels, cpu_comm], ignore_index=True) if len(cpu_comm) else kernels
    else:
        kernels = _cpu_as_kernels(f, steps)
    kernels.insert(0, "rank", rank)
    hta = np.ones(len(kernels), bool)
    if len(steps) > 1:
        hta = kernels["launch_us"].to_numpy() < steps["start_us"].max()
    if cpu_side.any():  # HTA reads GPU events only
        hta = hta & ~cpu_side
    kernels["hta"] = hta
    return steps, kernels


def _step_of(times: np.ndarray, steps: pd.DataFrame) -> np.ndarray:
    """The ProfilerStep number whose CPU span holds each time; -1 outside every step."""
    out = np.full(len(times), -1, np.int64)
    if len(steps) == 0:
        return out
    start, end, num = (steps[c].to_numpy() for c in ("start_us", "end_us", "step"))
    i = np.searchsorted(start, times, side="right") - 1
    ok = (i >= 0) & ~np.isnan(times)
    ok[ok] &= times[ok] < end[i[ok]]
    out[ok] = num[i[ok]]
    return out


def _gpu_kernels(f: KinetoFile, steps: pd.DataFrame) -> pd.DataFrame:
    ops, gpu = f.ops, f.gpu
    # each GPU event's launch: the CPU event (a runtime call) with the same correlation id
    has = ops["correlation"] >= 0
    corr, when = ops["correlation"][has], ops["ts"][has]
    order = np.argsort(corr, kind="stable")
    corr, when = corr[order], when[order]
    i = np.clip(np.searchsorted(corr, gpu["correlation"]), 0, max(len(corr) - 1, 0))
    found = (len(corr) > 0) & (corr[i] == gpu["correlation"]) if len(corr) else np.zeros(len(i), bool)
    launch = np.where(found, when[i] if len(corr) else np.nan, np.nan)
    names = gpu["name"]  # categorical: classify each distinct name once
    kind = np.array([kernel_kind(n) for n in names.categories], dtype=object)[names.codes]
    hta_kind = np.array([kernel_kind(n, HTA_COMM_RE) for n in names.categories], dtype=object)[names.codes]
    from_name = np.array([_collective_from_kernel(n) for n in names.categories], dtype=object)[names.codes]
    given = gpu["collective"]
    from_args = np.array([collective_kind(c) for c in given.categories], dtype=object)[given.codes]
    collective = np.where(from_args != "", from_args, np.where(kind == "comm", from_name, ""))
    dtype = gpu["dtype"]
    size = np.array([DTYPE_BYTES.get(d.lower(), np.nan) for d in dtype.categories], float)[dtype.codes]
    return pd.DataFrame({
        "step": _step_of(launch, steps), "stream": gpu["stream"], "name": names,
        "kind": pd.Categorical(kind), "hta_kind": pd.Categorical(hta_kind), "start_us": gpu["ts"],
        "end_us": gpu["ts"] + gpu["dur"], "launch_us": launch,
        "collective": collective, "bytes": gpu["nelems"] * size, "dtype": np.asarray(dtype, dtype=object),
        "group_size": gpu["group_size"], "pg": np.asarray(gpu["pg"], dtype=object), "ts_raw": gpu["ts"],
        "dur_raw": gpu["dur"],
    })


def _collective_from_kernel(name: str) -> str:
    m = KERNEL_COLLECTIVE_RE.search(name)
    return collective_kind(m.group(1)) if m else "nccl"


def _cpu_as_kernels(f: KinetoFile, steps: pd.DataFrame) -> pd.DataFrame:
    """A CPU-only profile: CPU ops (``cpu_op``) are compute, CPU-side collective spans
    communication; their "stream" is the thread (negative ids, one per thread)."""
    ops = f.ops
    names = ops["name"]
    comm_name = np.array([n.startswith(COMM_PREFIXES) for n in names.categories], bool)
    comm = comm_name[names.codes] if len(names) else np.zeros(0, bool)
    compute = ops["cpu_op"] & ~comm
    keep = comm | compute
    nbytes = np.full(len(names), np.nan)
    dtype = np.full(len(names), "", dtype=object)
    for i in np.flatnonzero(comm):
        nbytes[i], dtype[i] = _bytes_of(ops["shapes"].get(int(i)))
    kind = np.where(comm, "comm", "compute")
    coll_name = np.array([collective_kind(n.split(":", 1)[1]) if c else "" for n, c in
                          zip(names.categories, comm_name)], dtype=object)
    collective = coll_name[names.codes] if len(names) else np.zeros(0, object)
    df = pd.DataFrame({
        "step": _step_of(ops["ts"][keep], steps), "stream": -(ops["tid"][keep] + 1),  # threads: negative ids
        "name": names[keep], "kind": pd.Categorical(kind[keep]), "hta_kind": pd.Categorical(kind[keep]),
        "start_us": ops["ts"][keep],
        "end_us": ops["ts"][keep] + ops["dur"][keep], "launch_us": ops["ts"][keep], "collective": collective[keep],
        "bytes": nbytes[keep], "dtype": dtype[keep], "group_size": np.nan, "pg": "",
        "ts_raw": ops["ts"][keep], "dur_raw": ops["dur"][keep],
    })
    return df


def _bytes_of(shapes) -> tuple[float, str]:
    """Bytes of a CPU-side collective's first tensor input, from its dims and type."""
    if not shapes:
        return np.nan, ""
    dims, types = shapes
    for d, t in zip(dims, types):
        if isinstance(d, list) and t and t.lower() in DTYPE_BYTES:
            return float(np.prod(d, dtype=float)) * DTYPE_BYTES[t.lower()], t
    return np.nan, ""


def _buckets(kernels: pd.DataFrame) -> pd.DataFrame:
    """DDP's buckets as the profile shows them: each all-reduce of a step, in start order."""
    cols = ["rank", "step", "bucket", "bytes", "num_params", "params", "launch_us", "done_us", "incomplete",
            "dtype", "group_size"]
    ar = kernels[(kernels["collective"] == ALLREDUCE) & (kernels["step"] >= 0)]
    if len(ar) == 0:
        return pd.DataFrame(columns=cols)
    ar = ar.sort_values(["rank", "step", "start_us"], kind="stable")
    return pd.DataFrame({
        "rank": ar["rank"].to_numpy(), "step": ar["step"].to_numpy(),
        "bucket": ar.groupby(["rank", "step"]).cumcount().to_numpy(), "bytes": ar["bytes"].to_numpy(),
        "num_params": 0, "params": [[] for _ in range(len(ar))], "launch_us": ar["start_us"].to_numpy(),
        "done_us": ar["end_us"].to_numpy(), "incomplete": False, "dtype": ar["dtype"].to_numpy(),
        "group_size": ar["group_size"].to_numpy(),
    })


def _align(by_rank: dict[int, _ParsedFile], tables: dict) -> tuple[dict[int, float], dict]:
    """Each rank's shift (µs) onto the lowest rank's clock, and how it was found."""
    ref = min(by_rank)
    bases = {r: f.base_time_ns for r, f in by_rank.items()}
    use_base = all(b is not None for b in bases.values())
    shifts = {r: (bases[r] - bases[ref]) / 1e3 if use_base else 0.0 for r in by_rank}
    how = ["Kineto's per-rank base time" if use_base else "the files' own timestamps (no base time recorded)"]
    clock = {"reference_rank": ref, "base_time": use_base}
    if len(by_rank) > 1:
        ends = _shared_collective_ends(tables)
        if ends is not None:
            before = _skew(ends, shifts)
            for r in by_rank:
                shifts[r] += float(np.median(ends[ref] - ends[r]))
            clock.update(shared_collectives=len(ends[ref]), skew_before_us=before,
                         residual_skew_us=_skew(ends, shifts))
            how.append(f"the ends of {len(ends[ref])} collectives all ranks ran (median shift)")
        else:
            clock["residual_skew_us"] = None
            how.append("nothing else: no all-reduce, all-gather or reduce-scatter ran on every rank here, so the "
                       "residual skew is unknown")
    clock["offsets_us"] = {str(r): s for r, s in shifts.items()}
    note = "ranks aligned by " + ", then ".join(how)
    if clock.get("residual_skew_us") is not None:
        note += (f"; residual skew at shared collective ends {clock['residual_skew_us']:.1f} µs median "
                 f"(before that step {clock['skew_before_us']:.1f} µs)")
    clock["note"] = note + "."
    return shifts, clock


def _shared_collectives_key(k: pd.DataFrame) -> pd.Series:
    return k["collective"].astype(str) + "|" + k["pg"].astype(str)


def _shared_collective_ends(tables: dict) -> dict[int, np.ndarray] | None:
    """The end times (own clock) of the synchronising collectives every rank ran, matched k-th to k-th
    per (collective, process group) when each rank ran the same number; None if none."""
    per_rank: dict[int, dict[str, np.ndarray]] = {}
    for r, (_, k) in tables.items():
        c = k[(k["kind"] == "comm") & k["collective"].isin(SYNCHRONISING)].sort_values("start_us", kind="stable")
        per_rank[r] = {key: g["end_us"].to_numpy() for key, g in c.groupby(_shared_collectives_key(c))}
    keys = set.intersection(*(set(d) for d in per_rank.values()))
    keys = sorted(k for k in keys if len({len(d[k]) for d in per_rank.values()}) == 1)
    if not keys:
        return None
    return {r: np.concatenate([d[k] for k in keys]) for r, d in per_rank.items()}


def _skew(ends: dict[int, np.ndarray], shifts: dict[int, float]) -> float:
    """Median over shared collectives of the spread of their ends across ranks (µs)."""
    m = np.vstack([ends[r] + shifts[r] for r in sorted(ends)])
    return float(np.median(m.max(axis=0) - m.min(axis=0)))
