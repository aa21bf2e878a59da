"""What one DDP training step holds while it runs: its passes (micro-batches), gradient-ready
stamps, bucket all-reduces, optimizer and ZeRO-1 parameter sync. The recorder fills them
(``recorder.py``); the events module turns resolved ones into trace events (``events.py``).
Stamps are the clock's (``clock.py``): µs on CPU, events on CUDA until resolved."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class BucketRecord:
    index: int
    nbytes: int
    params: tuple[int, ...]
    launch: Any
    done: Any = None
    work: Any = None  # NCCL work, kept only for kernel-only timing (the Python path)
    kernel_us: float | None = None  # the backend's own timing of it (the compiled path on NCCL)


@dataclass(slots=True)
class OwnCollective:
    """A collective that is not a bucket's all-reduce: the reducer's all-reduce of its map
    of locally used parameters (``format.UNUSED_MAP``), DDP's broadcast of the module's
    buffers before a syncing forward (``format.BUFFER_BROADCAST``), and the others DDP or
    the script issue in a step (``collective_timer``). ``launch_only``: ``done`` is when
    the call returned, the collective itself still running (an async one on a device clock)."""

    name: str
    nbytes: int
    launch: Any
    done: Any = None
    launch_only: bool = False


@dataclass(slots=True)
class PassRecord:
    """One forward and its backward inside a step: a micro-batch under gradient
    accumulation. ``sync``: DDP reduces gradients in this backward (the forward ran
    outside ``no_sync()``), so the step's bucket all-reduces belong to it."""

    sync: bool
    forward: list[Any]  # [start, end]
    backward_start: Any = None
    backward_end: Any = None
    sync_end: Any = None  # DDP's end-of-backward work (wait for buckets, write grads) done


@dataclass(slots=True)
class ParamSync:
    """ZeroRedundancyOptimizer's ``_sync_params``: every rank broadcasts the parameters it
    updated (its partition) to the others. ``nbytes``: all partitions' bytes (what every
    rank ends up holding anew); ``own_bytes``: this rank's partition (what it sends)."""

    start: Any
    nbytes: int
    own_bytes: int
    broadcasts: int
    end: Any = None


@dataclass(slots=True)
class StepRecord:
    step: int
    start: Any
    warmup: bool = False
    passes: list[PassRecord] = field(default_factory=list)
    active: int | None = None  # the pass whose backward is running
    grads: list[tuple[int, Any, int]] = field(default_factory=list)  # (param, stamp, pass)
    buckets: list[BucketRecord] = field(default_factory=list)
    own: list[OwnCollective] = field(default_factory=list)  # DDP's collectives that are not buckets
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    optimizer: list[Any] | None = None
    param_sync: ParamSync | None = None  # ZeRO-1: the parameters broadcast inside the optimizer step
    end: Any = None
    memory: dict | None = None
    incomplete: bool = False
    first_grad_seen: bool = False
    measure_memory: bool = False  # this step's memory is measured (at close; on CUDA its own peak window)
    grad_marks: bool = True  # a gradient-ready mark per parameter (recorder.GRAD_MARKS_FIRST_STEPS)
    only_grad: int | None = None  # a step without marks: the one parameter whose gradient is stamped
