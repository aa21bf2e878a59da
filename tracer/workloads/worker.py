"""What every workload job that ddpscope starts shares: set-up of the rank, rank 0's
updates of ``run.json``, and test-only fault injection."""

from __future__ import annotations

import os

from tracer import format as fmt
from tracer.writer import read_json, write_json_atomic

# Test-only failure injection, "RANK:AT": raise (FAIL) or block forever (HANG) when that
# rank reaches step / round / stage AT (each job says which).
FAIL_ENV = "DDPSCOPE_TEST_FAIL"
HANG_ENV = "DDPSCOPE_TEST_HANG"


def injected(env: str, rank: int) -> int | None:
    """Where ``env`` ("RANK:AT") injects a fault on ``rank``, or None."""
    raw = os.environ.get(env)
    if not raw:
        return None
    r, s = raw.split(":")
    return int(s) if int(r) == rank else None


def update_run_json(out: str | os.PathLike, fields: dict) -> None:
    """Merge ``fields`` into the run folder's ``run.json`` (the runner may have written facts)."""
    path = os.path.join(out, fmt.RUN_FILE)
    run = read_json(path) if os.path.exists(path) else {"format": fmt.FORMAT, "version": fmt.VERSION}
    run.update(fields)
    write_json_atomic(path, run)


def init_worker(pg_timeout_s: float):
    """Set this rank up and join the job's process group: the local GPU and NCCL where
    CUDA is present, else gloo with the rank bound to its share of the cores (less
    scheduling noise). Returns this rank's ``torch.device``."""
    import datetime

    import torch
    import torch.distributed as dist

    from tracer.workloads.affinity import bind_local_rank_to_cores

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        bind_local_rank_to_cores()  # before the process group: its threads inherit it
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    return device
