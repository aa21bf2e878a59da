"""Beyond this machine: the same trace's compute with the communication of another world
size and link. A *projection*, not a prediction: nothing here was measured.

A ring all-reduce of M bytes over N ranks on links of bandwidth B and latency a takes
``2(N-1) a + 2(N-1)/N x M / B`` (Patarasuk & Yuan; NCCL's ring). Under it the compute is
the trace's, with what communication took from it on this machine removed; on GPUs NCCL
runs beside compute on its own SMs, so the projection takes nothing from compute and runs
one all-reduce at a time (one NCCL stream).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from ddpscope.viz.whatif.cost import AllReduceCost
from ddpscope.viz.whatif.model import WhatIfModel


@dataclass(frozen=True, kw_only=True)
class Link:
    """Per-rank link: ``bandwidth_gbps`` GB/s (10^9 bytes/s, one direction), ``latency_us``
    per ring step (µs)."""

    bandwidth_gbps: float
    latency_us: float

    def __post_init__(self) -> None:
        if not (np.isfinite(self.bandwidth_gbps) and self.bandwidth_gbps > 0):
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {self.bandwidth_gbps}")
        if not (np.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(f"link latency must be >= 0 µs, got {self.latency_us}")


#: editable starting points (bus bandwidths as nccl-tests reports them for all-reduce)
LINK_PRESETS = {
    "NVLink (H100 SXM, one node)": Link(bandwidth_gbps=360.0, latency_us=3.0),
    "InfiniBand NDR 400 Gb/s": Link(bandwidth_gbps=45.0, latency_us=6.0),
    "InfiniBand HDR 200 Gb/s": Link(bandwidth_gbps=22.0, latency_us=7.0),
    "Ethernet 100 Gb/s (RoCE)": Link(bandwidth_gbps=11.0, latency_us=15.0),
    "Ethernet 25 Gb/s (TCP)": Link(bandwidth_gbps=2.8, latency_us=40.0),
}


def ring_cost(world_size: int, link: Link) -> AllReduceCost:
    """A ring all-reduce's cost on ``world_size`` ranks over ``link``."""
    if not 2 <= world_size <= 1_000_000:
        raise ValueError(f"world size must be in 2..1000000, got {world_size}")
    n = float(world_size)
    return AllReduceCost(latency_us=2 * (n - 1) * link.latency_us,
                         us_per_byte=2 * (n - 1) / n / (link.bandwidth_gbps * 1e3),
                         source=f"ring over {world_size} ranks, {link.bandwidth_gbps:g} GB/s, {link.latency_us:g} µs")


def project_model(fitted: WhatIfModel, world_size: int, link: Link) -> WhatIfModel:
    """``fitted`` with the communication of ``world_size`` ranks over ``link``: ring cost,
    one all-reduce at a time, no slowdown either way (GPU: NCCL has its own SMs)."""
    return dataclasses.replace(
        fitted, cost=ring_cost(world_size, link), lanes=1, comm_slowdown=0.0, steal_us_per_allreduce=0.0,
        steal_us_per_mib=0.0,
        notes=(f"projection: {world_size} ranks, ring all-reduce at {link.bandwidth_gbps:g} GB/s and "
               f"{link.latency_us:g} µs per step; compute as traced",))
