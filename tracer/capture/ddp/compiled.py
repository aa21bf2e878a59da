"""Compiled bucket timing: DDP's reducer talks to a C++ process group that forwards to
the real one and stamps every all-reduce (``native/timed_group.cpp``), so no Python
communication hook runs and DDP keeps its fused divide-while-copying path.

``CompiledBuckets.attach(ddp, recorder)`` installs the wrapper with the reducer's
``_update_process_group`` (the DDP module's own ``process_group``, used for its buffer
broadcasts, is left alone); ``take(step, pass)`` hands the all-reduces since the last call
to the step as ``BucketRecord``s (bucket k = the k-th all-reduce: the reducer launches
buckets in index order; the recorder calls it when the next backward starts or the step
closes, by when every completion callback has run; an all-reduce that is not of floating-point
data is DDP's own map of used parameters, recorded as what it is and never as a bucket:
``OwnCollective``) and ``take_ready`` the gradient-ready
times (C++ post hooks put in front of DDP's on each parameter's AccumulateGrad node);
``detach()`` gives the reducer its group back and takes the hooks off.

On CUDA (NCCL, or gloo with CUDA tensors) the host clock is wrong for a collective (an
NCCL future completes when the kernel is enqueued): the wrapper also records CUDA events
whose times are read when their step is resolved (``settle``; ``DeviceLag`` holds the
records until then), its end done on the device, so nothing synchronises inside a step
and the host may run steps ahead (only a take that finds all of the wrapper's banks
waiting reads the oldest at once, waiting for its events); they are measured from the CUDA
clock's own anchors (``cuda_clock.py``: the wrapper records an event beside each of the
clock's anchor tries, and the winner's host time is committed to both), so bucket and
compute lanes share one mapping onto the host clock. The C++ ready hooks then record an
event per gradient too, from a ring, on those anchors: ``take_ready`` hands the step its
gradients with their times still None, and ``settle`` fills them in once the step is
resolved (its end event done: reading them waits for nothing). The clock's own stamps
(forward, backward, optimizer) come from a C++ ring on the same anchors too (``DeviceStamps``).
CI runs it on a stand-in device (tests/tracer/capture/test_device_path.py);
tests/tracer/capture/test_cuda.py runs it where a GPU is.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpscope.tracer import format as fmt
from ddpscope.tracer.capture.ddp.records import BucketRecord, OwnCollective
from ddpscope.tracer.capture.ddp.run_facts import bucket_caps
from ddpscope.tracer.capture.native import build as native


def load_extension() -> tuple[Any, str | None]:
    """``(module, None)``, or ``(None, why not)`` in one line (never raises)."""
    try:
        module = native.load_built()
    except Exception as e:  # noqa: BLE001 - a stale or broken build: the Python path
        return None, f"the compiled capture could not be loaded ({type(e).__name__}: {str(e)[:200]})"
    if module is None:
        return None, "the compiled capture is not built (`ddpscope build` builds it once per torch version)"
    return module, None


class DeviceLag:
    """Takes whose device times are not read yet, oldest first, as the wrapper holds them:
    each take's records (``BucketRecord``s and ``OwnCollective``s, in launch order; their
    ``launch``/``done`` stay None until then) and the step they belong to."""

    def __init__(self) -> None:
        self.waiting: deque[tuple[Any, list]] = deque()

    def hand_over(self, step, records: list) -> None:
        self.waiting.append((step, records))

    def fill_oldest(self, device: list[tuple[int, int, int]]) -> None:
        """``device``: (launch_ns, done_ns, kernel_ns) per all-reduce of the oldest take, 0 if
        unknown (kernel_ns: the backend's own timing of it, NCCL's with its timing on)."""
        if not device or not self.waiting:
            return
        _, records = self.waiting.popleft()
        for b, (launch, done, kernel) in zip(records, device):
            b.launch = launch / 1e3 if launch else None
            b.done = done / 1e3 if done else None
            if kernel and isinstance(b, BucketRecord):
                b.kernel_us = kernel / 1e3

    def through(self, steps) -> int:
        """How many of the oldest takes to read so that every take of ``steps`` is read (the
        takes before theirs are of older steps, read first: the wrapper reads in order)."""
        last = 0
        for n, (step, _) in enumerate(self.waiting, start=1):
            if any(step is s for s in steps):
                last = n
        return last


class CompiledBuckets:
    """One DDP model's all-reduces, timed in C++ (see the module's docstring)."""

    def __init__(self, ext, ddp: DDP, recorder, device: torch.device, skew_ns: int = 0,
                 kernel_timing: bool = False) -> None:
        self.ext = ext
        self.ddp = ddp
        self.recorder = recorder
        self.skew_ns = skew_ns  # the clock's test-only skew (CpuClock.skew_ns): one time axis
        self.original = ddp.process_group  # passed in, never read from the reducer
        self.device = None if device.type == "cpu" else device  # an accelerator: its events time the buckets
        self.lag = DeviceLag()
        self.group = ext.wrap(self.original, 4096, self.device)
        if self.device is not None and kernel_timing:
            ext.kernel_timing(self.group, True)
        self.ready = None  # gradient-ready stamps (C++ hooks on the parameters' AccumulateGrad nodes)
        # device ready times not read yet: (step, first index in step.grads, slots)
        self._ready_slots: list[tuple[Any, int, list[int]]] = []
        self._params: dict[tuple[int, ...], list[tuple[int, ...]]] = {}  # bucket sizes -> params per bucket
        self.attached = False

    def attach(self) -> "CompiledBuckets":
        self._last_sync: tuple[list, int] = ([], 0)  # (step.grads, pass): the last syncing backward's
        if self.device is None:
            self._bucket_params(None)  # the first layout, before training (it allocates: not inside a step)
        elif (first := assigned_layout(self.ddp, self.recorder.params)) is not None:
            self._params[first[1]] = first[0]  # on a device, read without copying every bucket
        self.ready = self.ext.ReadyTimes(self.recorder.params, group=self.group if self.device is not None else None)
        clock = self.recorder.clock
        if self.device is not None and hasattr(clock, "share_anchors"):
            clock.share_anchors(self)  # one anchor for the bucket and compute lanes
            # the clock's own stamps from a C++ ring of events on those anchors, not a
            # torch.cuda.Event each (cuda_clock.py: "Stamps in C++")
            clock.use_stamps(self.ext.DeviceStamps(self.group))
        self.ddp.reducer._update_process_group(self.group)
        self.attached = True
        return self

    # -- the CUDA clock's anchor sink (cuda_clock.AnchorSink) ------------------------------
    def candidate(self, index: int, stream) -> None:
        if self.group is not None:
            self.ext.anchor_candidate(self.group, index, stream.stream_id, stream.device_index, stream.device_type)

    def commit(self, index: int, host_ns: int, rate: float) -> None:
        if self.group is not None:
            self.ext.anchor_commit(self.group, index, host_ns, rate)

    @property
    def ready_in_cpp(self) -> bool:
        """The C++ hooks take the gradient-ready times (the host clock on CPU, events on the
        group's anchors on a device), not the Python hooks."""
        return self.ready is not None

    def detach(self) -> None:
        """The reducer's own group back and the ready hooks off (DDP untraced from here
        on); idempotent. Between steps only (no backward running)."""
        if self.attached:
            self.attached = False
            self.take_pending()
            for _ in range(len(self.lag.waiting)):  # their device times, before the group goes (waited for if need be)
                self.lag.fill_oldest(self.ext.settle(self.group))
            self.ddp.reducer._update_process_group(self.original)
            # Hold the real group no longer than the reducer does: a group that outlives
            # destroy_process_group is torn down while Python finalizes (see the tracer's
            # _release_cpu_group). The wrapper's records outlive it for a late callback.
            self.group = self.original = None
        if self.ready is not None:
            self.ready.remove()
            self.ready = None
        self._ready_slots = []
        if hasattr(self.recorder.clock, "use_stamps"):
            self.recorder.clock.use_stamps(None)  # events again; the ring's stamps still resolve

    def progress(self) -> tuple[int, int]:
        """``(launched, done)`` all-reduces of the open step (read by the live file's thread)."""
        group = self.group  # read once: detach() may drop it meanwhile
        return tuple(self.ext.progress(group)) if group is not None and self.attached else (0, 0)

    def take_ready(self, step, k: int) -> None:
        """The gradients accumulated since the last call, into ``step.grads`` as pass ``k``'s
        (at the end of each backward, accumulation's included)."""
        if self.ready is None or step is None:
            return
        if not self.ready.on_device:
            step.grads.extend(self.ready.take(k, self.skew_ns))
            return
        taken = self.ready.take_device(k)  # (param, slot, pass): times once the step is resolved
        if taken:
            self._ready_slots.append((step, len(step.grads), [slot for _, slot, _ in taken]))
            step.grads.extend((param, None, kk) for param, _, kk in taken)

    def stamp_only(self, param: int | None) -> None:
        """From the next gradient on, the C++ hooks stamp only ``param``'s (None: every
        parameter's): a step without gradient marks (``recorder._marks``). Between steps."""
        if self.ready is not None:
            self.ready.set_only(-1 if param is None else param)

    def take_pending(self) -> list[tuple[int, int, int]]:
        """The host records since the last take; the device times of the take before go
        to the buckets waiting for them."""
        if self.group is None:
            return []
        records, oldest = self.ext.take(self.group, 10_000)
        self.lag.fill_oldest(oldest)  # every bank waited: the oldest take was read now
        return records

    def settle(self, steps, known_done: bool = False) -> None:
        """Before ``steps`` are resolved: the device times of their all-reduces (and of any
        older take not read yet) and of their gradients. The recorder resolves a step once its
        end event is done, so nothing is waited for (``known_done``: it saw that, so no
        event is queried first); else (a step resolved anyway, the end of tracing) each
        event not completed is waited for, that event only."""
        if self.group is not None:
            for _ in range(self.lag.through(steps)):
                self.lag.fill_oldest(self.ext.settle(self.group, known_done))
        if self._ready_slots and self.ready is not None:
            keep = []
            for step, first, slots in self._ready_slots:
                if not any(step is s for s in steps):
                    keep.append((step, first, slots))
                    continue
                grads, end = step.grads, first + len(slots)
                grads[first:end] = [(param, ns / 1e3 if ns else None, k) for (param, _, k), ns in
                                    zip(grads[first:end], self.ready.resolve(slots, self.skew_ns, known_done))]
            self._ready_slots = keep

    def take(self, step, pass_index: int) -> None:
        """The all-reduces since the last call, that pass's, into ``step.buckets`` and, for
        DDP's own (not of floating-point data), ``step.own`` (between backwards: no
        all-reduce of this model is in flight)."""
        records = self.take_pending()
        if not records or step is None:
            return
        sizes = tuple(b for _, _, b, floating in records if floating)
        params = (self._params.get(sizes) or self._from_ready_order(sizes) or self._read_layout(sizes)) if sizes \
            else []
        self._last_sync = (step.grads, pass_index)  # read only if the layout changes next
        skew, host = self.skew_ns, self.device is None  # on a device, the times come a take later
        taken, k = [], 0  # every record in launch order (the device times come in that order); k: this take's bucket
        for launch, done, nbytes, floating in records:
            at = ((launch + skew) / 1e3, (done + skew) / 1e3 if done else None) if host else (None, None)
            if floating:
                rec = BucketRecord(k, nbytes, params[k], *at)
                step.buckets.append(rec)
                k += 1
            else:
                rec = OwnCollective(fmt.UNUSED_MAP, nbytes, *at)
                step.own.append(rec)
            taken.append(rec)
        if not host:
            self.lag.hand_over(step, taken)

    def _read_layout(self, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The layout of a step whose all-reduces are ``sizes`` that neither a layout seen
        before nor the ready order gives: DDP's logging data (after its rebuild); else, on
        CPU, the reducer's buckets (a copy of each); on a device never that copy (the
        size of every gradient, inside a step): the parameters stay unknown."""
        logged = rebuilt_layout(self.ddp, sizes)
        if logged is not None:
            self._params[sizes] = logged
            return logged
        if self.device is None:
            return self._bucket_params(sizes)
        self._params[sizes] = unknown = [() for _ in sizes]
        return unknown

    def _bucket_params(self, sizes: tuple[int, ...] | None) -> list[tuple[int, ...]]:
        """Each bucket's parameter indices (the recorder's), from the reducer's current
        buckets (``sizes``: the all-reduces' bytes; None: before training, whatever they
        are). It allocates a copy of every bucket (~10 ms for a few MiB): done before
        training, and inside a step only when the rebuilt layout cannot be read from the
        ready order."""
        index = self.recorder.param_index
        buckets = sorted(self.ddp.reducer._get_zeros_like_grad_buckets(), key=lambda b: b.index())
        found = [tuple(index.get(id(p), -1) for p in b.parameters()) for b in buckets]
        have = tuple(b.buffer().numel() * b.buffer().element_size() for b in buckets)
        self._params[have] = found
        if sizes is not None and have != sizes:
            # all-reduces of other sizes than the buckets (a built-in FP16_COMPRESS hook's
            # fp16 copies): bucket k is still the k-th all-reduce; kept, not asked each step
            mapped = self._params[sizes] = [found[k] if k < len(found) else () for k in range(len(sizes))]
            return mapped
        return found

    def _from_ready_order(self, sizes: tuple[int, ...]) -> list[tuple[int, ...]] | None:
        """The layout DDP rebuilt after its first iteration: its buckets are consecutive
        runs of that iteration's gradient-ready order, filled up to the cap. Read as runs
        whose bytes equal each all-reduce's; None if they do not (several dtypes or
        devices, unused parameters): then the reducer is asked."""
        grads, k = self._last_sync  # in stamp order: one autograd thread stamps them in turn
        order, out, at = [param for param, _, kk in grads if kk == k], [], 0
        for size in sizes:
            run, total = [], 0
            while at < len(order) and total < size:
                run.append(order[at])
                total += self.recorder.param_nbytes[order[at]]
                at += 1
            if total != size:
                return None
            out.append(tuple(run))
        if at != len(order):
            return None
        self._params[sizes] = out
        return out


def _ints(text) -> list[int] | None:
    try:
        return [int(x) for x in str(text).split(",")] if text else None
    except ValueError:
        return None


def rebuilt_layout(ddp: DDP, sizes: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """Each bucket's parameter indices (the reducer's order, as ``reducer_params``) after
    DDP rebuilt its buckets, from its logging data (``rebuilt_per_bucket_param_indices``),
    if its buckets' bytes are ``sizes``; read, never allocated. None otherwise."""
    try:
        data = ddp._get_ddp_logging_data()
    except (AttributeError, RuntimeError):
        return None
    if _ints(data.get("rebuilt_bucket_sizes")) != list(sizes) or not data.get("rebuilt_per_bucket_param_indices"):
        return None
    try:
        return [tuple(int(i) for i in b.split()) for b in data["rebuilt_per_bucket_param_indices"].split(",")]
    except ValueError:
        return None


def assigned_layout(ddp: DDP, params: list[torch.nn.Parameter]) -> tuple[list[tuple[int, ...]], tuple[int, ...]] | None:
    """DDP's first bucket layout and its buckets' bytes, assigned as DDP assigned it
    (``_compute_bucket_assignment_by_size`` over its size limits, buckets reversed), if
    that agrees with the bytes its logging data gives (``bucket_sizes``); nothing is
    allocated. None where it does not agree (sparse gradients, another torch's rules)."""
    import torch.distributed as dist

    try:
        logged = _ints(ddp._get_ddp_logging_data().get("bucket_sizes"))
    except (AttributeError, RuntimeError):
        return None
    # the limits DDP used: torch 2.13's bucket config says; an older torch used one of the
    # others (no bucketing in the first iteration, or a 1 MiB first bucket then the cap)
    candidates = []
    config = getattr(ddp, "_bucket_config", None)
    try:
        if config is not None:
            candidates.append(list(config.compute_bucket_size_limits(
                static_graph=ddp.static_graph, find_unused_parameters=ddp.find_unused_parameters)[0]))
    except (AttributeError, RuntimeError, TypeError, ValueError):
        pass
    caps = bucket_caps(ddp)
    candidates += [[sys.maxsize], [caps["first_bucket_cap_bytes"], caps["bucket_cap_bytes"]]]
    for limits in candidates:
        try:
            indices, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
        except (AttributeError, RuntimeError, TypeError, ValueError):
            continue
        layout = [tuple(b) for b in reversed(indices)]
        sizes = tuple(sum(params[i].numel() * params[i].element_size() for i in b) for b in layout)
        if logged == list(sizes):
            return layout, sizes
    return None


def usable(device: torch.device) -> str | None:
    """Why the compiled capture cannot time this model, or None."""
    if device.type not in ("cpu", "cuda"):
        return f"the compiled capture times CPU and CUDA models, not {device.type}"
    return None
