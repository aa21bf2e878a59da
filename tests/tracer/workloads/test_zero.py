"""tracer/zero.py: the profiler-based step measurements, on real profiles (one process)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from ddpscope.tracer.workloads.zero import STEP_MARK, _collective, analyze_profile

MIB = 2**20


def test_peak_and_running_total_follow_real_allocations():
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        keep = torch.empty(3 * MIB, dtype=torch.uint8)  # before the step: in the running total
        with record_function(STEP_MARK):
            a = torch.empty(2 * MIB, dtype=torch.uint8)
            b = torch.empty(5 * MIB, dtype=torch.uint8)
            del a, b  # peak 3 + 2 + 5 MiB, then back to 3
        with record_function(STEP_MARK):
            c = torch.empty(1 * MIB, dtype=torch.uint8)
    steps = analyze_profile(prof.profiler.kineto_results.events(), world=2)
    assert len(steps) == 2
    assert steps[0].start_bytes == 3 * MIB and steps[0].peak_bytes == 10 * MIB and steps[0].end_bytes == 3 * MIB
    assert steps[1].peak_bytes == steps[1].end_bytes == 4 * MIB
    assert steps[0].comm == {} and keep.numel() and c.numel()


def test_collective_sizes_from_backend_events():
    assert _collective("gloo:all_reduce", [[1000]], ["float"], 4, 4) == ("all_reduce", 4000, 2 * 0.75 * 4000)
    assert _collective("gloo:all_gather", [[250]], ["float"], 4, 4) == ("all_gather", 4000, 0.75 * 4000)
    assert _collective("nccl:_reduce_scatter_base", [[1000]], ["c10::BFloat16"], 4, 4) == \
        ("reduce_scatter", 2000, 0.75 * 2000)
    assert _collective("gloo:broadcast", [[10, 10]], ["double"], 2, 4) == ("broadcast", 800, 400.0)
    assert _collective("gloo:barrier", [[]], [""], 2, 4) is None
