"""Every collective DeepSpeed's ZeRO runs, timed where all of them pass: the methods of
its communication backend (``deepspeed.comm.torch.TorchBackend``, or the class of the
backend the engine made: CCL's subclasses it). ZeRO never calls ``torch.distributed``'s
collectives directly, and the backend caches ``all_gather_into_tensor`` and
``reduce_scatter_tensor`` when it is made, so patching ``torch.distributed`` would miss
ZeRO-3's gathers and reductions (docs/deepspeed-design.md, §5).

Each call is told apart by who issued it, read from the call stack (a few frames, only
for a collective inside a traced step):

- a gradient bucket's reduction: stages 1-2 ``reduce_ipg_grads``, stage 3
  ``__reduce_and_partition_ipg_grads`` (their per-instance wrappers in ``tracer.py``
  mark the bucket; its number in the step and its parameters' names are found when the
  step is written);
- a ZeRO-3 parameter fetch, ``__all_gather_params_``: the unit of its first parameter,
  a prefetch when the module being fetched does not own it;
- the parameters gathered after the step: stages 1-2's updated partitions
  (``all_gather_into_tensor_dp_groups``), stage 3's persistent parameters (``_post_step``);
- anything else (the gradient norm's all-reduce, an overflow check): ``other``, with
  ``by``, who issued it (the first caller outside ``deepspeed.comm``).

A synchronous call pauses compute on the recorder's lane for its length; an async one
(ZeRO-3's gathers) runs beside it until the training thread first sees its Work complete:
polled (``is_completed``, no wait) at every collective, at every wait for a gather (before
and after it) and at the optimizer step, so its end is at most its wait's end. A future
callback would stamp the true end, but a Python callback on gloo's thread takes the GIL
from training: measured here, ~2 % of a ZeRO-3 step (benchmarks/deepspeed.py). Bytes are
the message: an all-reduce's tensor, an all-gather's output, a reduce-scatter's input.
"""

from __future__ import annotations

import functools
import inspect
import sys
from _thread import get_ident
from time import perf_counter_ns
from typing import Any, Callable

from ddpscope.tracer.capture.clock import CpuClock
from ddpscope.tracer.capture.collective_timer import caller_name
from ddpscope.tracer.capture.sharded.recorder import BACKWARD, FORWARD, Coll, ShardedStep

# method -> (the recorder's kind, the argument whose bytes are the message)
OPS: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "reduce": ("all_reduce", "tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "all_gather_coalesced": ("all_gather", "output_tensors"),
    "reduce_scatter_tensor": ("reduce_scatter", "input_tensor"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
}
GRAD_BUCKET, PARAM_FETCH, PARAM_ALLGATHER, OTHER = "grad_bucket", "param_fetch", "param_allgather", "other"
_FETCH = "__all_gather_params_"
# the parameters gathered after the step: stages 1-2's updated partitions; stage 3's persistent
# parameters (those under stage3_param_persistence_threshold, kept whole, refreshed in _post_step)
_AFTER_STEP = ("all_gather_into_tensor_dp_groups", "all_gather_dp_groups", "_post_step")
_DEPTH = 24  # frames walked up from a collective: ZeRO's issuers sit 3-10 frames above the backend
BACKEND = "deepspeed.comm"  # DeepSpeed's communication layer: every collective it passes on is the tap's

_INSIDE_BACKEND = BACKEND + "."

_TAP: CommTap | None = None  # the active tap (one traced engine per process)


def _ds_id(param) -> int:
    return getattr(param, "ds_id", 0)


def nbytes(value: Any) -> int:
    """Bytes of a tensor or of a list of tensors."""
    if isinstance(value, (list, tuple)):
        return sum(nbytes(v) for v in value)
    try:
        return int(value.numel()) * int(value.element_size())
    except AttributeError:
        return 0


def bucket_args(index: int, params: int, first: str, last: str, micro: int = 0,
                numels: list[int] | None = None, reduce_us: float | None = None) -> dict:
    """A gradient bucket's event args, made when its step is emitted: ``index``, its number
    in micro-batch ``micro``'s reductions (with gradient accumulation DeepSpeed reduces the
    same buckets again in each micro-batch it reduces in); ``numels``: each parameter's
    elements in the order DeepSpeed added them to the bucket (their gradients' ready order),
    what a prediction at another ``reduce_bucket_size`` cuts its buckets from;
    ``reduce_us``: the bucket's whole reduction on the training thread (µs): DeepSpeed's
    own work (copies, averaging, partition bookkeeping) around its collectives, what one
    bucket more or less costs a step."""
    args = {"zero": GRAD_BUCKET, "bucket": index, "micro": micro, "params": params, "first_param": first,
            "last_param": last}
    if numels is not None:
        args["numels"] = numels
    if reduce_us is not None:
        args["reduce_us"] = round(reduce_us, 3)
    return args


_BUCKET = object()  # the head of a bucket mark
_MARK = "_ddpscope_bucket"  # a record's bucket mark in its args until the step is emitted


def bucket_mark(entries) -> tuple:
    """A gradient bucket about to be reduced (``CommTap.bucket``): its entries as DeepSpeed
    lists them, copied (DeepSpeed empties its list once the bucket is reduced), and when
    its reduction began and ended (``perf_counter_ns``; the end set by ``bucket_done``).
    Nothing more is read while the bucket reduces: its unit, names, sizes and number in the
    step are found when the step is emitted."""
    return (_BUCKET, tuple(entries), [perf_counter_ns(), None])


def bucket_done(mark: tuple) -> None:
    """The bucket ``mark`` names has been reduced: its end stamp."""
    mark[2][1] = perf_counter_ns()


def _numel(param: Any) -> int:
    """A parameter's elements as DeepSpeed counts them into a bucket: ZeRO-3's whole
    (``ds_numel``: the parameter itself holds only its partition), else ``numel()``."""
    numel = getattr(param, "ds_numel", None)
    return int(numel if numel is not None else param.numel())


def micro_at(step: ShardedStep, t: float) -> int:
    """The micro-batch (pass) of ``step`` running at ``t`` (µs): the latest begun by then."""
    for k in range(len(step.passes) - 1, 0, -1):
        if step.passes[k].forward[0] <= t:
            return k
    return 0


def phase_at(step: ShardedStep, t: float) -> str:
    """The pass of ``step`` running at ``t`` (µs): the optimizer from its start, else the
    latest pass begun by then, backward from its start. The recorder's ``phase_of`` says
    the same while the step runs; this reads it from the step's stamps afterwards."""
    opt = step.optimizer
    if opt is not None and opt[0] is not None and t >= opt[0]:
        return "optimizer"
    if not step.passes:
        return FORWARD
    p = step.passes[micro_at(step, t)]  # before the first pass began: its backward has not either
    return BACKWARD if p.backward_start is not None and t >= p.backward_start else FORWARD


def _start(coll: Coll) -> Any:
    return coll.start


class CommTap:
    """Feeds the backend's collectives to ``recorder`` while attached.

    ``unit_of``: ``id(param) -> unit``; ``owner_of``: ``id(module) -> unit``;
    ``guard``: the tracer's ``HookGuard``; ``names``: ``id(param) -> name``;
    ``param_of``: a bucket entry as DeepSpeed lists it -> its parameter (stages 1-2 list
    ``(group, index, id)``). ``bucket`` is set by the bucket wrappers for the length of a
    bucket's reduction: its mark (``bucket_mark``).

    A synchronous collective (every one at stages 1-2, the reduce-scatters at 3) takes the
    wrapper's short path: its issuer (a bucket's mark, or ``(unit, event args, prefetch)``
    found from the call stack), two ``perf_counter_ns`` and one tuple into the step's
    ``raw``, made into records when the step is emitted (``expand``: the pass from the
    step's stamps, a bucket's unit, names and number from its mark). Recording it as it
    returns cost ~20 µs a collective here, the short path ~5-10 µs: each runs on the caches
    the collective has just flushed, where every object and function touched is a miss
    (warm: ~2.3 and ~0.5 µs; benchmarks/deepspeed.py's ``hot path``); what waits for the
    emit runs there warm, steps at a time. An async one (ZeRO-3's gathers) is recorded
    as it is launched (``launch``) and stamped done when seen done (``landed``, ``poll``).
    Host clock only: DeepSpeed's collectives are timed as the host launched and saw them."""

    def __init__(self, recorder, unit_of: dict[int, int], owner_of: dict[int, int], guard,
                 names: dict[int, str] | None = None, param_of: Callable[[Any], Any] = lambda p: p) -> None:
        clock = recorder.clock
        if not isinstance(clock, CpuClock):  # the short path's stamps are perf_counter_ns
            raise TypeError(f"DeepSpeed's collectives are timed on the host clock, not {type(clock).__name__}")
        self.recorder = recorder
        self.unit_of = unit_of
        self.owner_of = owner_of
        self.guard = guard
        self.names = names or {}
        self.param_of = param_of
        self.thread = get_ident()  # the training thread: ZeRO's collectives are issued there
        self.bucket: tuple | None = None  # bucket_mark
        self.skew_ns: int = clock.skew_ns  # test-only skew: ns stamps get it as the clock's own do
        recorder.expand = self.expand
        self.in_step = False  # inside the engine's optimizer step (set by the tracer's step wrapper)
        self.pending: list[tuple[Any, Any]] = []  # (Coll, Work) launched async, not yet seen done

    def attach(self, backend_cls: type) -> None:
        global _TAP
        patch_backend(backend_cls)
        _TAP = self

    def detach(self) -> None:
        global _TAP
        if _TAP is self:
            _TAP = None

    # -- one collective ---------------------------------------------------------------
    def poll(self, now: Any = None) -> None:
        """Stamp the async collectives the training thread now sees complete (no wait), with
        ``now`` where given (a stamp taken just before: the end of a wait they ended by)."""
        if not self.pending:
            return
        left = []
        for coll, work in self.pending:
            try:
                done = work.is_completed()
            except Exception:  # noqa: BLE001 - a Work that cannot say: done when asked
                done = True
            if done:
                now = now if now is not None else self.recorder.clock.stamp()
                coll.end = now
            else:
                left.append((coll, work))
        self.pending = left

    def step_ends(self) -> None:
        """The step's optimizer starts, or the step ends: what is done is stamped; what is
        not stays open (ZeRO-3's gathers of persistent parameters in ``_post_step`` are
        waited on torch's own Works, which no wrapper sees: done by the step's end)."""
        self.poll()
        self.pending = []

    def issued(self, kind: str, method: str, frame) -> tuple[int, dict, bool]:
        """The issuer of a synchronous collective outside a bucket, called by ``frame``:
        ``(unit, event args, prefetch)``."""
        unit, prefetch, extra = self._issuer(kind, method, frame)
        return unit, extra, prefetch

    def expand(self, step: ShardedStep) -> None:
        """The step's ``raw`` collectives (``(start_ns, end_ns, kind, method, bytes, issuer)``,
        the short path's) as records and holes in compute, all collectives in start order,
        each bucket's numbered in its micro-batch and named."""
        if step.raw:
            skew, timed = self.skew_ns, self.recorder.comm_timed
            for start, end, kind, method, size, issuer in step.raw:
                ts, te = (start + skew) / 1000.0, (end + skew) / 1000.0
                if issuer[0] is _BUCKET:
                    unit, extra, prefetch = -1, {"op": method, _MARK: issuer}, False
                else:
                    unit, extra, prefetch = issuer[0], {**issuer[1], "op": method}, issuer[2]
                timed(step, kind, unit, size, prefetch, phase_at(step, ts), extra, ts, te)
            step.raw = []
            step.colls.sort(key=_start)
        found: dict[int, tuple[int, dict]] = {}  # id(mark) -> (unit, args): a bucket's collectives share it
        per_micro: dict[int, int] = {}  # micro-batch -> buckets numbered in it so far
        for c in step.colls:
            mark = c.extra.pop(_MARK, None) if c.extra else None
            if mark is not None:
                if id(mark) not in found:
                    micro = micro_at(step, c.start)
                    per_micro[micro] = per_micro.get(micro, -1) + 1
                    found[id(mark)] = self._bucket(mark, per_micro[micro], micro)
                c.unit, args = found[id(mark)]
                c.extra = {**args, **c.extra}

    def _unit_of(self, mark: tuple) -> int:
        """The unit of the bucket ``mark``: its first parameter's (-1: none known)."""
        return self.unit_of.get(id(self.param_of(mark[1][0])), -1)

    def _bucket(self, mark: tuple, index: int, micro: int = 0) -> tuple[int, dict]:
        """(unit, event args) of the bucket ``mark``, the ``index``-th reduced in micro-batch
        ``micro`` of its step."""
        params = [self.param_of(e) for e in mark[1]]
        first, last = params[0], params[-1]
        names = self.names
        start, end = mark[2]
        return (self._unit_of(mark),
                bucket_args(index, len(params), names.get(id(first), "?"), names.get(id(last), "?"), micro,
                            [_numel(p) for p in params], None if end is None else (end - start) / 1000.0))

    def where(self) -> tuple[int, str, str | None]:
        """The recorder's ``where`` with the short path's issuer in it resolved (its unit,
        the pass now): for the live file's thread, off the training thread."""
        unit, phase, coll = self.recorder.where
        if isinstance(unit, tuple):
            unit = self._unit_of(unit) if unit[0] is _BUCKET else unit[0]  # per live tick: no names built
            cur = self.recorder.current
            phase = "optimizer" if self.in_step else phase_at(cur, self.recorder.clock.stamp()) if cur else ""
        return unit, phase, coll

    def launch(self, kind: str, method: str, tensor: Any, frame) -> Coll | None:
        """An async collective launched now (ZeRO-3's gathers): its record, open until seen done."""
        bucket = self.bucket
        if bucket is not None:  # unit and args when its step is emitted (expand)
            unit, prefetch, extra, phase = -1, False, {"op": method, _MARK: bucket}, None
        else:
            unit, prefetch, extra = self._issuer(kind, method, frame)
            extra["op"] = method
            phase = "optimizer" if self.in_step else None
        return self.recorder.comm_async(kind, unit, nbytes(tensor), prefetch, phase, extra)

    def landed(self, coll: Coll, result: Any) -> None:
        """The async collective's call returned ``result`` (its Work: watched until done)."""
        if result is None or not hasattr(result, "is_completed"):  # nothing to watch: done as launched
            coll.end = self.recorder.clock.stamp()
        else:
            self.pending.append((coll, result))

    def _issuer(self, kind: str, method: str, frame) -> tuple[int, bool, dict]:
        """(unit, prefetch, event args) of the collective of ``kind`` whose caller is ``frame``:
        ZeRO's fetches and after-step gathers are all-gathers, anything else is ``other``,
        named for who issued it (``by``)."""
        if kind != "all_gather":
            return -1, False, {"zero": OTHER, "by": issuer_name(method, frame)}
        f = frame
        for _ in range(_DEPTH):
            if f is None:
                break
            name = f.f_code.co_name
            if name == _FETCH:
                return self._fetch(f)
            if name in _AFTER_STEP:
                return -1, False, {"zero": PARAM_ALLGATHER}
            f = f.f_back
        return -1, False, {"zero": OTHER, "by": issuer_name(method, frame)}

    def _fetch(self, frame) -> tuple[int, bool, dict]:
        """A ZeRO-3 fetch: the unit of its first parameter (by DeepSpeed's id); a prefetch
        when the module being fetched (``_fetch_sub_module_impl``'s) does not own it."""
        params = frame.f_locals.get("params") or ()
        unit = self.unit_of.get(id(min(params, key=_ds_id)), -1) if params else -1
        current, f = None, frame.f_back
        for _ in range(6):
            if f is None:
                break
            if "current_submodule" in f.f_code.co_varnames:
                current = f.f_locals.get("current_submodule")
                break
            f = f.f_back
        prefetch = current is not None and self.owner_of.get(id(current), -2) != unit
        return unit, prefetch, {"zero": PARAM_FETCH, "params": len(params)}


def issuer_name(method: str, frame) -> str:
    """Who issued a collective that is not ZeRO's own (the gradient norm's all-reduce, an
    overflow check, the script's ``deepspeed.comm`` call), from ``frame``, the backend's
    caller: the first frame outside ``deepspeed.comm``, named as ``collective_timer`` names
    one (``all_reduce (deepspeed.runtime.zero.stage_1_and_2.get_grad_norm_direct)``,
    ``all_reduce (the script, train.py:42)``). A few frames, for these few collectives only."""
    f = frame
    for _ in range(_DEPTH):
        name = "" if f is None else f.f_globals.get("__name__", "")
        if name != BACKEND and not name.startswith(_INSIDE_BACKEND):  # neither the package nor inside it
            break
        f = f.f_back
    return caller_name(method, f)


def patch_backend(cls: type) -> None:
    """Wrap ``cls``'s collective methods once per process (signature and return values
    unchanged); a wrapper with no tap attached hands straight on."""
    for method in OPS:
        original = cls.__dict__.get(method)
        if original is None or getattr(original, "_ddpscope", False):
            continue
        setattr(cls, method, _wrapped(original, method))


def _signature(fn, method: str) -> inspect.Signature:
    """The collective's own signature: DeepSpeed's decorators (``stage_on_cpu``) wrap it
    in ``wrapper(self, *args, **kwargs)`` without ``functools.wraps``; the function they
    wrap is in the wrapper's closure."""
    seen = 0
    while seen < 4:
        inner = next((c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                      if callable(getattr(c, "cell_contents", None))
                      and getattr(c.cell_contents, "__name__", None) == method), None)
        if inner is None:
            break
        fn, seen = inner, seen + 1
    return inspect.signature(inspect.unwrap(fn))


def _wrapped(original, method: str):
    signature = _signature(original, method)
    names = list(signature.parameters)
    kind, message = OPS[method]
    # bound by hand, by position: bind() cost ~40x, and a dict of every argument ~2x, per collective
    at = names.index(message) if message in names else None
    asy = names.index("async_op") if "async_op" in names else None
    asy_default = signature.parameters["async_op"].default if asy is not None else False

    @functools.wraps(original)
    def collective(*args, **kwargs):
        tap = _TAP
        if tap is None or tap.recorder.current is None or tap.guard.broken is not None:  # nothing to trace
            return original(*args, **kwargs)
        size, coll = -1, None  # size >= 0: a synchronous collective, on the short path (CommTap's docstring)
        try:
            if get_ident() == tap.thread:
                tensor = None if at is None else args[at] if len(args) > at else kwargs.get(message)
                is_async = bool(False if asy is None else args[asy] if len(args) > asy
                                else kwargs.get("async_op", asy_default))
                if tap.pending:
                    tap.poll()  # the gathers done by now: stamped no later than this collective
                if is_async:
                    coll = tap.launch(kind, method, tensor, sys._getframe(1))
                else:
                    issuer = tap.bucket or tap.issued(kind, method, sys._getframe(1))
                    rec = tap.recorder
                    step = rec.current
                    try:
                        size = tensor.nbytes  # numel x element size
                    except AttributeError:  # a list of tensors, or none
                        size = nbytes(tensor)
        except Exception as e:  # noqa: BLE001 - a tracer error stops tracing, never the collective
            tap.guard.fail(e)
            coll, size = None, -1
        if size >= 0:  # as little touched as can be: each thing is a cache miss after the collective
            where, rec.where = rec.where, (issuer, None, kind)  # the live file: in it now (CommTap.where)
            start = perf_counter_ns()
            try:
                return original(*args, **kwargs)  # its errors are the script's; its span ends with them
            finally:
                step.raw.append((start, perf_counter_ns(), kind, method, size, issuer))
                rec.where = where
        if coll is None:
            return original(*args, **kwargs)
        result = None
        try:
            result = original(*args, **kwargs)
        finally:  # an error's span ends with it; the error is the script's
            try:
                tap.landed(coll, result)
            except Exception as e:  # noqa: BLE001
                tap.guard.fail(e)
        return result

    collective._ddpscope = True
    return collective
