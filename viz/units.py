"""Byte units on the page. GB and MB are decimal (10^9, 10^6 bytes: the ZeRO paper's
unit); GiB and MiB binary (2^30, 2^20: DDP's ``bucket_cap_mb``, torch's memory stats).
A page picks one family (``FAMILIES``) and shows a run's amounts in its small unit and
projections to billions of parameters in its large one, never the two families mixed."""

from __future__ import annotations

UNITS = {"GB": 1e9, "GiB": 2**30, "MB": 1e6, "MiB": 2**20}
# family -> (small unit, large unit)
FAMILIES = {"binary": ("MiB", "GiB"), "decimal": ("MB", "GB")}
FAMILY_LABELS = {"binary": "MiB, GiB (2^20, 2^30 bytes)", "decimal": "MB, GB (10^6, 10^9 bytes: the ZeRO paper's)"}


def unit_scale(unit: str) -> float:
    """Bytes in one ``unit``; a ValueError naming the units for any other."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {', '.join(UNITS)}, got {unit!r}")
    return UNITS[unit]
