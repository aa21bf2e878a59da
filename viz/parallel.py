"""Parsing on every core: a list of files, each parsed by its own function call, in
worker processes when it is worth it.

Parsing JSON into tables is Python-bound (the GIL), so threads would not help; worker
processes do, at the cost of starting them (~0.5 s: a forkserver, safe in a threaded
server such as Streamlit's, imports the parsing module once, and its workers, forked
from it, share those pages) and of sending the tables back (pickled frames). Below ``MIN_PARALLEL_BYTES`` of input, or on one core, the files are
parsed here, in order.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")

#: below this much input (bytes), starting workers costs more than it saves
MIN_PARALLEL_BYTES = 24 * 2**20


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def map_on_cores(fn: Callable[..., T], calls: Sequence[tuple], sizes: Sequence[int]) -> list[T]:
    """``[fn(*args) for args in calls]``, on every core when the inputs (``sizes``,
    bytes, one per call) are big enough; the largest first, so no core idles at the
    end. ``fn`` must be a module-level function. An exception of a call is raised here."""
    workers = min(cores(), len(calls))
    if workers < 2 or sum(sizes) < MIN_PARALLEL_BYTES:
        return [fn(*args) for args in calls]
    order = sorted(range(len(calls)), key=lambda i: -sizes[i])
    ctx = multiprocessing.get_context("forkserver")
    # the server imports fn's module once; workers forked from it share those pages
    # (taking effect when the server starts: the first call in this process)
    ctx.set_forkserver_preload([fn.__module__])
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        futures = {i: pool.submit(fn, *calls[i]) for i in order}
        return [futures[i].result() for i in range(len(calls))]
