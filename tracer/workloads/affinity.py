"""CPU placement of ranks: each local rank gets its own, even share of the cores.

For CPU (gloo) jobs. Without it, ranks on a small machine preempt each other's threads
for milliseconds at random, which shows up in every timeline as noise. Call it in the
worker before ``init_process_group`` so the process group's threads inherit it.
"""

from __future__ import annotations

import os


def bind_local_rank_to_cores() -> set[int] | None:
    """Bind this process to its share of the cores allowed to it; the set, or None when
    binding is unsupported or there are fewer cores than local ranks."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cores = sorted(os.sched_getaffinity(0))
    if local_world < 1 or len(cores) < local_world or local_world == 1:
        return None
    share = len(cores) // local_world
    mine = set(cores[local_rank * share:(local_rank + 1) * share])
    os.sched_setaffinity(0, mine)
    return mine
