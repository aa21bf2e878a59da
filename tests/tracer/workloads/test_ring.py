"""tracer/workloads/ring.py: the schedule (pure) and the ring all-reduce on real gloo process groups."""

from __future__ import annotations

import json

import pytest

from ddpscope.tracer.launch.torchrun import LaunchConfig, launch
from ddpscope.tracer.workloads.ring import ALL_GATHER, REDUCE_SCATTER, chunk_bounds, ring_schedule
from tests.conftest import workers_env

ITEM = {"torch.float32": 4, "torch.float64": 8, "torch.bfloat16": 2, "torch.int64": 8, "torch.int32": 4}


@pytest.mark.parametrize("numel, n", [(0, 3), (2, 4), (10, 3), (12, 4), (4097, 7)])
def test_chunk_bounds_cover_the_tensor_and_differ_by_at_most_one(numel, n):
    b = chunk_bounds(numel, n)
    assert len(b) == n and b[0][0] == 0
    assert all(s + l == s2 for (s, l), (s2, _) in zip(b, b[1:]))
    assert sum(l for _, l in b) == numel
    assert max(l for _, l in b) - min(l for _, l in b) <= 1


@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
def test_schedule_pairs_every_send_with_the_neighbours_receive(n):
    scheds = [ring_schedule(r, n) for r in range(n)]
    assert all(len(s) == 2 * (n - 1) for s in scheds)
    for k in range(2 * (n - 1)):
        for r in range(n):
            st, nxt = scheds[r][k], scheds[(r + 1) % n][k]
            assert st.send_to == (r + 1) % n and nxt.recv_from == r
            assert nxt.recv_chunk == st.send_chunk  # what r sends is what r+1 expects
            assert st.phase == (REDUCE_SCATTER if k < n - 1 else ALL_GATHER)
    # every rank sends each chunk but one in each phase
    for r in range(n):
        rs = {s.send_chunk for s in scheds[r][: n - 1]}
        ag = {s.send_chunk for s in scheds[r][n - 1:]}
        assert rs == set(range(n)) - {(r + 1) % n} and ag == set(range(n)) - {(r + 2) % n}


def test_bad_arguments_raise():
    with pytest.raises(ValueError):
        chunk_bounds(10, 0)
    with pytest.raises(ValueError):
        ring_schedule(3, 3)


@pytest.mark.ddp
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_equals_dist_all_reduce(tmp_path, n):
    result = launch(LaunchConfig(target="tests.workers.ring_check", args=["--out", str(tmp_path)], nproc=n,
                                 log_dir=tmp_path / "logs", timeout_s=180, env=workers_env()))
    assert result.ok, (result.reason, result.stderr_tail)
    per_rank = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(n)]
    cases = [c for c in per_rank[0] if not c.get("group")]
    assert len(cases) == 8 * 5 + 1 and all(c["ok"] for rank in per_rank for c in rank), \
        [c for rank in per_rank for c in rank if not c["ok"]]
    for i, case in enumerate(cases):
        assert case["steps"] == 2 * (n - 1)
        total = case["numel"] * ITEM.get(case["dtype"], 4)
        # summed over ranks, the ring sends exactly 2(N-1) tensors' worth of bytes
        assert sum(rank[i]["sent"] for rank in per_rank) == 2 * (n - 1) * total
        assert sum(rank[i]["received"] for rank in per_rank) == 2 * (n - 1) * total
        if case["numel"] > 0 and "float" in case["dtype"]:
            assert case["changed"]  # it really summed something
    sub = [c for rank in per_rank for c in rank if c.get("group")]
    assert len(sub) == 2 and all(c["ok"] and c["steps"] == 2 for c in sub)
