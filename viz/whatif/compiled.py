"""When a ``torch.compile``'d model's gradients become ready at another bucket cap.

Under torch.compile, DDPOptimizer (``torch._dynamo.backends.distributed``, torch's default
for DDP models) splits the compiled graph at buckets of its own, so that a bucket's
all-reduce can start while the rest of backward runs: walking the graph from its output,
it closes a piece once the parameters in it reach 1 MiB (the first piece) or DDP's
``bucket_bytes_cap`` (the others: ``bucket_cap_mb``, or the largest entry of a
``bucket_cap_mb_list``). Each piece's backward runs as one compiled function, and its
parameters' gradients are ready together when it returns. So a cap moves when gradients
become ready, which an eager model's never does: a trace at DDP's default (25 MiB) shows
a 1 MiB piece and then every other gradient at the end of backward; at 1 MiB they would
come piece by piece, with all-reduces beside the rest of backward.

``at_cap`` rewrites a traced step's ready times for another cap: the traced pieces are the
runs of gradients ready together (as many as DDPOptimizer's rule gives the traced cap, cut
at the longest waits between gradients); the work between two pieces' ends is spread
over the later piece's parameters in proportion to their bytes, in the graph's order (the
pieces in the order they became ready, each piece's parameters in reverse registration
order, a module's parameters never split); each new piece's gradients are ready when
the work up to its last parameter is done. At the traced cap this gives back the traced
times of the pieces. Backward compute in proportion to bytes is the approximation, and a
graph in more pieces may run slower than the traced one (less fused): ``python -m
benchmarks.whatif --models compiled`` measures both against real reruns.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ddpscope.viz.whatif.layout import DEFAULT_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES, MIB, Cap, cap_bytes
from ddpscope.viz.whatif.model import RankStep, StepInputs


def _module(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def _pieces(order: list[int], sizes: list[int], names: list[str], cap_bytes: int) -> list[list[int]]:
    """DDPOptimizer's pieces along ``order`` (from the graph's output): a module's
    parameters together; a piece closes once it holds 1 MiB (the first) or ``cap_bytes``."""
    pieces: list[list[int]] = [[]]
    size, k = 0, 0
    while k < len(order):
        limit = DEFAULT_FIRST_BUCKET_BYTES if len(pieces) == 1 else cap_bytes
        if pieces[-1] and size >= limit:
            pieces.append([])
            size = 0
        mod = _module(names[order[k]])
        while k < len(order) and (_module(names[order[k]]) == mod):
            pieces[-1].append(order[k])
            size += sizes[order[k]]
            k += 1
    return pieces


def piece_count(run: dict) -> int:
    """How many pieces DDPOptimizer made of the traced model: its rule along the
    parameters in reverse registration order (the graph's from its output, for a model
    that runs its modules in the order it registers them) at the traced
    ``bucket_bytes_cap``; only the count is taken, as the order can differ (tied weights)."""
    sizes = [int(b) for b in run["param_bytes"]]
    names = run.get("param_names") or [f"param{i}" for i in range(len(sizes))]
    cap = run.get("bucket_cap_bytes")
    cap = int(cap) if isinstance(cap, (int, float)) and cap > 0 else int(DEFAULT_CAP_MB * MIB)
    return len(_pieces(list(reversed(range(len(sizes)))), sizes, names, cap))


def traced_pieces(ready: dict[int, float], count: int) -> list[list[int]]:
    """The ``count`` pieces of a traced backward (``ready``: parameter -> when its gradient
    was ready, µs): cut at the ``count - 1`` longest waits between one gradient and the
    next (inside a piece they are the accumulations, one after another; between two, a
    piece's whole backward), in the order they were ready, each piece's parameters in the
    graph's order from its output (reverse registration)."""
    params = sorted(ready, key=lambda p: (ready[p], -p))
    gaps = np.diff([ready[p] for p in params])
    cuts = sorted(np.argsort(gaps, kind="stable")[::-1][:max(0, min(count, len(params)) - 1)] + 1)
    return [sorted(piece, reverse=True) for piece in np.split(np.asarray(params, dtype=int), cuts) if len(piece)]


def graph_order(ready: dict[int, float], run: dict) -> list[int]:
    """The parameters in the order DDPOptimizer's pieces take them, at every cap (its
    pieces at one cap are runs of it): the order in which DDP's rebuild sees their
    gradients, give or take the order inside a piece."""
    return [int(p) for piece in traced_pieces(ready, piece_count(run)) for p in piece]


def _rank_at_cap(rs: RankStep, sizes: list[int], names: list[str], cap_bytes: int, count: int) -> RankStep:
    traced = traced_pieces(rs.work, count)
    if not traced:
        return rs
    order = [int(p) for piece in traced for p in piece]
    ends = np.cumsum([sum(sizes[p] for p in piece) for piece in traced], dtype=float)
    done = np.maximum.accumulate([max(rs.work[p] for p in piece) for piece in traced])
    xs, ys = np.concatenate([[0.0], ends]), np.concatenate([[0.0], done])
    work, at = {}, 0.0
    for piece in _pieces(order, sizes, names, cap_bytes):
        at += sum(sizes[p] for p in piece)
        ready = float(np.interp(at, xs, ys))
        work.update({p: ready for p in piece})
    return dataclasses.replace(rs, work=work)


def at_cap(inputs: list[StepInputs], run: dict, cap: Cap) -> list[StepInputs]:
    """``inputs`` (``model.step_inputs`` of a torch.compile'd run) with every rank's
    gradient-ready work as DDPOptimizer's pieces at ``cap`` would give it (see the module)."""
    sizes = [int(b) for b in run["param_bytes"]]
    names = run.get("param_names") or [f"param{i}" for i in range(len(sizes))]
    limit, count = cap_bytes(cap), piece_count(run)
    return [StepInputs(step=inp.step, ranks={r: _rank_at_cap(rs, sizes, names, limit, count)
                                             for r, rs in inp.ranks.items()}) for inp in inputs]
