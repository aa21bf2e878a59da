"""What the simulator takes from a trace, and the parameters it fits there.

Per finished, non-warm-up step and rank (``StepInputs``): the backward start, each
gradient's ready time and the end of backward compute as *work* (µs of backward compute
with the slowdown under communication taken out), and the measured rest of the step
around the syncing backward (before it, after DDP has every averaged gradient).

``fit_model`` fits (``WhatIfModel``):
- the all-reduce cost of one bucket alone against its size (``viz.whatif.cost``): the
  calibration sweep's curve when the run has one, brought to the run's own buckets that
  ran alone after backward (in a training step an all-reduce can run slower or faster
  than the same one in the calibration: the hook's callbacks, the ranks' skew, the
  machine's mood): slower by a fixed cost per all-reduce, faster by a factor; else as
  measured; without a calibration, a line through the run's own buckets;
- ``comm_slowdown``: how much longer an all-reduce takes while backward computes (on CPU
  gloo's threads share the cores with autograd), fitted to the run's buckets: each
  bucket's time in flight, in slices with and without backward compute beside it;
- ``steal_us_per_allreduce`` + ``steal_us_per_mib`` x MiB: backward compute lost beside
  one all-reduce (µs). On CPU an all-reduce's reductions, copies and thread hand-offs take
  the cores autograd needs, by the bucket and by the byte, not by the time it is in
  flight (a bucket waiting on its peer costs nothing). Measured by the calibration
  (compute beside trains of small and of large all-reduces), as measured (times the
  run's factor where its all-reduces are faster than the calibration's: a slower one's
  fixed cost is waiting, not work on the cores); without one, fitted to the
  trace's gradients: segments of backward between two ready gradients of the same kind
  (same name but for layer numbers, same size) cost the same work, so their overlapped
  and non-overlapped durations give a slowdown, turned into µs/MiB with the run's own
  time in flight per MiB; else 0 (``notes`` say which), and on CPU at most the run's time
  in flight per MiB (``steal_max_us_per_mib``: overlap then buys nothing), the other end
  of what the trace allows, which the advisor checks a change against;
- ``launch_us``: bucket ready (its last gradient) -> DDP hands it to the hook (median);
- ``shared_link``: whether all-reduces in flight at once share one link. On one machine
  (loopback) they do not: a small gloo all-reduce mostly waits on its peer, and two run
  side by side on two cores. Across nodes (``nnodes`` > 1, emulated nodes included) the
  node's link is the bottleneck and they split its bandwidth: each then progresses at
  1/n of its rate while n are in flight, in the fit as in the simulation; and, without a
  calibration, the cost is the link's bandwidth alone (a line through the origin): two
  or three bucket sizes cannot tell a latency from the link's unfairness between
  streams, and the lab has no latency (no ``netem``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from ddpscope.viz.intervals import covered, merge_intervals
from ddpscope.viz.trace import RunTrace, TraceError, has_marks
from ddpscope.viz.whatif.cost import AllReduceCost, Calibration, fit_line, read_calibration

#: what a cost line through the origin means for the predictions (said where it is used)
UNFITTED_LATENCY = ("no fixed cost per all-reduce was measured, so each costs its bytes alone: settings with "
                    "more, smaller buckets are predicted too fast and with fewer, larger ones too slow; "
                    "`ddpscope calibrate` measures it")
#: all-reduces one process group runs at once: gloo's two worker threads, NCCL's one stream
LANES = {"gloo": 2, "nccl": 1}
MIB = 2**20
_SLOWDOWN_GRID = np.linspace(0.0, 4.0, 81)


@dataclass(frozen=True, kw_only=True)
class WhatIfModel:
    cost: AllReduceCost
    lanes: int = 1
    comm_slowdown: float = 0.0
    steal_us_per_allreduce: float = 0.0
    steal_us_per_mib: float = 0.0
    launch_us: float = 0.0
    shared_link: bool = False
    notes: tuple[str, ...] = ()
    steal_max_us_per_mib: float | None = None  # the steal not measured (CPU): the most it can be

    def at_most_steal(self) -> "WhatIfModel":
        """This model with the steal at ``steal_max_us_per_mib``, where it was not measured."""
        if self.steal_max_us_per_mib is None:
            raise ValueError("the steal was measured: it has no bound")
        return replace(self, steal_us_per_mib=self.steal_max_us_per_mib, steal_max_us_per_mib=None)

    def __post_init__(self) -> None:
        if self.lanes < 1:
            raise ValueError(f"lanes must be >= 1, got {self.lanes}")
        for name in ("comm_slowdown", "steal_us_per_allreduce", "steal_us_per_mib", "launch_us",
                     *(("steal_max_us_per_mib",) if self.steal_max_us_per_mib is not None else ())):
            v = getattr(self, name)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be >= 0, got {v}")

    def steal_us(self, mib) -> np.ndarray:
        """Backward compute lost beside all-reduces of ``mib`` MiB each (µs)."""
        return self.steal_us_per_allreduce + self.steal_us_per_mib * np.asarray(mib, float)


@dataclass(frozen=True)
class RankStep:
    """One rank's syncing backward in one step. Times µs on rank 0's clock; work µs."""

    b0: float  # backward start
    work: dict[int, float]  # parameter -> work done when its gradient was ready
    work_end: float  # work at the end of backward compute
    head: float  # step start -> backward start
    finalize: float  # the later of compute's end and the last all-reduce -> DDP has every averaged gradient
    tail: float  # every averaged gradient -> step end


@dataclass(frozen=True)
class StepInputs:
    step: int
    ranks: dict[int, RankStep]


def check_predictable(trace: RunTrace) -> None:
    """Raise ``TraceError`` (one line) when a trace cannot be the base of a prediction."""
    if trace.run.get("kind") not in (None, "ddp"):
        raise TraceError(f"{trace.path.name} is a {trace.run.get('kind')} run: what-if needs a DDP training run")
    if not trace.run.get("param_bytes"):
        raise TraceError(f"{trace.path.name} has no parameter sizes in run.json (an unfinished or too old run)")
    if len(trace.buckets) == 0 or len(trace.grads) == 0:
        raise TraceError(f"{trace.path.name} has no traced all-reduce or gradient: nothing to predict from")
    steps = usable_steps(trace)
    if not len(steps):
        raise TraceError(f"{trace.path.name} has no finished step after DDP's bucket rebuild on every rank: "
                         "trace more steps")
    if not has_marks(trace.steps[trace.steps["step"].isin(steps)]).any():
        raise TraceError(f"{trace.path.name} has no such step with gradient marks (--grad-marks-every "
                         f"{trace.run.get('grad_marks_every')}): trace more steps, or mark more often")


def usable_steps(trace: RunTrace) -> list[int]:
    """Steps finished, past warm-up, and with a backward on every rank (replayed: those with marks)."""
    s = trace.steps
    if not len(s) or "backward_start_us" not in s:
        return []
    s = s[~s["warmup"] & ~s["incomplete"] & s["backward_start_us"].notna() & s["backward_end_us"].notna()]
    counts = s.groupby("step")["rank"].nunique()
    return sorted(int(k) for k, n in counts.items() if n == len(trace.ranks))


def _last_launch(trace: RunTrace) -> dict[int, pd.Series]:
    """Per step, each bucket's last launch over ranks (µs): the collective cannot start earlier."""
    return {int(k): g.groupby("bucket")["launch_us"].max() for k, g in trace.buckets.groupby("step")}


def _flights(b: pd.DataFrame, start_all: pd.Series | None) -> np.ndarray:
    """Per bucket (rows of ``b``): [start, done, MiB], start when every rank had launched it."""
    launch = b["launch_us"].to_numpy(float)
    if start_all is not None:
        launch = np.maximum(launch, b["bucket"].map(start_all).to_numpy(float))
    done = b["done_us"].to_numpy(float)
    return np.column_stack([np.minimum(launch, done), done, b["bytes"].to_numpy(float) / MIB])


def _comm_union(b: pd.DataFrame, start_all: pd.Series | None) -> np.ndarray:
    """The rank's time with an all-reduce in flight, as disjoint [start, end]."""
    f = _flights(b, start_all)
    return merge_intervals(f[:, 0], f[:, 1])


def _work_at(t: float, b0: float, flights: np.ndarray, model: WhatIfModel) -> float:
    """Backward work done by ``t`` (µs): the time since ``b0`` less what the all-reduces
    took from it (``model.steal_us``, spread over each one's flight)."""
    lo, hi, mib = flights.T
    inside = np.clip(np.minimum(hi, t) - np.maximum(lo, b0), 0, None)
    frac = np.divide(inside, hi - lo, out=np.ones_like(inside) * (inside > 0), where=hi > lo)
    return (t - b0) - float(np.sum(frac * model.steal_us(mib)))


def step_inputs(trace: RunTrace, model: WhatIfModel) -> list[StepInputs]:
    """``StepInputs`` of every usable step (see ``usable_steps``)."""
    steps = trace.steps.set_index(["rank", "step"])
    grads = trace.grads
    sync_micro = _syncing_micro(trace)
    g_by = {k: g for k, g in grads.groupby(["rank", "step"])}
    b_by = {k: g for k, g in trace.buckets.groupby(["rank", "step"])}
    last_launch = _last_launch(trace)
    out = []
    for step in usable_steps(trace):
        ranks = {}
        for rank in sorted(trace.ranks):
            s = steps.loc[(rank, step)]
            g = g_by.get((rank, step))
            b = b_by.get((rank, step))
            if g is None or b is None:
                break
            g = g[g["micro"] == sync_micro.get((rank, step), g["micro"].max())]
            if not len(g) or not len(b):  # nothing of this rank's reduction left to replay: not a usable step
                break
            flights = _flights(b, last_launch.get(step))
            b0, b1 = float(s["backward_start_us"]), float(s["backward_end_us"])
            # compute ends at the last gradient: a backward span that ran on (waiting inside DDP's
            # finalize for an all-reduce) is waiting, which the replay makes from its own all-reduces
            ce = float(s["compute_end_us"]) if pd.notna(s.get("compute_end_us")) else b1
            sync_end = float(s["sync_end_us"]) if pd.notna(s.get("sync_end_us")) else max(b1, b["done_us"].max())
            work = {int(p): max(0.0, _work_at(float(t), b0, flights, model))
                    for p, t in zip(g["param"], g["ready_us"])}
            ranks[rank] = RankStep(
                b0=b0, work=work, work_end=max(_work_at(ce, b0, flights, model), max(work.values())),
                head=b0 - float(s["start_us"]),
                finalize=max(0.0, sync_end - max(ce, float(b["done_us"].max()))),
                tail=max(0.0, float(s["end_us"]) - sync_end))
        else:
            out.append(StepInputs(step=step, ranks=ranks))
    return out


def _syncing_micro(trace: RunTrace) -> dict[tuple[int, int], int]:
    p = trace.passes
    if not len(p) or "sync" not in p:
        return {}
    synced = p[p["sync"].astype(bool)]
    return {(int(r), int(s)): int(m) for r, s, m in zip(synced["rank"], synced["step"], synced["micro"])}


# -- fitting ---------------------------------------------------------------------------------


def fit_model(trace: RunTrace, calibration: Calibration | None | str = "auto") -> WhatIfModel:
    """Fit every parameter of the model to ``trace`` (and its calibration: ``"auto"``
    reads the run folder's ``calibration.json`` if there is one). Raises ``TraceError``."""
    check_predictable(trace)
    if calibration == "auto":
        calibration = read_calibration(trace.path)
    notes = []
    if calibration is not None and (unlike := calibration.unlike(trace.run, trace.world_size)):
        notes.append(f"{unlike}: not used")
        calibration = None
    backend = str(trace.run.get("backend") or next(iter(trace.ranks.values())).get("backend") or "gloo")
    lanes = LANES.get(backend, 1)
    shared = across_nodes(trace)
    cost, kappa, c_note = fit_comm(trace, lanes, calibration, shared)
    steal = calibration.steal() if calibration is not None else None
    bound = None
    if steal is not None:
        # the run's all-reduces faster than the calibration's: their work on the cores too. A
        # slower one is not more work: its fixed cost is waiting (x 2 the steal of a 1 MiB cap's
        # buckets left backward 14 ms of work where a 25 MiB cap's trace measured 29)
        steal = (steal[0] * cost.scale, steal[1] * cost.scale)
        s_note = ("backward compute lost beside all-reduces: the calibration's"
                  + (f" x {cost.scale:.2f} (the run's all-reduces against the calibration's)" if cost.scale != 1.0 else ""))
    else:
        s, s_note = fit_compute_slowdown(trace)
        if s is None:
            steal, most = (0.0, 0.0), ""
            if str(trace.run.get("device") or "cpu") == "cpu":  # gloo's threads share the cores: maybe all
                bound = flight_us_per_mib(trace)
                most = f"at most {bound:.0f} µs per MiB, all the backward compute it overlaps; "
            s_note = f"{s_note}; taken as 0 ({most}run `ddpscope calibrate` to measure it)"
        else:
            steal = (0.0, s / (1.0 + s) * flight_us_per_mib(trace))
    notes += [f"{s_note}: {steal[0]:.0f} µs per all-reduce + {steal[1]:.0f} µs per MiB", c_note]
    if shared:
        notes.append("the ranks span nodes: all-reduces in flight at once share the node's link")
    return WhatIfModel(cost=cost, lanes=lanes, comm_slowdown=kappa, steal_us_per_allreduce=float(steal[0]),
                       steal_us_per_mib=float(steal[1]), shared_link=shared,
                       launch_us=launch_delay_us(trace), notes=tuple(notes), steal_max_us_per_mib=bound)


def across_nodes(trace: RunTrace) -> bool:
    """Whether the run's ranks span nodes (real or emulated): their all-reduces cross a link."""
    run = trace.run
    return nodes(run) > 1 or isinstance(run.get("emulation"), dict)


def nodes(run: dict) -> int:
    """run.json's ``nnodes`` (1 when absent or not a whole number)."""
    n = run.get("nnodes")
    return n if isinstance(n, int) and not isinstance(n, bool) else 1


def flight_us_per_mib(trace: RunTrace) -> float:
    """Time with an all-reduce in flight during backward per MiB of the all-reduces there
    (µs/MiB), summed over usable steps and ranks: the conversion from a slowdown in time
    to compute lost per MiB that removes, on this trace, what the slowdown says (all-reduces
    in flight at once count once in the time, each in the MiB)."""
    steps = trace.steps.set_index(["rank", "step"])
    last_launch = _last_launch(trace)
    keep = set(usable_steps(trace))
    time_us = mib = 0.0
    for (rank, step), b in trace.buckets.groupby(["rank", "step"]):
        if step not in keep:
            continue
        b0, b1 = (float(steps.loc[(rank, step)][k]) for k in ("backward_start_us", "backward_end_us"))
        flights = _flights(b, last_launch.get(step))
        time_us += covered(merge_intervals(flights[:, 0], flights[:, 1]), b0, b1)
        lo, hi, size = flights.T
        inside = np.clip(np.minimum(hi, b1) - np.maximum(lo, b0), 0, None)
        mib += float(np.sum(np.divide(inside, hi - lo, out=np.zeros_like(inside), where=hi > lo) * size))
    return time_us / mib if mib > 0 else 0.0


def launch_delay_us(trace: RunTrace) -> float:
    """Median of bucket launch - its last gradient ready (µs), over usable steps and ranks."""
    names = {n: i for i, n in enumerate(trace.run.get("param_names") or [])}
    ready = trace.grads.groupby(["rank", "step", "param"])["ready_us"].max()
    keep = set(usable_steps(trace))
    delays = []
    for b in trace.buckets.itertuples(index=False):
        if b.step not in keep:
            continue
        times = [ready.get((b.rank, b.step, names.get(p, -1))) for p in b.params]
        times = [t for t in times if t is not None]
        if times:
            delays.append(b.launch_us - max(times))
    return float(max(0.0, np.median(delays))) if delays else 0.0


def _role(name: str) -> str:
    return re.sub(r"\d+", "#", str(name))


def fit_compute_slowdown(trace: RunTrace) -> tuple[float | None, str]:
    """Backward's slowdown under communication from the trace's own segments (see the
    module's docstring), or ``(None, why not)``."""
    sizes = trace.run.get("param_bytes") or []
    rows = []
    steps = trace.steps.set_index(["rank", "step"])
    b_by = {k: g for k, g in trace.buckets.groupby(["rank", "step"])}
    last_launch = _last_launch(trace)
    keep = set(usable_steps(trace))
    for (rank, step), g in trace.grads.groupby(["rank", "step"]):
        if step not in keep or (rank, step) not in b_by:
            continue
        s = steps.loc[(rank, step)]
        comm = _comm_union(b_by[(rank, step)], last_launch.get(step))
        g = g.sort_values("ready_us")
        prev = float(s["backward_start_us"])
        for p, name, t in zip(g["param"], g["name"], g["ready_us"]):
            d = float(t) - prev
            if d > 0:
                size = sizes[int(p)] if 0 <= int(p) < len(sizes) else -1
                rows.append((rank, int(p), f"{_role(name)}/{size}", d, covered(comm, prev, float(t)) / d))
            prev = float(t)
    if not rows:
        return None, "no backward segments to fit the compute slowdown to"
    df = pd.DataFrame(rows, columns=["rank", "param", "role", "d", "f"])
    df = df.groupby(["rank", "param", "role"], as_index=False)[["d", "f"]].median()
    spread = df.groupby("role")["f"].agg(lambda f: f.max() - f.min())
    roles = spread[spread >= 0.5].index  # kinds seen both mostly overlapped and mostly not
    if len(roles) < 2:
        return None, "the trace has too few gradients of one kind both with and without communication beside " \
                     "them to fit backward's slowdown"
    df = df[df["role"].isin(roles)]
    # least squares per kind at each grid point, in numpy (81 points: pandas' groupby per point
    # was most of a what-if's fit)
    codes = pd.factorize(df["role"])[0]
    d, f = df["d"].to_numpy(float), df["f"].to_numpy(float)
    best, best_s = np.inf, 0.0
    for s in _SLOWDOWN_GRID:
        w = 1.0 + s * f
        c = np.bincount(codes, d * w) / np.bincount(codes, w * w)
        res = float(((d - c[codes] * w) ** 2).sum())
        if res < best:
            best, best_s = res, float(s)
    return best_s, f"backward's slowdown under communication fitted to {len(roles)} kinds of gradient: {best_s:.2f}"


def fit_comm(trace: RunTrace, lanes: int, calibration: Calibration | None, shared_link: bool = False
             ) -> tuple[AllReduceCost, float, str]:
    """All-reduce cost alone and its slowdown beside backward compute, from every bucket
    of the usable steps (with the calibration's curve when there is one). ``shared_link``:
    a slice of flight beside n - 1 others did 1/n of the bucket's work."""
    samples = _comm_samples(trace, lanes)
    share = 1.0 / np.maximum(samples["in_flight"], 1) if shared_link else 1.0
    if not len(samples["bytes"]):
        raise TraceError(f"{trace.path.name}: no finished all-reduce to fit the communication cost to")
    nbytes = np.asarray(samples["bytes"], float)
    base = calibration.cost() if calibration is not None else None
    flight, busy = samples["flight"], samples["computing"]
    if base is not None:
        # The run's own level against the calibration, from the buckets that ran alone and
        # outside backward (>= 70 % of their flight): a bucket beside another or beside
        # compute is slower for reasons the model has separately (lanes, the slowdown).
        alone = (flight * (1 - busy) * (samples["in_flight"] <= 1)).sum(axis=1) / np.maximum(flight.sum(axis=1), 1e-9)
        clean = alone >= 0.7
        if clean.any():
            took, cal = flight.sum(axis=1)[clean], base.time_us(nbytes[clean])
            extra = float(np.median(took - cal))
            # slower across nodes: the calibration ran over the same link, which sets an all-reduce's
            # time; a few buckets slower are its moods (the lab's `wide`: 25.6 ms added to each put
            # its step 6.0 % too slow, the calibration as measured 0.7 %): kept as measured
            if extra > 0 and not shared_link:
                # slower than the calibration: a fixed cost per all-reduce in a training step
                # (its callbacks, hand-offs, the ranks' last skew), not a slower link: bucket
                # sizes differ between the steps a cap makes, and a factor read off one size
                # (often the last bucket alone) put a 25 MiB bucket at 2x its measured time
                base = base.with_overhead(extra, f"calibration + {extra:.0f} µs an all-reduce (this run's "
                                                 f"{int(clean.sum())} buckets that ran alone after backward)")
            elif extra <= 0:
                scale = float(np.median(took / cal))
                base = base.with_scale(scale, f"calibration x {scale:.2f} (this run's {int(clean.sum())} "
                                              "buckets that ran alone after backward)")
    best = None
    for kappa in _SLOWDOWN_GRID:
        work = (flight * share / (1.0 + kappa * busy)).sum(axis=1)  # µs each, uncontended
        # across nodes the link's bandwidth is the cost: a few bucket sizes cannot tell a
        # latency from the link's unfairness between streams (tens of ms fitted on 2 sizes)
        cost = base if base is not None else fit_line(nbytes, work, "the run's own buckets", shared_link)
        err = float(np.sum(np.log(np.maximum(work, 1.0) / cost.time_us(nbytes)) ** 2))
        if best is None or err < best[0] - 1e-9:
            best = (err, cost, float(kappa))
    _, cost, kappa = best
    sizes = len(np.unique(nbytes))
    said = "" if "one size" in cost.source else f" ({sizes} size{'s' if sizes > 1 else ''})"
    note = (f"all-reduce cost from {cost.source}{said}: {cost.in_words()}; "
            f"{kappa:.2f} slower beside backward compute")
    if not cost.latency_fitted:
        note += f"; {UNFITTED_LATENCY}"
    return cost, kappa, note


def _comm_samples(trace: RunTrace, lanes: int) -> dict:
    """Per bucket all-reduce (usable steps, per rank): its bytes, and its time in flight
    cut into slices: each slice's duration (``flight``, µs), whether backward computed
    then on any rank (``computing``, 0/1) and how many of this rank's all-reduces were in
    flight (``in_flight``), as arrays of equal shape (buckets x slices, padded with zeros)."""
    keep = set(usable_steps(trace))
    last_launch = _last_launch(trace)
    s = trace.steps[trace.steps["step"].isin(keep)]
    spans_of = {int(k): g[["backward_start_us", "backward_end_us"]].to_numpy(float) for k, g in s.groupby("step")}
    nbytes, flight, computing, in_flight = [], [], [], []
    for (rank, step), b in trace.buckets.groupby(["rank", "step"]):
        if step not in keep:
            continue
        spans = spans_of[int(step)]  # every rank's backward compute
        b = b.sort_values("bucket")
        starts = np.maximum(b["bucket"].map(last_launch[int(step)]).to_numpy(float), b["launch_us"].to_numpy(float))
        done = b["done_us"].to_numpy(float)
        # FIFO with ``lanes`` workers: a bucket starts no earlier than the lanes-th one before it ended
        for j in range(lanes, len(starts)):
            starts[j] = max(starts[j], np.sort(done[:j])[-lanes])
        starts = np.minimum(starts, done)
        cuts = np.unique(np.concatenate([starts, done, np.ravel(spans)]))
        for j, nb in enumerate(b["bytes"].to_numpy()):
            lo, hi = starts[j], done[j]
            edges = cuts[(cuts >= lo) & (cuts <= hi)]
            if len(edges) < 2:
                continue
            mid = (edges[:-1] + edges[1:]) / 2
            nbytes.append(float(nb))
            flight.append(np.diff(edges))
            in_flight.append(((starts[:, None] <= mid) & (done[:, None] > mid)).sum(axis=0))
            computing.append(np.any([(mid >= lo_) & (mid < hi_) for lo_, hi_ in spans], axis=0).astype(float))
    width = max((len(x) for x in flight), default=0)
    pad = lambda rows: np.array([np.pad(r, (0, width - len(r))) for r in rows]) if rows else np.zeros((0, 0))
    return {"bytes": nbytes, "flight": pad(flight), "computing": pad(computing), "in_flight": pad(in_flight)}
