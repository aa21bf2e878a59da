"""``TracerConfig``: where and how a ``DDPTracer`` writes. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ddpscope.tracer.options import CAPTURES, GRAD_MARKS_EVERY


@dataclass(kw_only=True)
class TracerConfig:
    """Where and how a tracer writes.

    out_dir: run folder; each rank writes ``rank-<r>.json``, rank 0 also ``run.json``.
    step_boundary: ``"auto"`` (forward ... ``optimizer.step()``) or ``"explicit"``
        (``tracer.step()`` ends a step).
    offset_rounds: ping-pong rounds per rank for the clock-offset estimate.
    sync_timeout_s: how long the tracer's own collectives (start, end) wait for a peer.
    flush_interval_s: the writer appends to the file at most this often (seconds).
    memory_interval_s: a step's memory is measured (tensor accounting, RSS or the CUDA
        allocator's peak) on the first 3 steps, then on one step in each this many
        seconds (0: every step).
    run_meta: extra JSON-able facts about the run (model name, batch size, ...).
    capture: how all-reduces and gradient-ready times are taken: ``"compiled"`` (C++
        beside DDP's reducer, ``compiled.py``; the Python hooks where it cannot be had:
        not built, said once; a device other than CPU or CUDA; a script's own Python comm
        hook; recorded in the metadata either way) or ``"python"``.
    capture_note: why the launcher chose ``"python"`` (recorded in the metadata).
    grad_marks_every: a gradient-ready mark per parameter on the first
        ``recorder.GRAD_MARKS_FIRST_STEPS`` steps, then on every Nth step (1: every
        step). The other steps keep every span and their backward's compute end (the
        gradient ready last in the latest marked step is still stamped): a launch-bound
        GPU model pays a device event per parameter per step for the marks.
    """

    out_dir: Path | str
    step_boundary: str = "auto"
    offset_rounds: int = 16
    sync_timeout_s: float = 60.0
    flush_interval_s: float = 0.25
    memory_interval_s: float = 1.0
    run_meta: dict = field(default_factory=dict)
    capture: str = "compiled"
    capture_note: str | None = None
    grad_marks_every: int = GRAD_MARKS_EVERY.default

    def __post_init__(self) -> None:
        self.out_dir = Path(self.out_dir)
        if self.capture not in CAPTURES:
            raise ValueError(f"--capture must be one of {', '.join(CAPTURES)}, got {self.capture!r}")
        if self.step_boundary not in ("auto", "explicit"):
            raise ValueError(f"step_boundary must be 'auto' or 'explicit', got {self.step_boundary!r}")
        if not 1 <= self.offset_rounds <= 1000:
            raise ValueError(f"offset_rounds must be in 1..1000, got {self.offset_rounds}")
        if not 1 <= self.sync_timeout_s <= 3600:
            raise ValueError(f"sync_timeout_s must be in 1..3600 seconds, got {self.sync_timeout_s}")
        if not 0 <= self.flush_interval_s <= 60:
            raise ValueError(f"flush_interval_s must be in 0..60 seconds, got {self.flush_interval_s}")
        if not 0 <= self.memory_interval_s <= 3600:
            raise ValueError(f"memory_interval_s must be in 0..3600 seconds, got {self.memory_interval_s}")
        if isinstance(self.grad_marks_every, bool) or not isinstance(self.grad_marks_every, int):
            raise ValueError(f"{GRAD_MARKS_EVERY.flag} (grad_marks_every) must be a whole number, "
                             f"got {self.grad_marks_every!r}")
        GRAD_MARKS_EVERY.validate(self.grad_marks_every)
