"""A closed sharded step's times made final before it is emitted: its stamps resolved to
µs in one batch (CUDA events: ``resolve_steps``), and its compute segments cut around
the time the training thread spent inside collectives and waits recorded whole
(``cut_holes``). Pure functions of the step (``recorder.py`` calls them)."""

from __future__ import annotations

from typing import Any, Callable


def cut_holes(segments: list[tuple[int, str, Any, Any]], holes: list[tuple[Any, Any]]
              ) -> list[tuple[int, str, float, float]]:
    """``segments`` (unit, phase, start, end) less every ``(start, end)`` of ``holes``: each
    segment split around the holes inside it (pieces of no length dropped), in order."""
    merged: list[list[float]] = []
    for a, b in sorted(holes):
        if b is None or b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    out = []
    for unit, phase, ts, te in segments:
        for a, b in merged:
            if b <= ts or a >= te:
                continue
            if a > ts:
                out.append((unit, phase, ts, a))
            ts = max(ts, b)
            if ts >= te:
                break
        if te > ts:
            out.append((unit, phase, ts, te))
    return out


def resolve_steps(steps: list[Any], resolve: Callable[[list], list]) -> None:
    """Every stamp of ``steps`` (``recorder.ShardedStep``s) made a time by ``resolve`` in one batch (CUDA: completed
    events, no sync); a collective timed on its own stream takes those times."""
    stamps: list[Any] = []
    for s in steps:
        stamps += [s.start, s.end, *(s.optimizer or (None, None))]
        for p in s.passes:
            stamps += [*p.forward, p.backward_start, p.backward_end]
        for seg in s.segments + s.waits:
            stamps += [seg[2], seg[3]]
        for c in s.colls:
            stamps += [c.start, c.end, *(c.device or (None, None))]
        for h in s.holes:
            stamps += h
        stamps += [m["ts"] for m in s.memory]
    times = iter(resolve(stamps))
    for s in steps:
        s.start, s.end = next(times), next(times)
        opt = [next(times), next(times)]
        s.optimizer = opt if s.optimizer else None
        for p in s.passes:
            p.forward = [next(times), next(times)]
            p.backward_start, p.backward_end = next(times), next(times)
        s.segments = [(u, ph, next(times), next(times)) for u, ph, _, _ in s.segments]
        s.waits = [(u, ph, next(times), next(times)) for u, ph, _, _ in s.waits]
        for c in s.colls:
            c.start, c.end = next(times), next(times)
            begin, end = next(times), next(times)
            if begin is not None and end is not None:  # CUDA: the collective's own stream times it
                c.start, c.end = begin, end
        s.holes = [(next(times), next(times)) for _ in s.holes]
        for m in s.memory:
            m["ts"] = next(times)
