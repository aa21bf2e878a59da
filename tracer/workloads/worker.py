"""What every workload job that ddpscope starts shares: set-up of the rank and
test-only fault injection (``run.json`` updates: ``tracer.writer.update_run_json``)."""

from __future__ import annotations

import os

# Test-only failure injection, "RANK:AT": raise (FAIL) or block forever (HANG) when that
# rank reaches step / round / stage AT (each job says which).
FAIL_ENV = "DDPSCOPE_TEST_FAIL"
HANG_ENV = "DDPSCOPE_TEST_HANG"
# Test-only, in the demo's forward: "RANK:STEP" sleeps forever inside the model's forward
# at that step (a rank stuck in Python); "RANK:MS" sleeps MS ms in every forward (a straggler).
STALL_ENV = "DDPSCOPE_TEST_STALL_FORWARD"
DELAY_ENV = "DDPSCOPE_TEST_DELAY_FORWARD"


def injected(env: str, rank: int) -> int | None:
    """Where ``env`` ("RANK:AT") injects a fault on ``rank``, or None."""
    raw = os.environ.get(env)
    if not raw:
        return None
    r, s = raw.split(":")
    return int(s) if int(r) == rank else None


def init_worker(pg_timeout_s: float, bind: bool = True):
    """Set this rank up and join the job's process group: the local GPU and NCCL where
    CUDA is present, else gloo with the rank bound to its share of the cores (less
    scheduling noise; ``bind=False`` leaves it on every core, as a script that does not
    bind itself runs). Returns this rank's ``torch.device``."""
    import datetime

    import torch
    import torch.distributed as dist

    from ddpscope.tracer.workloads.affinity import bind_local_rank_to_cores

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if bind:
            bind_local_rank_to_cores()  # before the process group: its threads inherit it
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    return device
