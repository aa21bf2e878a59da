"""The backend tap's pieces that need no DeepSpeed (tracer/capture/deepspeed/comm.py):
message bytes, the collective's own signature read through a decorator that does not
``functools.wraps`` (as DeepSpeed's ``stage_on_cpu`` does), and a patched class that
hands on unchanged while no tap is attached, and the short path of a bucket's reductions
against a stand-in backend (a recorder of its own). The real collectives are timed in
``test_tracer.py`` (real DeepSpeed jobs)."""

from __future__ import annotations

import pytest
import torch

from ddpscope.tracer.capture.clock import CpuClock
from ddpscope.tracer.capture.deepspeed import comm
from ddpscope.tracer.capture.sharded.recorder import BACKWARD, FORWARD, ROOT, ShardedRecorder


def _no_wraps(func):  # DeepSpeed's stage_on_cpu: wrapper(self, *args, **kwargs), the function in its closure
    def wrapper(self, *args, **kwargs):
        return func(self, *args, **kwargs)

    return wrapper


class Backend:
    @_no_wraps
    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        return ("gathered", output_tensor.numel(), async_op)

    def all_reduce(self, tensor, op=None, group=None, async_op=False):
        return ("reduced", tensor.numel())


def test_message_bytes_of_tensors_and_lists():
    assert comm.nbytes(torch.zeros(10)) == 40
    assert comm.nbytes([torch.zeros(3, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.float64)]) == 6 + 16
    assert comm.nbytes(None) == 0


def test_the_signature_is_the_collectives_own_through_a_decorator_without_wraps():
    sig = comm._signature(Backend.__dict__["all_gather_into_tensor"], "all_gather_into_tensor")
    assert list(sig.parameters) == ["self", "output_tensor", "input_tensor", "group", "async_op"]
    bound = sig.bind(Backend(), torch.zeros(8), torch.zeros(4), None, True).arguments
    assert comm.nbytes(bound[comm.OPS["all_gather_into_tensor"][1]]) == 32 and bound["async_op"] is True


def test_a_patched_backend_hands_on_unchanged_without_a_tap():
    class Mine(Backend):
        pass

    Mine.all_gather_into_tensor = Backend.__dict__["all_gather_into_tensor"]  # its own, to be patched
    comm.patch_backend(Mine)
    comm.patch_backend(Mine)  # once per process: a second patch is a no-op
    assert getattr(Mine.__dict__["all_gather_into_tensor"], "_ddpscope", False)
    assert getattr(Mine.__dict__["all_gather_into_tensor"], "__wrapped__", None) is not None
    b = Mine()
    assert b.all_gather_into_tensor(torch.zeros(8), torch.zeros(4), async_op=True) == ("gathered", 8, True)
    assert "all_reduce" not in Mine.__dict__  # only what the class itself defines


class _Guard:
    broken = None

    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def fail(self, e: BaseException) -> None:
        self.errors.append(e)
        self.broken = str(e)


class _Clock(CpuClock):
    def __init__(self) -> None:
        super().__init__()
        self.skew_ns = 7_000_000_000  # 7 s: the short path's ns stamps must get it as the clock's own do


def test_synchronous_collectives_on_the_short_path_become_the_records_of_their_issuers():
    """A synchronous collective is recorded bare (two ns stamps and a tuple into the step)
    and becomes a record when the step is emitted: a bucket's reductions with the bucket's
    unit, pass and args; an all-gather called by ZeRO's after-step gather
    (``all_gather_dp_groups``) in the optimizer step as ``param_allgather``; any other as
    ``other``; each with its bytes and span, in start order among the async gathers
    (recorded as launched), cut out of compute. The live file says the rank is in it while
    it runs; an error of the collective reaches the caller once, the collective run once."""
    calls: list[str] = []
    seen_where: list = []

    class Mine:
        def all_reduce(self, tensor, op=None, group=None, async_op=False):
            calls.append("all_reduce")
            seen_where.append(comm._TAP.where())  # as the live file's thread reads it
            if tensor.numel() == 3:
                raise RuntimeError("the script's own error")
            return None

        def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
            calls.append("all_gather")
            return None  # nothing to watch: done as launched

    def all_gather_dp_groups(b):  # named as DeepSpeed's after-step gather
        b.all_gather_into_tensor(torch.zeros(6), torch.zeros(3))

    comm.patch_backend(Mine)
    emitted: list = []
    rec = ShardedRecorder(clock=_Clock(), emit=emitted.append)
    guard = _Guard()
    a_w, b_b, c_w, d_w = torch.zeros(3, 2), torch.zeros(4), torch.zeros(5), torch.zeros(1)  # parameters
    d_w.ds_numel = 7  # a ZeRO-3 parameter holds its partition: a bucket counts it whole
    tap = comm.CommTap(rec, {id(a_w): 2, id(b_b): 2, id(c_w): 3}, {}, guard,
                       {id(a_w): "a.weight", id(b_b): "b.bias", id(c_w): "c.weight"})
    tap.attach(Mine)
    b = Mine()
    try:
        rec.on_forward_start()
        rec.enter(ROOT, BACKWARD)
        tap.bucket = comm.bucket_mark([a_w, c_w, d_w, c_w, b_b])
        first = tap.bucket
        assert b.all_reduce(torch.zeros(10), None, None, False) is None  # positional, as DeepSpeed calls it
        assert seen_where[-1] == (2, BACKWARD, "all_reduce") and rec.where != seen_where[-1]
        tap.bucket = None
        b.all_gather_into_tensor(torch.zeros(8), torch.zeros(4), async_op=True)  # async: recorded as launched
        comm.bucket_done(first)
        tap.bucket = comm.bucket_mark([c_w])
        b.all_reduce(tensor=torch.zeros(4, dtype=torch.float64))
        with pytest.raises(RuntimeError, match="the script's own error"):
            b.all_reduce(torch.zeros(3))
        tap.bucket = None
        assert len(rec.current.raw) == 3 and len(rec.current.colls) == 1  # recorded bare until emitted
        rec.leave(ROOT, BACKWARD)
        rec.on_backward_end()
        rec.on_optimizer_start()
        tap.in_step = True
        b.all_reduce(torch.zeros(1))  # the gradient norm's
        all_gather_dp_groups(b)
        tap.in_step = False
        rec.on_optimizer_end()
        rec.finish(aborted=False)
    finally:
        tap.detach()
    assert calls == ["all_reduce", "all_gather", "all_reduce", "all_reduce", "all_reduce", "all_gather"]  # once each
    assert guard.errors == []
    (s,) = emitted
    assert s.raw == []
    got = [(c.kind, c.unit, c.phase, c.nbytes, (c.extra or {}).get("zero"), (c.extra or {}).get("bucket"),
            (c.extra or {}).get("op")) for c in s.colls]
    assert got == [("all_reduce", 2, BACKWARD, 40, comm.GRAD_BUCKET, 0, "all_reduce"),
                   ("all_gather", -1, BACKWARD, 32, comm.OTHER, None, "all_gather_into_tensor"),
                   ("all_reduce", 3, BACKWARD, 32, comm.GRAD_BUCKET, 1, "all_reduce"),
                   ("all_reduce", 3, BACKWARD, 12, comm.GRAD_BUCKET, 1, "all_reduce"),
                   ("all_reduce", -1, "optimizer", 4, comm.OTHER, None, "all_reduce"),
                   ("all_gather", -1, "optimizer", 24, comm.PARAM_ALLGATHER, None, "all_gather_into_tensor")]
    assert s.colls[0].extra["first_param"] == "a.weight" and s.colls[0].extra["params"] == 5
    assert s.colls[0].extra["numels"] == [6, 5, 7, 5, 4]  # each entry's elements, in the bucket's order
    assert s.colls[2].extra["numels"] == s.colls[3].extra["numels"] == [5]
    # the whole reduction's time where its end was stamped (bucket_done), none where it never ended
    assert s.colls[0].extra["reduce_us"] >= (s.colls[0].end - s.colls[0].start) - 1e-3
    assert "reduce_us" not in s.colls[2].extra
    assert not any(c.prefetch for c in s.colls)
    starts = [c.start for c in s.colls]
    assert starts == sorted(starts) and all(c.end >= c.start for c in s.colls)
    assert s.start <= starts[0] and s.colls[-1].end <= s.end  # the skew applied: on the clock's axis
    for c in s.colls:
        if c.kind == "all_reduce":  # no compute inside a reduction
            assert not any(a < c.end and b > c.start for _, _, a, b in s.segments)


def test_a_buckets_async_and_synchronous_collectives_share_its_number_and_the_pass_comes_from_the_stamps():
    """A bucket reduced by an async collective (recorded as launched) and a synchronous one
    (the short path) is one bucket, numbered in the step by when it was first reduced; the
    pass of a short-path record is read from the step's stamps when it is emitted: forward
    before the backward starts, backward after, the optimizer from its start."""

    class Mine:
        def all_reduce(self, tensor, op=None, group=None, async_op=False):
            return None

    comm.patch_backend(Mine)
    emitted: list = []
    rec = ShardedRecorder(clock=_Clock(), emit=emitted.append)
    guard = _Guard()
    w1, w2 = torch.zeros(2), torch.zeros(3)
    tap = comm.CommTap(rec, {id(w1): 1, id(w2): 4}, {}, guard, {id(w1): "l1.weight", id(w2): "l2.weight"})
    tap.attach(Mine)
    b = Mine()
    try:
        rec.on_forward_start()
        rec.enter(ROOT, FORWARD)
        b.all_reduce(torch.zeros(2))  # in the forward: "other"
        rec.leave(ROOT, FORWARD)
        rec.on_forward_end()
        rec.enter(ROOT, BACKWARD)
        tap.bucket = comm.bucket_mark([w2])
        b.all_reduce(torch.zeros(5), None, None, True)  # async: recorded as launched
        b.all_reduce(torch.zeros(6))
        tap.bucket = comm.bucket_mark([w1, w2])
        b.all_reduce(torch.zeros(7))
        tap.bucket = None
        rec.leave(ROOT, BACKWARD)
        rec.on_backward_end()
        rec.on_optimizer_start()
        b.all_reduce(torch.zeros(1))
        rec.on_optimizer_end()
        rec.finish(aborted=False)
    finally:
        tap.detach()
    assert guard.errors == []
    (s,) = emitted
    got = [(c.nbytes // 4, c.unit, c.phase, (c.extra or {}).get("zero"), (c.extra or {}).get("bucket"),
            (c.extra or {}).get("last_param")) for c in s.colls]
    assert got == [(2, -1, FORWARD, comm.OTHER, None, None),
                   (5, 4, BACKWARD, comm.GRAD_BUCKET, 0, "l2.weight"),
                   (6, 4, BACKWARD, comm.GRAD_BUCKET, 0, "l2.weight"),
                   (7, 1, BACKWARD, comm.GRAD_BUCKET, 1, "l2.weight"),
                   (1, -1, "optimizer", comm.OTHER, None, None)]
    assert not any(comm._MARK in (c.extra or {}) for c in s.colls)  # marks never reach the trace
