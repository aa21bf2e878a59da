"""The gradient buckets DDP builds for a cap, from the order gradients became ready.

After its first iteration DDP rebuilds its buckets (``Reducer::rebuild_buckets``): the
parameters in the order their gradients became ready, cut by
``compute_bucket_assignment_by_size`` with the limits ``[first_bucket_bytes_cap,
bucket_bytes_cap]``: a bucket closes on the gradient that takes it to or past its limit
(so buckets overshoot the cap by up to one gradient), every (dtype, device) fills its
own bucket, and what is left open at the end closes last. Bucket 0 is the first to be
ready. ``bucket_cap_mb`` given explicitly makes the first bucket's cap the same as the
others' (``_BucketCapacityConfig``); only the default (25 MiB) keeps a 1 MiB first bucket.
``bucket_cap_mb_list`` (PyTorch 2.13) gives a limit per bucket instead, in that order,
the last repeating (for each dtype's buckets apart), at the first bucketing and at the
rebuild alike; the largest is then the cap DDP reports.

DDP rebuilds only when it does not look for unused parameters in a dynamic graph
(``Reducer::should_rebuild_buckets``): with ``find_unused_parameters=True`` and no
``static_graph`` (Hugging Face Trainer's default) the first layout stays for the whole run:
the parameters in registration order cut by the same limits, the buckets then reversed
(bucket 0 holds the last registered), as ``DistributedDataParallel._ddp_init_helper``
builds it. ``rebuilds(run)`` says which policy a run's flags give.

The assignment is DDP's own C++ function when torch is importable (called on ``meta``
tensors: sizes and dtypes only, no memory), else a line-by-line port of it.
"""

from __future__ import annotations

from collections.abc import Sequence

MIB = 2**20
DEFAULT_CAP_MB = 25.0  # torch's _DEFAULT_BUCKET_CAP_MB
DEFAULT_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
             "float8_e4m3fn": 1, "float8_e5m2": 1}


def cap_limits(cap_mb: float | None) -> tuple[int, int]:
    """``(first_bucket_bytes_cap, bucket_bytes_cap)`` DDP uses for ``bucket_cap_mb``
    (MiB; None: DDP's default 25 MiB with its 1 MiB first bucket)."""
    if cap_mb is None:
        return DEFAULT_FIRST_BUCKET_BYTES, int(DEFAULT_CAP_MB * MIB)
    if not cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 MiB, got {cap_mb}")
    cap = int(cap_mb * MIB)  # DDP truncates the same way
    return cap, cap


Cap = float | None | tuple[float, ...]  # bucket_cap_mb (MiB; None: DDP's default), or a bucket_cap_mb_list


def is_cap_list(cap: Cap) -> bool:
    return cap is not None and not isinstance(cap, (int, float))


def bucket_limits(cap: Cap) -> list[int]:
    """DDP's byte limits, bucket by bucket (the last repeats), for ``bucket_cap_mb`` (MiB;
    None: DDP's default) or a ``bucket_cap_mb_list`` (a sequence of MiB)."""
    if not is_cap_list(cap):
        return list(cap_limits(cap))
    caps = [float(c) for c in cap]
    if not caps or not all(c > 0 and c == c and c != float("inf") for c in caps):
        raise ValueError(f"bucket_cap_mb_list must be sizes > 0 MiB, got {list(cap)}")
    return [int(c * MIB) for c in caps]  # DDP truncates the same way


def cap_label(cap: Cap) -> str:
    """``25``, ``DDP's default`` or ``0.25,1,4`` (MiB)."""
    if cap is None:
        return "DDP's default"
    return ",".join(f"{float(c):g}" for c in cap) if is_cap_list(cap) else f"{float(cap):g}"


def smallest_cap_bytes(run: dict) -> int:
    """The smallest ``bucket_bytes_cap`` (bytes) the run's model accepts: DDP's default
    first bucket, 1 MiB, where torch.compile's DDPOptimizer splits its graphs at buckets
    (run.json ``torch_compile``): it refuses a smaller one at the first forward; else 0."""
    compiled = run.get("torch_compile")
    return DEFAULT_FIRST_BUCKET_BYTES if isinstance(compiled, dict) and compiled.get("optimize_ddp") == "ddp_optimizer" \
        else 0


def cap_bytes(cap: Cap) -> int:
    """DDP's ``bucket_bytes_cap`` for ``cap`` (the one torch.compile's DDPOptimizer splits
    at): the cap, a list's largest entry, or DDP's default 25 MiB (None)."""
    largest = DEFAULT_CAP_MB if cap is None else max(map(float, cap)) if is_cap_list(cap) else float(cap)
    return int(largest * MIB)


def runnable(run: dict, cap: Cap) -> bool:
    """The run's model can be given ``cap``: its ``cap_bytes`` is at least ``smallest_cap_bytes``."""
    return cap_bytes(cap) >= smallest_cap_bytes(run)


def compile_note(run: dict) -> str | None:
    """What the search leaves out for a ``torch.compile``'d model, or None."""
    if not smallest_cap_bytes(run):
        return None
    return ("the model is torch.compile'd: its DDPOptimizer refuses a bucket cap under 1 MiB (the largest entry of a "
            "bucket_cap_mb_list included), so none is offered; it splits the compiled graph where the cap closes a "
            "bucket, so a cap also moves when gradients become ready: each prediction moves them so, backward's time "
            "taken in proportion to the parameters' bytes; per-bucket lists are not searched (it splits at a list's "
            "largest entry, not at its buckets)")


def rebuilds(run: dict) -> bool:
    """DDP rebuilds its buckets in gradient-ready order after its first iteration (the
    run's flags, from run.json): unless it looks for unused parameters in a dynamic graph."""
    return bool(run.get("static_graph")) or not bool(run.get("find_unused_parameters"))


def first_layout(param_bytes: Sequence[int], param_dtypes: Sequence[str], limits: Sequence[int]) -> list[list[int]]:
    """The buckets DDP builds at construction and keeps when it never rebuilds: the
    parameters in registration order cut by ``limits``, the buckets reversed (bucket 0
    holds the last registered parameters, whose gradients are ready first)."""
    return list(reversed(assign_buckets(param_bytes, param_dtypes, range(len(param_bytes)), limits)))


def assign_buckets(param_bytes: Sequence[int], param_dtypes: Sequence[str], ready_order: Sequence[int],
                   limits: Sequence[int]) -> list[list[int]]:
    """Buckets (lists of parameter indices, bucket 0 first to be ready) for parameters of
    ``param_bytes`` (bytes) and ``param_dtypes`` (``"float32"``...) whose gradients become
    ready in ``ready_order``, under byte ``limits`` (first bucket's, then every other's)."""
    if sorted(ready_order) != list(range(len(param_bytes))):
        raise ValueError("the ready order must name every parameter once")
    if len(param_dtypes) != len(param_bytes):
        raise ValueError("one dtype per parameter is needed")
    try:
        return _assign_with_torch(param_bytes, param_dtypes, ready_order, limits)
    except ImportError:
        return assign_buckets_python(param_bytes, param_dtypes, ready_order, limits)


def _assign_with_torch(param_bytes, param_dtypes, ready_order, limits) -> list[list[int]]:
    import torch
    import torch.distributed as dist

    tensors = []
    for i in ready_order:
        dtype = getattr(torch, str(param_dtypes[i]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"parameter {i} has an unknown dtype {param_dtypes[i]!r}")
        itemsize = torch.empty((), dtype=dtype, device="meta").element_size()
        tensors.append(torch.empty(int(param_bytes[i]) // itemsize, dtype=dtype, device="meta"))
    indices, _ = dist._compute_bucket_assignment_by_size(tensors, [int(x) for x in limits],
                                                         [False] * len(tensors), list(ready_order))
    return [list(map(int, b)) for b in indices]


def assign_buckets_python(param_bytes, param_dtypes, ready_order, limits) -> list[list[int]]:
    """``compute_bucket_assignment_by_size`` (reducer.cpp) in Python, for a reader
    without torch. Open buckets left at the end close in first-seen dtype order (C++
    walks a hash map there: the order differs only with several dtypes)."""
    open_: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    limit_at: dict[str, int] = {}
    out: list[list[int]] = []
    for i in ready_order:
        key = str(param_dtypes[i])
        if key not in _ITEMSIZE:
            raise ValueError(f"parameter {i} has an unknown dtype {key!r}")
        open_.setdefault(key, []).append(int(i))
        size[key] = size.get(key, 0) + int(param_bytes[i])
        k = limit_at.setdefault(key, 0)
        if size[key] >= limits[k]:
            out.append(open_.pop(key))
            size[key] = 0
            limit_at[key] = min(k + 1, len(limits) - 1)
    out.extend(b for b in open_.values() if b)
    return out
