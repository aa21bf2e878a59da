"""Cross-rank clock offsets, estimated over the process group (NTP-style).

Every rank's events are stamped on its own host clock. Before training and after it,
each rank ``r`` plays ping-pong with rank 0: it sends its time ``t0``, rank 0 answers
with its time ``T``, ``r`` reads ``t1`` on arrival. Assuming symmetric delays, rank 0's
clock read ``T`` at ``r``'s time ``(t0 + t1) / 2``, so ``offset = T - (t0 + t1) / 2``
and the error is at most half the round trip. The round with the smallest round trip
wins. Readers map a local time ``t`` to rank 0's axis as ``t + offset`` (interpolating
between the start and end estimates to follow drift, where they differ by more than
their round trips' halves: ``viz.run_files.clock_params``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ClockOffset:
    """Add ``offset_us`` to this rank's clock to get rank 0's clock (µs).

    ``rtt_us``: round trip of the sample used; the offset is exact to ``rtt_us / 2``.
    ``at_us``: when it was measured, on this rank's clock.
    """

    offset_us: float
    rtt_us: float
    at_us: float

    def to_json(self) -> dict:
        return asdict(self)


def best_offset(samples: Sequence[tuple[float, float, float]]) -> ClockOffset:
    """The estimate from the sample ``(t0, T, t1)`` with the smallest round trip."""
    if not samples:
        raise ValueError("best_offset needs at least one (t0, T, t1) sample")
    t0, ref, t1 = min(samples, key=lambda s: s[2] - s[0])
    mid = (t0 + t1) / 2.0
    return ClockOffset(offset_us=ref - mid, rtt_us=t1 - t0, at_us=mid)


def estimate_offsets(
    clock_us: Callable[[], float], group: dist.ProcessGroup | None = None, rounds: int = 16
) -> list[ClockOffset]:
    """Collective: every rank of ``group`` must call it. Returns all ranks' offsets.

    ``group`` must be a CPU-capable (gloo) group: host clocks are compared on the host.
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    buf = torch.zeros(1, dtype=torch.float64)
    mine = ClockOffset(offset_us=0.0, rtt_us=0.0, at_us=clock_us())
    for peer in range(1, world):
        if rank == 0:
            for _ in range(rounds):
                dist.recv(buf, src=peer, group=group)
                buf[0] = clock_us()
                dist.send(buf, dst=peer, group=group)
        elif rank == peer:
            samples = []
            for _ in range(rounds):
                t0 = clock_us()
                buf[0] = t0
                dist.send(buf, dst=0, group=group)
                dist.recv(buf, src=0, group=group)
                t1 = clock_us()
                samples.append((t0, float(buf[0]), t1))
            mine = best_offset(samples)
    local = torch.tensor([mine.offset_us, mine.rtt_us, mine.at_us], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(world)]
    dist.all_gather(gathered, local, group=group)
    return [ClockOffset(*t.tolist()) for t in gathered]
