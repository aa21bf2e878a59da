"""Where ddpscope's own jobs (demo, ring, ZeRO, calibration) run: NCCL only where each rank
of a node has a GPU of its own and the nodes are real; else gloo on CPU, said in one line."""

from __future__ import annotations

from ddpscope.tracer.launch.lab import Lab
from ddpscope.tracer.workloads.worker import EMULATED_ENV, why_not_cuda


def test_nccl_only_where_every_rank_has_its_own_gpu_and_the_nodes_are_real():
    assert why_not_cuda(True, 2, 2, emulated=False) is None
    assert why_not_cuda(True, 8, 4, emulated=False) is None
    too_many = why_not_cuda(True, 1, 2, emulated=False)  # the demo's 2 ranks on a 1-GPU machine
    assert "2 ranks on this node and 1 GPU" in too_many and "--nproc 1" in too_many and "\n" not in too_many
    assert "shaped links" in why_not_cuda(True, 8, 2, emulated=True)  # --emulate-nodes: several nodes, one machine
    assert why_not_cuda(False, 0, 2, emulated=False) == "no CUDA device"


def test_the_lab_tells_its_ranks_that_their_nodes_are_emulated():
    assert Lab(2, "100mbit").env()[EMULATED_ENV] == "1"
