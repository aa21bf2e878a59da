"""All-reduce time against message size: ``T(M) = latency + M / bandwidth``, or
piecewise-linear through a calibration sweep's medians where one was run.

``AllReduceCost.time_us(M)`` is the time of one all-reduce of M bytes running alone
(nothing else on the process group, no compute beside it). What runs beside it is the
simulator's business (``viz.whatif.model``). A calibration (``ddpscope calibrate``) is
``calibration.json`` in the run folder: per size, the median time of ``dist.all_reduce``
on the same ranks and backend.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ddpscope.viz.run_files import read_json_file
from ddpscope.viz.trace import TraceError

CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT = "ddpscope-calibration"
#: sizes closer than this (largest / smallest) are one size to a line's fit: a fixed cost per
#: all-reduce cannot be told from bandwidth on them (a cap's buckets are all about the cap)
SIZE_SPREAD = 2.0


@dataclass(frozen=True, kw_only=True)
class AllReduceCost:
    """``latency_us`` (µs) + bytes x ``us_per_byte``; ``points``: (bytes, µs) medians of
    a calibration, interpolated linearly between them (the line outside them);
    ``scale``: a factor on everything and ``overhead_us`` (µs) added to each all-reduce
    (the run's own buckets against the calibration: faster, or slower by a fixed cost);
    ``source``: where the numbers came from, said to the user; ``latency_fitted``: False
    where the line went through the origin because nothing measured a fixed cost (one
    size, a line through the sizes with a negative one, or a link taken as bandwidth
    alone): settings with more, smaller all-reduces are then predicted too fast, and with
    fewer, larger ones too slow."""

    latency_us: float
    us_per_byte: float
    points: tuple[tuple[float, float], ...] = ()
    scale: float = 1.0
    overhead_us: float = 0.0
    source: str = ""
    latency_fitted: bool = True

    def __post_init__(self) -> None:
        if not (np.isfinite(self.latency_us) and self.latency_us >= 0):
            raise ValueError(f"all-reduce latency must be >= 0 µs, got {self.latency_us}")
        if not (np.isfinite(self.us_per_byte) and self.us_per_byte > 0):
            raise ValueError(f"all-reduce time per byte must be > 0 µs, got {self.us_per_byte}")
        if not (np.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"cost scale must be > 0, got {self.scale}")
        if not (np.isfinite(self.overhead_us) and self.overhead_us >= 0):
            raise ValueError(f"all-reduce overhead must be >= 0 µs, got {self.overhead_us}")

    @property
    def bandwidth_gbps(self) -> float:
        """Algorithm bandwidth of the bandwidth term (GB/s, 10^9 bytes/s)."""
        return 1e-3 / self.us_per_byte

    @property
    def calibrated(self) -> bool:
        """Whether the line runs through a calibration's medians."""
        return len(self.points) >= 2

    @property
    def fixed_us(self) -> float:
        """µs an all-reduce costs beyond its bytes, scale and overhead applied."""
        return self.latency_us * self.scale + self.overhead_us

    @property
    def applied_gbps(self) -> float:
        """The bandwidth term's GB/s with the scale applied."""
        return self.bandwidth_gbps / self.scale

    def time_us(self, nbytes) -> np.ndarray:
        """µs for all-reduces of ``nbytes`` (array-like, bytes), each alone."""
        m = np.asarray(nbytes, dtype=float)
        line = self.latency_us + m * self.us_per_byte
        if len(self.points) >= 2:
            xs, ys = np.array(self.points, dtype=float).T
            inside = (m >= xs[0]) & (m <= xs[-1])
            line = np.where(inside, np.interp(m, xs, ys), line)
        return self.scale * line + self.overhead_us

    def in_words(self) -> str:
        """The line as said to the user: fixed µs an all-reduce + bandwidth (GB/s), scale and overhead applied."""
        return f"{self.fixed_us:.0f} µs + {self.applied_gbps:.2f} GB/s"

    def with_scale(self, scale: float, source: str) -> AllReduceCost:
        return replace(self, scale=float(scale), overhead_us=0.0, source=source)

    def with_overhead(self, overhead_us: float, source: str) -> AllReduceCost:
        return replace(self, scale=1.0, overhead_us=float(overhead_us), source=source)


def fit_line(nbytes, us, source: str, through_origin: bool = False) -> AllReduceCost:
    """Least squares ``us = latency + bytes x us_per_byte`` with latency >= 0; with sizes
    less than ``SIZE_SPREAD`` apart (one size), a fit that says negative latency, or
    ``through_origin``, the line goes through the origin (``latency_fitted`` False).
    Raises ``ValueError`` with no positive sample."""
    m, t = np.asarray(nbytes, float), np.asarray(us, float)
    ok = np.isfinite(m) & np.isfinite(t) & (m > 0) & (t > 0)
    m, t = m[ok], t[ok]
    if not len(m):
        raise ValueError("no all-reduce to fit the cost to")
    per_byte = float(np.sum(m * t) / np.sum(m * m))
    if through_origin:
        return AllReduceCost(latency_us=0.0, us_per_byte=per_byte, source=f"{source}, bandwidth only",
                             latency_fitted=False)
    if m.max() < SIZE_SPREAD * m.min():
        lo, hi = m.min() / 2**20, m.max() / 2**20
        about = f"{lo:.3g} MiB" if f"{lo:.3g}" == f"{hi:.3g}" else f"{lo:.3g} to {hi:.3g} MiB"
        return AllReduceCost(latency_us=0.0, us_per_byte=per_byte, latency_fitted=False,
                             source=f"{source}, one size ({about}): no latency term")
    (lat, slope), *_ = np.linalg.lstsq(np.column_stack([np.ones_like(m), m]), t, rcond=None)
    if lat >= 0 and slope > 0:
        return AllReduceCost(latency_us=float(lat), us_per_byte=float(slope), source=source)
    # a negative fixed cost is no measurement of one (a small bucket beside backward's compute, or
    # noise): a Trainer ResNet's two sizes said one, and its 0.25 MiB cap was predicted at half the
    # communication a rerun measured (11.9 against 23.9 ms a step; calibrated: 23.2)
    return AllReduceCost(latency_us=0.0, us_per_byte=per_byte, latency_fitted=False,
                         source=f"{source}, through the origin (a line through its sizes had a negative latency)")


@dataclass(frozen=True)
class Calibration:
    """A calibration sweep: ``sizes`` (bytes) and ``us`` (median µs of each), and the
    contention it measured (``compute_slowdown``, ``comm_slowdown``: extra time as a
    fraction, e.g. 0.5 = 1.5x as long; None if not measured)."""

    sizes: tuple[float, ...]
    us: tuple[float, ...]
    world_size: int
    backend: str
    compute_slowdown: float | None = None
    comm_slowdown: float | None = None
    meta: dict = field(default_factory=dict, compare=False)

    def steal(self) -> tuple[float, float] | None:
        """Compute lost beside an all-reduce as ``(µs per all-reduce, µs per MiB)``, a line
        through the contention phase's two sizes; None if it has not both."""
        try:
            pts = sorted((float(c["bytes"]) / 2**20, float(c["compute_lost_us"]))
                         for c in (self.meta.get("contention") or {})["sizes"])
        except (KeyError, TypeError, ValueError):
            return None
        if len(pts) < 2 or pts[-1][0] <= pts[0][0] or not all(np.isfinite(v) for p in pts for v in p):
            return None
        (m0, l0), (m1, l1) = pts[0], pts[-1]
        per_mib = max(0.0, (l1 - l0) / (m1 - m0))
        return max(0.0, l0 - per_mib * m0), per_mib

    def unlike(self, run: dict, world_size: int) -> str | None:
        """Why this calibration does not fit a run (its run.json and world size): other
        ranks, another backend or device, or another link (emulated nodes and their rate);
        None when it fits."""
        if self.world_size != world_size:
            return f"the calibration ran on {self.world_size} ranks, the run on {world_size}"
        for what, ours in (("backend", self.backend), ("device", self.meta.get("device"))):
            theirs = run.get(what)
            if not (ours and theirs):
                continue
            # cuda:1 is cuda; a group of several backends ("cpu:gloo,cuda:nccl") holds the one calibrated
            a, b = (str(v).split(":")[0] if what == "device" else str(v) for v in (ours, theirs))
            if a not in b and b not in a:  # a gloo sweep on CPU is not NCCL's on GPUs
                return f"the calibration ran on {what} {ours}, the run on {theirs}"
        ours, theirs = (_lab(d) for d in (self.meta, run))
        if ours != theirs:
            def say(lab):
                return f"{lab[0]} emulated nodes over {lab[1] / 1e6:g} Mbit/s links" if lab else "no emulated link"
            return f"the calibration ran on {say(ours)}, the run on {say(theirs)}"
        return None

    def cost(self) -> AllReduceCost:
        line = fit_line(self.sizes, self.us, "calibration")
        return AllReduceCost(latency_us=line.latency_us, us_per_byte=line.us_per_byte,
                             points=tuple(zip(self.sizes, self.us)), source="calibration")


def _lab(facts: dict) -> tuple[int, float] | None:
    """(nodes, link bit/s) of the lab a run or calibration ran in, None if none (or unreadable)."""
    lab = facts.get("emulation")
    try:
        return (int(lab["nodes"]), float(lab["link_bps"])) if isinstance(lab, dict) else None
    except (KeyError, TypeError, ValueError):
        return None


def read_calibration(run_dir: str | Path) -> Calibration | None:
    """The run's ``calibration.json``, checked; None if the run has none. A file that is
    there but unreadable raises ``TraceError``."""
    path = Path(run_dir) / CALIBRATION_FILE
    if not path.exists():
        return None
    data = read_json_file(path, "calibration")
    if data.get("format") != CALIBRATION_FORMAT:
        raise TraceError(f"{path.name} in {path.parent} is not a ddpscope calibration")
    try:
        rows = sorted((float(r["bytes"]), float(r["us"])) for r in data["sizes"])
        sizes, us = zip(*rows) if rows else ((), ())
        if not rows or not all(np.isfinite(x) and x > 0 for x in (*sizes, *us)):
            raise ValueError("sizes and times must be > 0")
        cont = data.get("contention") or {}
        slow = {k: (None if cont.get(k) is None else float(cont[k])) for k in ("compute_slowdown", "comm_slowdown")}
        if any(v is not None and not (np.isfinite(v) and v >= 0) for v in slow.values()):
            raise ValueError("slowdowns must be >= 0")
        return Calibration(sizes=tuple(sizes), us=tuple(us), world_size=int(data["world_size"]),
                           backend=str(data["backend"]), meta=data, **slow)
    except (KeyError, TypeError, ValueError) as e:
        raise TraceError(f"{path.name} in {path.parent} is malformed ({type(e).__name__}: {e})") from None
