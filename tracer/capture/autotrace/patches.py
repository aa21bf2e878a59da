"""The patches that let ddpscope see a model being built, each in place and keeping the
patched API's signature and return value: ``DistributedDataParallel.__init__`` (the
``bucket_cap_mb`` override; the model traced once built), ``destroy_process_group`` (the
trace finished while the group still works), FSDP1's constructor (said untraced) and
FSDP2's ``FSDPState._lazy_init`` (the model traced once its root is initialised)."""

from __future__ import annotations

import functools
import inspect
import sys

from ddpscope.tracer.capture.autotrace.built_by import built_by
from ddpscope.tracer.capture.autotrace.session import Session, now_us

DDP_MODULE = "torch.nn.parallel.distributed"
FSDP1_MODULE = "torch.distributed.fsdp.fully_sharded_data_parallel"  # FullyShardedDataParallel: said untraced
FSDP2_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"  # FSDPState._lazy_init: traced


def _patch_ddp(session: Session, module) -> None:
    session.times_us.setdefault("torch_imported", now_us())
    ddp_cls = module.DistributedDataParallel
    original = ddp_cls.__init__
    if getattr(original, "_ddpscope", False):
        return
    signature = inspect.signature(original)
    cap, caps = session.config.bucket_cap_mb, session.config.bucket_cap_mb_list
    has_list = "bucket_cap_mb_list" in signature.parameters  # PyTorch >= 2.13
    if caps is not None and not has_list:  # an older DDP: one cap for every bucket
        cap, caps = max(caps), None
        session.note(f"this PyTorch's DDP takes no bucket_cap_mb_list: --bucket-cap-mb-list runs as bucket_cap_mb "
                     f"{cap:g} MiB (its largest), one cap for every bucket")

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:  # DDP's own error, as the script would have had it
            return original(self, *args, **kwargs)
        script_cap = bound.arguments.get("bucket_cap_mb")
        session.built_by = built_by()  # the caller of this __init__: the script, or a framework
        script_list = bound.arguments.get("bucket_cap_mb_list")
        try:
            session.script_caps = {"bucket_cap_mb_list_script": [float(c) for c in script_list] if script_list
                                   else None}
        except (TypeError, ValueError):  # not a list of numbers: DDP says so below
            session.script_caps = {}
        use_cap, use_caps = _feasible_override(session, bound.arguments.get("module"), cap, caps)
        if use_cap is not None:
            if isinstance(script_cap, (int, float)) and script_cap != use_cap:  # anything else: DDP's to judge
                session.note(f"the script's bucket_cap_mb {script_cap:g} is replaced by --bucket-cap-mb {use_cap:g}")
            bound.arguments["bucket_cap_mb"] = use_cap
            if bound.arguments.get("bucket_cap_mb_list"):
                bound.arguments["bucket_cap_mb_list"] = None  # it would win over bucket_cap_mb
                session.note(f"the script's bucket_cap_mb_list is replaced by --bucket-cap-mb {use_cap:g}")
        elif use_caps is not None:  # it wins over the script's bucket_cap_mb (the largest becomes the cap)
            bound.arguments["bucket_cap_mb_list"] = list(use_caps)
        original(*bound.args, **bound.kwargs)  # DDP's errors reach the script as they are
        try:
            session.on_ddp_built(self, script_cap, use_cap is not None or use_caps is not None)
        except Exception as e:  # noqa: BLE001 - training goes on, untraced
            session.note(f"tracing could not start ({type(e).__name__}: {e}); the script runs untraced")
        return None

    __init__._ddpscope = True
    ddp_cls.__init__ = __init__
    _patch_destroy(session)


def _feasible_override(session: Session, module, cap, caps):
    """``(cap, caps)`` to apply, or none where DDP would refuse them and fail the job: a
    ``bucket_cap_mb_list`` under compiled autograd's Python reducer (DDP's assertion at
    its construction), a cap (a list's largest entry) under the 1 MiB that torch.compile's
    DDPOptimizer requires of a model compiled inside DDP (at the first forward). Said once;
    the script's caps stay. (``torch.compile(DDP(model))`` compiles after this: it fails as
    it would without ddpscope, and the launcher's last line says why.)"""
    if cap is None and caps is None or module is None:
        return cap, caps
    from ddpscope.tracer.capture.ddp.run_facts import DDP_OPTIMIZER_MIN_CAP_BYTES, compiled_inside, ddp_optimizer_mode

    asked = f"--bucket-cap-mb {cap:g}" if cap is not None else f"--bucket-cap-mb-list {','.join(f'{c:g}' for c in caps)}"
    mode = ddp_optimizer_mode()
    if caps is not None and mode == "python_reducer":
        why = "DDP under compiled autograd's Python reducer (optimize_ddp='python_reducer') takes no bucket_cap_mb_list"
    elif mode == "ddp_optimizer" and int((cap if cap is not None else max(caps)) * 2**20) < DDP_OPTIMIZER_MIN_CAP_BYTES \
            and compiled_inside(module):
        why = "the model is torch.compile'd, and torch.compile's DDPOptimizer refuses a bucket cap under 1 MiB " \
              "(its first bucket)"
    else:
        return cap, caps
    session.note(f"{asked} is not applied: {why}; the script's own bucket caps stay")
    return None, None


def _patch_destroy(session: Session) -> None:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group
    if getattr(original, "_ddpscope", False):
        return

    signature = inspect.signature(original)

    @functools.wraps(original)
    def destroy_process_group(*args, **kwargs):
        try:
            group = signature.bind(*args, **kwargs).arguments.get("group")
        except TypeError:  # torch's own error, as the script would have had it
            return original(*args, **kwargs)
        if group is None or group is c10d.GroupMember.WORLD:
            session.world_destroyed = True
            exc = sys.exc_info()[1]  # inside a finally while an exception unwinds: a failed run
            session.finish(None if exc is None or isinstance(exc, SystemExit) and not exc.code
                           else f"{type(exc).__name__}: {exc}")
        return original(*args, **kwargs)

    destroy_process_group._ddpscope = True
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group


def _patch_fsdp1(session: Session, module) -> None:
    cls = getattr(module, "FullyShardedDataParallel", None)
    if cls is None or getattr(cls.__init__, "_ddpscope", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        original(self, *args, **kwargs)
        try:
            session.on_fsdp1()
        except Exception:  # noqa: BLE001 - a note is not worth a training run
            pass

    __init__._ddpscope = True
    cls.__init__ = __init__


def _patch_fsdp2(session: Session, module) -> None:
    """``FSDPState._lazy_init``: once FSDP made a state the root (its first forward, or
    an explicit ``unshard``), every unit is known; the tracer starts there."""
    cls = getattr(module, "FSDPState", None)
    original = getattr(cls, "_lazy_init", None)
    if original is None or getattr(original, "_ddpscope", False):
        return
    session.times_us.setdefault("torch_imported", now_us())

    @functools.wraps(original)
    def _lazy_init(self, *args, **kwargs):
        first = getattr(self, "_is_root", None) is None
        result = original(self, *args, **kwargs)  # FSDP's errors reach the script as they are
        if first and getattr(self, "_is_root", False):
            session.built_by = built_by()  # the framework running this first forward (torchtitan's trainer)
            try:
                session.on_fsdp_root(self)
            except Exception as e:  # noqa: BLE001 - training goes on, untraced
                session.note(f"tracing could not start ({type(e).__name__}: {e}); the script runs untraced")
        return result

    _lazy_init._ddpscope = True
    cls._lazy_init = _lazy_init
    _patch_destroy(session)
