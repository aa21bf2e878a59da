"""Failures whose message does not say what to change: a rank's error line matched to
the setting behind it, so the launcher's one line says what to do (said after the error,
which stays as the script had it)."""

from __future__ import annotations

# (text of the error line, what it means and what to change)
KNOWN = (
    ("First bucket should be smaller/equal to other buckets",
     "torch.compile's DDPOptimizer refuses a bucket cap under 1 MiB, its first bucket: give DDP a bucket_cap_mb "
     "(or a bucket_cap_mb_list whose largest entry is) of at least 1"),
)


def known_cause(error_line: str | None) -> str | None:
    """What a rank's error line means and what to change, or None when it is not one of ``KNOWN``."""
    if not error_line:
        return None
    return next((what for text, what in KNOWN if text in error_line), None)
