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


# Set by the lab (launch/lab.py) in each emulated node's ranks: several "nodes" share this
# machine's GPUs (NCCL refuses two ranks on one GPU) and their links are shaped veth pairs
# that NCCL would bypass (shared memory, P2P): ddpscope's own jobs stay on gloo there.
EMULATED_ENV = "DDPSCOPE_EMULATED_NODE"


def why_not_cuda(cuda_available: bool, gpus: int, local_ranks: int, emulated: bool) -> str | None:
    """Why this job's ranks cannot each have a GPU and NCCL (None: they can), in one line."""
    if not cuda_available:
        return "no CUDA device"
    if emulated:
        return "emulated nodes share this machine's GPUs, and NCCL would bypass their shaped links: gloo on CPU"
    if local_ranks > gpus:
        return (f"{local_ranks} ranks on this node and {gpus} GPU{'s' * (gpus != 1)}: NCCL needs a GPU of its own "
                f"for each rank; gloo on CPU (give --nproc {gpus} for NCCL)")
    return None


def why_not_as_run(gpus: int, local_ranks: int, backend: str) -> str | None:
    """Why this node cannot run a traced run's ``local_ranks`` ranks on CUDA with its
    ``backend`` again (None: it can): gloo's ranks may share GPUs, NCCL's need one each."""
    if gpus == 0:
        return "no CUDA device"
    if backend == "nccl" and local_ranks > gpus:
        return f"{gpus} GPU{'s' * (gpus != 1)} for its {local_ranks} ranks a node (NCCL needs one for each)"
    return None


def init_worker(pg_timeout_s: float, bind: bool = True, device_type: str | None = None,
                backend: str | None = None):
    """Set this rank up and join the job's process group: its own GPU and NCCL where every
    rank of the node has one (``why_not_cuda``; else said once, by local rank 0), else gloo
    with the rank bound to its share of the cores (less scheduling noise; ``bind=False``
    leaves it on every core, as a script that does not bind itself runs). Returns this
    rank's ``torch.device``.

    ``device_type`` and ``backend`` ("cpu" and "gloo", "cuda" and "nccl" or "gloo"): a traced
    run's own, for a job that measures what that run ran on (the calibration): CPU even
    where GPUs are; CUDA or a ``RuntimeError`` saying why not (the launcher checks first),
    ranks sharing the GPUs round-robin on gloo as such a run's did."""
    import datetime
    import sys

    import torch
    import torch.distributed as dist

    from ddpscope.tracer.workloads.affinity import bind_local_rank_to_cores

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    available = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if available else 0
    if device_type == "cuda":
        if (why := why_not_as_run(gpus, local_ranks, str(backend))) is not None:
            raise RuntimeError(f"the run ran on CUDA ({backend}), and this node has {why}")
    elif device_type == "cpu":
        why = "the run ran on CPU"
    else:
        why = why_not_cuda(available, gpus, local_ranks, os.environ.get(EMULATED_ENV) == "1")
        if available and why is not None and local_rank == 0:
            print(f"ddpscope: {why}", file=sys.stderr, flush=True)
    if why is None:
        torch.cuda.set_device(local_rank % gpus)  # gloo's ranks may share a GPU; NCCL's have one each
        device = torch.device("cuda", local_rank % gpus)
    else:
        device = torch.device("cpu")
        if bind:
            bind_local_rank_to_cores()  # before the process group: its threads inherit it
    dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"),
                            timeout=datetime.timedelta(seconds=pg_timeout_s))
    return device
