"""What a rank of a ``ddpscope run`` job is asked to trace: ``CaptureConfig``, sent to every
rank as JSON in ``$DDPSCOPE_CAPTURE`` (the launcher builds it; torch-free)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from ddpscope.tracer.options import (
    BACKWARD_PREFETCH,
    BUCKET_CAP_MB,
    BUCKET_CAP_MB_LIST,
    CAPTURE,
    FORWARD_PREFETCH,
    GRAD_MARKS_EVERY,
    OUT,
    RESHARD_AFTER_FORWARD,
    STEPS,
    ZERO_STAGE,
    check_fields,
    mib_list,
)

CAPTURE_ENV = "DDPSCOPE_CAPTURE"


@dataclass(kw_only=True)
class CaptureConfig:
    """What a rank of a ``ddpscope run`` job traces (sent through ``$DDPSCOPE_CAPTURE``).

    out: the run folder. bucket_cap_mb, bucket_cap_mb_list: override the script's (MiB;
    None keeps it).
    steps: end the job after this many traced optimizer steps (None: run to the end).
    progress: rank 0 prints a progress line per step for the launcher.
    exit_grace_s: after ``steps``, how long the script may take to unwind (seconds).
    profile_steps: also run torch.profiler on this many first traced steps (None: off).
    capture, capture_note: how all-reduces are timed, and why not compiled (``TracerConfig``).
    reshard_after_forward, forward_prefetch, backward_prefetch: FSDP2 settings overriding
    the script's (``sharded/settings.py``; None keeps the script's).
    zero_stage: DeepSpeed's ZeRO stage overriding the script's config (``deepspeed/config_override.py``).
    grad_marks_every: DDP's gradient-ready marks on the first steps, then every Nth (``TracerConfig``).
    """

    out: str = OUT.field()
    bucket_cap_mb: float | None = BUCKET_CAP_MB.field()
    bucket_cap_mb_list: list[float] | None = BUCKET_CAP_MB_LIST.field()
    steps: int | None = STEPS.field()
    progress: bool = True
    exit_grace_s: float = 30.0
    profile_steps: int | None = None
    capture: str = CAPTURE.field()
    capture_note: str | None = None
    reshard_after_forward: str | None = RESHARD_AFTER_FORWARD.field()
    forward_prefetch: int | None = FORWARD_PREFETCH.field()
    backward_prefetch: int | None = BACKWARD_PREFETCH.field()
    zero_stage: int | None = ZERO_STAGE.field()
    grad_marks_every: int = GRAD_MARKS_EVERY.field()

    def __post_init__(self) -> None:
        check_fields(self)
        if self.bucket_cap_mb_list is not None:
            self.bucket_cap_mb_list = list(mib_list(self.bucket_cap_mb_list))

    def to_env(self) -> dict[str, str]:
        return {CAPTURE_ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ=os.environ) -> "CaptureConfig | None":
        raw = environ.get(CAPTURE_ENV)
        if not raw:
            return None
        return cls(**json.loads(raw))
