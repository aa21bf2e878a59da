"""A ring all-reduce built from the process group's point-to-point ``isend``/``irecv``
(batched per step with ``batch_isend_irecv``).

The textbook algorithm (Patarasuk & Yuan; what NCCL's ring does): the flat tensor is cut
into N chunks; in N-1 *reduce-scatter* steps every rank sends one chunk to its right
neighbour and adds the chunk arriving from its left one, so that afterwards rank r holds
chunk (r+1) mod N summed over all ranks; in N-1 *all-gather* steps those reduced chunks
travel once more around the ring, overwriting. Each rank sends 2(N-1) chunks, i.e.
2(N-1)/N of the tensor's bytes, whatever N is.

``ring_schedule`` is the pure schedule (which chunk moves where at each step); the
dashboard replays the chunk states from the schedule a trace records, and tests check
that against the algorithm's invariants.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ddpscope.tracer.capture.clock import CpuClock
from ddpscope.tracer.format import ALL_GATHER, REDUCE_SCATTER


def chunk_bounds(numel: int, n: int) -> list[tuple[int, int]]:
    """(start, length) of each of the ``n`` chunks of ``numel`` elements: the first
    ``numel % n`` chunks get one element more (as ``torch.tensor_split`` cuts)."""
    if n < 1 or numel < 0:
        raise ValueError(f"need n >= 1 and numel >= 0, got n={n}, numel={numel}")
    base, extra = divmod(numel, n)
    out, start = [], 0
    for c in range(n):
        length = base + (1 if c < extra else 0)
        out.append((start, length))
        start += length
    return out


@dataclass(frozen=True)
class ScheduledStep:
    """Step ``step`` (0-based over both phases) of one rank: it sends chunk ``send_chunk``
    to rank ``send_to`` and receives chunk ``recv_chunk`` from rank ``recv_from``."""

    step: int
    phase: str
    phase_step: int  # 0-based within the phase
    send_chunk: int
    recv_chunk: int
    send_to: int
    recv_from: int


def ring_schedule(rank: int, n: int) -> list[ScheduledStep]:
    """The 2(N-1) steps of ``rank`` in an ``n``-rank ring (empty for n = 1)."""
    if not 0 <= rank < n:
        raise ValueError(f"rank must be in 0..{n - 1}, got {rank}")
    right, left = (rank + 1) % n, (rank - 1) % n
    steps = []
    for s in range(n - 1):  # rank r ends up owning chunk (r+1) mod n, fully reduced
        steps.append(ScheduledStep(s, REDUCE_SCATTER, s, (rank - s) % n, (rank - s - 1) % n, right, left))
    for s in range(n - 1):  # then passes each reduced chunk on, starting with its own
        steps.append(ScheduledStep(n - 1 + s, ALL_GATHER, s, (rank + 1 - s) % n, (rank - s) % n, right, left))
    return steps


@dataclass(frozen=True)
class RingStepRecord:
    """One executed step on one rank. Times: µs on the clock passed in; ``comm_end_us``
    is when both the send and the receive completed, ``end_us`` when the received chunk
    was added in (reduce-scatter) or landed (all-gather, received in place)."""

    step: int
    phase: str
    phase_step: int
    send_chunk: int
    recv_chunk: int
    send_to: int
    recv_from: int
    send_bytes: int
    recv_bytes: int
    start_us: float
    comm_end_us: float
    end_us: float

    def to_json(self) -> dict:
        return asdict(self)


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    clock_us: Callable[[], float] | None = None,
                    sync: Callable[[], None] | None = None) -> list[RingStepRecord]:
    """Sum ``tensor`` over all ranks of ``group`` in place, by ring; returns this rank's
    step records. Collective: every rank must call it with a tensor of the same shape and
    dtype. ``sync`` (CUDA: ``torch.cuda.synchronize``) is called before each time stamp so
    that stamps mean "the device got there", at the cost of one sync per step.
    ``clock_us``: µs now (default: the host monotonic clock, ``clock.CpuClock``)."""
    clock_us = clock_us or CpuClock().host_us
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if n == 1:
        return []
    flat = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    bounds = chunk_bounds(flat.numel(), n)
    item = flat.element_size()
    recv_buf = torch.empty(max(length for _, length in bounds), dtype=flat.dtype, device=flat.device)
    # Ranks in the group's numbering; send/recv take global ranks.
    peer = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    records = []
    for st in ring_schedule(rank, n):
        s0, s_len = bounds[st.send_chunk]
        r0, r_len = bounds[st.recv_chunk]
        reduce = st.phase == REDUCE_SCATTER
        dst_view = recv_buf[:r_len] if reduce else flat.narrow(0, r0, r_len)
        if sync:
            sync()  # CPU-GPU sync: the step starts once the previous one finished on the device
        t0 = clock_us()
        # Empty chunks (numel < N) are skipped on both sides: both know the sizes. The send
        # and the receive go out as one batch: on NCCL, a separate send and receive to
        # the same peer (N = 2) would each wait for the other side's second call.
        ops = []
        if s_len:
            ops.append(dist.P2POp(dist.isend, flat.narrow(0, s0, s_len), peer(st.send_to), group))
        if r_len:
            ops.append(dist.P2POp(dist.irecv, dst_view, peer(st.recv_from), group))
        for w in dist.batch_isend_irecv(ops) if ops else ():
            w.wait()
        if sync:
            sync()  # CPU-GPU sync (per step, by design: the trace times each step)
        t1 = clock_us()
        if reduce and r_len:
            flat.narrow(0, r0, r_len).add_(dst_view)
            if sync:
                sync()  # CPU-GPU sync
        t2 = clock_us()
        records.append(RingStepRecord(st.step, st.phase, st.phase_step, st.send_chunk, st.recv_chunk,
                                      st.send_to, st.recv_from, s_len * item, r_len * item, t0, t1, t2))
    if flat.data_ptr() != tensor.data_ptr():  # worked on a contiguous copy
        tensor.copy_(flat.view_as(tensor))
    return records
