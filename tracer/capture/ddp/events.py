"""A step's Chrome trace events: what the recorder hands the writer once a step is resolved.

One span per step, per pass (forward, backward, the wait for DDP's all-reduces), for
the optimizer, per bucket all-reduce (on its own lane), for ZeRO-1's parameter
broadcasts (on theirs, inside the optimizer's span) and for DDP's own collectives that
are not buckets (the unused-parameter map's all-reduce, on theirs), a gradient-ready mark
per parameter (on the steps that mark them: ``recorder._marks``) and a memory counter on
measured steps. It runs on the training thread for every step, so it is written for
speed: plain loops and literals, the marks (most of a step's events) as msgspec structs,
no rounding of times that are µs at ns resolution (``clock.py``), names made once per
bucket layout.
"""

from __future__ import annotations

from typing import Iterator

import msgspec

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.ddp.records import StepRecord
from ddpscope.tracer.capture.rank_files import thread_meta


class _GradArgs(msgspec.Struct):
    step: int
    param: int
    micro: int


class GradReady(msgspec.Struct):
    """A gradient-ready mark, the Chrome instant event ``{"ph": "i", "s": "t", "cat":
    "grad", "name", "pid", "tid", "ts", "args": {"step", "param", "micro"}}`` as the writer
    encodes it. Most of a step's events are these: 77 structs are built in 37 µs where the
    same dicts took 67 µs (warm, rounding included), and ``ts`` (µs at ns resolution,
    clock.py) needs no rounding (77 marks then take 13 µs)."""

    name: str
    pid: int
    ts: float
    args: _GradArgs
    ph: str = "i"
    s: str = "t"
    cat: str = fmt.CAT_GRAD
    tid: int = fmt.TID_GRADS


class StepEvents:
    """Turns one rank's resolved steps into trace events; names each bucket's lane the
    first time that bucket appears."""

    def __init__(self, rank: int, param_names: list[str]) -> None:
        self.rank = rank
        self.param_names = param_names
        self.buckets_seen: set[int] = set()
        self.param_sync_seen = False
        self.own_seen = False
        self._bucket_names_cache: dict[tuple[int, ...], list[str]] = {}

    def events(self, steps: list[StepRecord], nccl: list | None = None) -> Iterator[dict | GradReady]:
        """The events of resolved steps (their stamps are µs); ``nccl``: per step, each
        bucket's NCCL kernel µs or None."""
        for n, s in enumerate(steps):
            yield from self._events(s, nccl[n] if nccl else None)

    def _events(self, s: StepRecord, nccl: list | None) -> list[dict]:
        # Runs on the training thread for every step: plain loops and literals (a step
        # of the demo GPT is ~100 events, ~80 of them gradient-ready marks).
        pid, step = self.rank, s.step
        start, end = s.start, s.end
        opt_s, opt_e = s.optimizer if s.optimizer else (None, None)
        passes = [(p.forward[0], p.forward[1], p.backward_start, p.backward_end, p.sync_end) for p in s.passes]
        grads = s.grads
        buckets = [(b, b.launch, b.done) for b in s.buckets]

        def span(cat, name, ts, te, args, tid=fmt.TID_COMPUTE, inside=True):
            """A complete event (None if it never started); ``inside``: kept inside its
            step, as Perfetto requires of children."""
            if ts is None:
                return None
            te = ts if te is None else te
            if inside:
                ts, te = max(ts, start), min(te, end)
            # times are µs at ns resolution (clock.py); a difference of two needs rounding back
            return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                    "ts": ts, "dur": round(te - ts, 3) if te > ts else 0.0, "args": args}

        flags = {"step": step, "micro_batches": len(passes), "warmup": s.warmup}
        if s.memory:
            flags["memory"] = s.memory
        if s.incomplete:
            flags["incomplete"] = True
        if not s.grad_marks:  # its one gradient stamp gives backward's compute end, no mark
            flags["grad_marks"] = False
        ev = [span(fmt.CAT_STEP, f"step {step}", start, end, flags, inside=False)]
        many = len(passes) > 1
        last_grad: dict[int, float] = {}  # per pass: where its backward ended if not recorded
        for _, t, k in grads:
            if t is not None and (k not in last_grad or t > last_grad[k]):
                last_grad[k] = t
        for k, (rec, (fs, fe, bs, be, sync_e)) in enumerate(zip(s.passes, passes)):
            suffix = f" (micro-batch {k}{'' if rec.sync else ', no_sync'})" if many else ""
            ev.append(span(fmt.CAT_FORWARD, "forward" + suffix, fs, fe, {"step": step, "micro": k, "sync": rec.sync}))
            bwd_end = be if be is not None else last_grad.get(k)
            if bwd_end is not None:
                b_start = bs if bs is not None else (fe or start)
                b_args = {"step": step, "micro": k, "sync": rec.sync}
                if k in last_grad and b_start is not None:
                    # backward compute: from its start to its last gradient; what follows within the
                    # span is autograd finishing (DDP's finalize can wait there): waiting, not compute
                    b_args["compute_us"] = round(max(0.0, min(last_grad[k], bwd_end) - max(b_start, start)), 3)
                ev.append(span(fmt.CAT_BACKWARD, "backward" + suffix, b_start, bwd_end, b_args))
                if rec.sync and sync_e is not None:
                    ev.append(span(fmt.CAT_GRAD_SYNC, "wait for all-reduce", bwd_end, sync_e,
                                   {"step": step, "micro": k, "sync": rec.sync}))
        ev.append(span(fmt.CAT_OPTIMIZER, "optimizer.step", opt_s, opt_e, {"step": step}))
        ps = s.param_sync
        if ps is not None and ps.start is not None:
            if not self.param_sync_seen:
                self.param_sync_seen = True
                ev += thread_meta(pid, fmt.TID_PARAM_SYNC, "parameter broadcast (ZeRO-1)")
            ev.append(span(fmt.CAT_PARAM_SYNC, "parameter broadcast", ps.start, ps.end,
                           {"step": step, "bytes": ps.nbytes, "own_bytes": ps.own_bytes, "broadcasts": ps.broadcasts,
                            **({} if ps.end is not None else {"incomplete": True})}, tid=fmt.TID_PARAM_SYNC))
        for o in s.own:  # DDP's own collectives: their lane, never a bucket's
            if not self.own_seen:
                self.own_seen = True
                ev += thread_meta(pid, fmt.TID_DDP_OWN, "collectives outside the buckets (DDP's own, the script's)")
            ev.append(span(fmt.CAT_DDP_OWN, o.name, o.launch, o.done if o.done is not None else end,
                           {"step": step, "bytes": o.nbytes, **({} if o.done is not None else {"incomplete": True}),
                            **({"launch_only": True} if o.launch_only else {})},
                           tid=fmt.TID_DDP_OWN, inside=False))
        names, n_names = self.param_names, len(self.param_names)
        if s.grad_marks:
            ev += [GradReady(names[i] if 0 <= i < n_names else f"param[{i}]", pid, t, _GradArgs(step, i, k))
                   for i, t, k in grads if t is not None]
        for n, (b, launch, done) in enumerate(buckets):
            if b.index not in self.buckets_seen:
                self.buckets_seen.add(b.index)
                ev += thread_meta(pid, fmt.TID_BUCKET_BASE + b.index, f"all-reduce bucket {b.index}")
            args = {"step": step, "bucket": b.index, "bytes": b.nbytes, "params": self._bucket_names(b.params)}
            if done is None:
                args["incomplete"] = True
            if nccl and nccl[n] is not None:
                args["nccl_kernel_us"] = nccl[n]
            ev.append(span(fmt.CAT_ALLREDUCE, f"bucket {b.index}", launch, done if done is not None else end,
                           args, tid=fmt.TID_BUCKET_BASE + b.index, inside=False))
        if s.memory:
            ev.append({"ph": "C", "cat": fmt.CAT_MEMORY, "name": "memory", "pid": pid,
                       "ts": end, "args": dict(s.memory)})
        return [e for e in ev if e is not None]

    def _bucket_names(self, params: tuple[int, ...]) -> list[str]:
        """A bucket's parameter names, made once per layout (the same list every step)."""
        names = self._bucket_names_cache.get(params)
        if names is None:
            names = self._bucket_names_cache[params] = [
                self.param_names[i] if 0 <= i < len(self.param_names) else f"param[{i}]" for i in params]
        return names
