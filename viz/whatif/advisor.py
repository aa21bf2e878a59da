"""The bucket advisor: the bucket layout with the least predicted step time, and whether
its gain is worth a change, judged against the noise of the run itself.

Searched, every candidate replayed by the what-if simulator on the trace's own steps:
- uniform caps (``bucket_cap_mb``, MiB);
- growing ``bucket_cap_mb_list``s: a small first bucket, so that communication starts
  early, then each limit ``growth`` times the one before, up to a largest;
- per-bucket layouts: from the best so far, a local search that moves one boundary
  between neighbouring buckets by one parameter or more, merges two neighbours or splits
  one at its middle byte (parameters in gradient-ready order, as DDP's rebuild takes
  them), each written back as the ``bucket_cap_mb_list`` that DDP's own bucketing turns
  into exactly that layout (checked with it).

Where DDP never rebuilds its buckets (``find_unused_parameters=True`` in a dynamic graph)
its layout is cut in registration order from the first registered parameter, not in
gradient-ready order: only uniform caps are searched there, and ``Advice.note`` says why.
A ``torch.compile``'d model is offered no cap under 1 MiB and no per-bucket list (its
DDPOptimizer refuses the one, splits at a list's largest entry: ``search.py``).

A simpler setting (a uniform cap, then a shorter list) within ``SIMPLER`` of the best
is preferred: the model is not that exact. The gain is the predicted step at the traced
setting (replayed) less the predicted step at the recommendation, so the model's bias
at the traced setting cancels. Its interval is the noise of two runs' median step time:
√2 x the half-width of the 95 % interval of the traced run's median, bootstrapped over
its steps. A gain inside the noise, or under ``MIN_GAIN`` of the step, changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ddpscope.viz.ddp.compare import compute_waited_steps, median_interval
from ddpscope.viz.trace import RunTrace, has_marks
from ddpscope.viz.whatif.layout import MIB, Cap, cap_label, is_cap_list
from ddpscope.viz.whatif.model import WhatIfModel, fit_model, usable_steps
from ddpscope.viz.whatif.search import LayoutSearch
from ddpscope.viz.whatif.simulate import predict_run, traced_cap
from ddpscope.viz.whatif.sweep import DEFAULT_CAPS, MIN_GAIN, _medians
from ddpscope.viz.whatif.where_to_set import flag_in_code, where_to_set

#: a simpler setting this close to the best (fraction of its step) is recommended instead
SIMPLER = 0.005
#: growing lists: first limits, growth factors and largest limits searched (MiB)
FIRSTS, GROWTHS, LARGEST = (0.25, 0.5, 1.0, 2.0, 4.0), (2.0, 4.0), (8.0, 25.0, 64.0, 256.0)
#: layouts the local search may replay
LOCAL_BUDGET = 400
_KINDS = {"traced": 0, "uniform": 1, "growing list": 2, "per-bucket list": 3}  # simplest first


@dataclass(frozen=True, kw_only=True)
class Advice:
    """What the advisor recommends. Times are medians over steps, each step its
    waited-for rank's (``viz.ddp.compare.compute_waited_steps``), in ms.

    ``setting``: ``bucket_cap_mb`` (a float), a ``bucket_cap_mb_list`` (a tuple of MiB) or
    None (DDP's default); the traced setting when ``change`` is False. ``best``: the
    best setting found, even when not worth a change. ``noise_ms``: half-width of the
    gain's 95 % interval. ``candidates``: every layout searched (kind, setting, buckets,
    ``step_ms`` replayed on every step: the sweep's number for that setting; ``search_ms``
    on the search's few steps, what the local search compared), best first."""

    setting: Cap
    best: Cap
    change: bool
    why: str
    step_ms: float
    exposed_ms: float
    buckets: int
    traced: Cap
    traced_step_ms: float
    measured_step_ms: float
    gain_ms: float
    noise_ms: float
    searched: dict[str, int]
    candidates: pd.DataFrame = field(repr=False)
    prediction: RunTrace = field(repr=False)
    note: str | None = None  # what the run's flags rule out of the search, and why
    # find_unused_parameters=True where every parameter had its gradient in every step: what
    # the same search predicts with the flag off (DDP then rebuilds in gradient-ready order)
    flag_off: "FlagOff | None" = None
    gain_if_overlap_lost_ms: float | None = None  # the steal not measured: the best's gain at its bound
    in_code: str | None = None  # how the user's code sets a recommended change (where_to_set.py)

    @property
    def gain_pct(self) -> float:
        return 100.0 * self.gain_ms / self.traced_step_ms if self.traced_step_ms > 0 else float("nan")

    @property
    def interval_ms(self) -> tuple[float, float]:
        return self.gain_ms - self.noise_ms, self.gain_ms + self.noise_ms

    def as_json(self) -> dict:
        """The ``recommended`` object of ``ddpscope whatif --json``."""
        return {**setting_json(self.setting), "step_ms": self.step_ms, "exposed_ms": self.exposed_ms,
                "buckets": self.buckets, "change": self.change, "why": self.why,
                "traced": setting_json(self.traced), "traced_step_ms": self.traced_step_ms,
                "measured_step_ms": self.measured_step_ms, "gain_ms": self.gain_ms, "gain_pct": self.gain_pct,
                "gain_interval_ms": list(self.interval_ms), "noise_ms": self.noise_ms,
                "best_found": setting_json(self.best), "searched": self.searched, "note": self.note,
                "gain_if_overlap_lost_ms": self.gain_if_overlap_lost_ms, "in_code": self.in_code,
                "flag_off": None if self.flag_off is None else {
                    "flag": self.flag_off.flag, **setting_json(self.flag_off.setting),
                    "step_ms": self.flag_off.step_ms, "gain_ms": self.flag_off.gain_ms,
                    "buckets": self.flag_off.buckets, "text": flag_off_text(self)}}


def flag_off_text(advice: Advice) -> str:
    """One line: what turning the flag off is predicted to give, and whether it is more
    than the run's noise (the advice's own)."""
    off = advice.flag_off
    if off is None:
        raise ValueError("the advice has no flag-off prediction")
    beyond = "more than" if abs(off.gain_ms) > advice.noise_ms else "inside"
    than = f"{abs(off.gain_ms):.1f} ms {'faster' if off.gain_ms >= 0 else 'slower'} than now"
    return (f"every parameter had its gradient in every traced step, so {off.flag} would do: DDP would then rebuild its "
            f"buckets in gradient-ready order; predicted {off.step_ms:.1f} ms a step at {setting_text(off.setting)} "
            f"({than}, {beyond} the noise ±{advice.noise_ms:.1f} ms; the unused-parameter map's all-reduce would go "
            "too, not counted)" + (f"; {off.in_code}" if off.in_code else ""))


def setting_json(cap: Cap) -> dict:
    """``{"bucket_cap_mb": x}``, ``{"bucket_cap_mb_list": [...]}`` or DDP's default (null cap)."""
    if is_cap_list(cap):
        return {"bucket_cap_mb_list": [float(c) for c in cap]}
    return {"bucket_cap_mb": None if cap is None else float(cap)}


def setting_text(cap: Cap) -> str:
    """The setting as a user writes it: ``bucket_cap_mb=4`` or ``bucket_cap_mb_list=1,4,25``."""
    if is_cap_list(cap):
        return f"bucket_cap_mb_list={cap_label(cap)}"
    return "DDP's default bucket_cap_mb (25, first bucket 1)" if cap is None else f"bucket_cap_mb={float(cap):g}"


def step_noise_ms(trace: RunTrace, seed: int = 0) -> float:
    """Half-width (ms) of the 95 % bootstrap interval of the median step time over the
    trace's usable steps, each step its waited-for rank's (``compute_waited_steps``, as
    the medians it bounds): the interval Compare gives a run
    (``viz.ddp.compare.median_interval``), one bootstrap."""
    w = compute_waited_steps(trace)
    _, lo, hi = median_interval(w[w["step"].isin(usable_steps(trace))], seed=seed)
    return float(hi - lo) / 2.0 if math.isfinite(lo) and math.isfinite(hi) else float("nan")


def gain_noise_ms(trace: RunTrace) -> float:
    """The noise (ms) a predicted difference between two settings must exceed to be told
    apart: √2 x ``step_noise_ms`` (two medians, each with this run's noise). NaN: too few steps."""
    return math.sqrt(2.0) * step_noise_ms(trace)


def mark_within_noise(table: pd.DataFrame, noise_ms: float) -> pd.DataFrame:
    """``table`` (rows with ``step_ms``) with ``within_noise``: whether a row's step cannot be
    told apart from the fastest row's (their difference under ``noise_ms``)."""
    fastest = table["step_ms"].min() if len(table) else np.nan
    return table.assign(within_noise=(table["step_ms"] - fastest <= noise_ms) if math.isfinite(noise_ms) else False)


@dataclass(frozen=True)
class FlagOff:
    """A prediction for the run with a flag of DDP's turned off (ms, medians over steps
    of the rank each waited for): the best setting found then, its step, and its gain over the traced
    setting as the run is now."""

    flag: str  # what to change, as the script would write it
    setting: Cap
    step_ms: float
    gain_ms: float
    buckets: int
    in_code: str | None = None  # how the user's code turns it off (where_to_set.flag_in_code)


def unused_parameters(trace: RunTrace) -> list[str]:
    """Parameters that had no gradient in some traced step (non-warm-up): those DDP's
    ``find_unused_parameters=True`` is for. Empty: every one had it in every step."""
    names = trace.run.get("param_names") or [str(i) for i in range(len(trace.run.get("param_bytes") or []))]
    steps = trace.steps[~trace.steps["warmup"].astype(bool)] if len(trace.steps) else trace.steps
    steps = steps[has_marks(steps)]  # a step traced without its marks tells nothing here
    if not len(steps) or not len(trace.grads):
        return list(names)  # nothing to tell by: the flag may be needed
    got = trace.grads.groupby(["rank", "step"])["param"].agg(set).to_dict()
    full, missing = set(range(len(names))), set()
    for key in zip(steps["rank"], steps["step"]):
        missing |= full - got.get(key, set())
    return [names[i] for i in sorted(missing)]


def growing_lists() -> list[tuple[float, ...]]:
    """``(first, first x growth, ..., largest)`` for every first, growth and largest."""
    out = []
    for first in FIRSTS:
        for growth in GROWTHS:
            for largest in LARGEST:
                if largest <= first:
                    continue
                caps = [first]
                while caps[-1] < largest:
                    caps.append(min(caps[-1] * growth, largest))
                out.append(tuple(caps))
    return out


def _roundest(lo: int, hi: float) -> float:
    """The MiB value with the fewest digits whose whole bytes (DDP truncates) lie in
    ``(lo, hi]`` bytes."""
    for digits in range(-2, 10):
        step = 10.0 ** -digits
        v = (math.floor(lo / MIB / step) + 1) * step
        v = float(f"{v:.{max(digits, 0)}f}")
        if lo < int(v * MIB) <= hi:
            return v
    raise ValueError("no limit fits")  # not reached for integer byte sizes


def list_for_layout(search: LayoutSearch, layout: list[list[int]]) -> tuple[float, ...] | None:
    """The shortest, roundest ``bucket_cap_mb_list`` under which DDP's bucketing builds
    ``layout`` (buckets of consecutive parameters in ready order, one dtype); None when
    none does."""
    caps: list[float] = []
    for k, b in enumerate(layout):
        total = sum(search.sizes[p] for p in b)
        lo = total - search.sizes[b[-1]]  # a limit at or under this closes the bucket a parameter early
        last = k == len(layout) - 1  # what is open at the end closes anyway: any larger limit will do
        if last and caps and caps[-1] * MIB > lo:
            break
        caps.append(_roundest(lo, math.inf if last else total))
    while len(caps) > 1 and caps[-1] == caps[-2]:  # the last limit repeats
        caps.pop()
    cap = tuple(caps)
    return cap if search.layout(cap) == layout else None


def _neighbours(cuts: tuple[int, ...], n: int, sizes_in_order: list[int]) -> list[tuple[int, ...]]:
    """Partitions one move away: a boundary moved by 1, 2, 4 or 8 parameters, two
    buckets merged, one bucket split at its middle byte."""
    out = set()
    bounds = (0, *cuts, n)
    for i, c in enumerate(cuts):
        out.add(cuts[:i] + cuts[i + 1:])
        for d in (-8, -4, -2, -1, 1, 2, 4, 8):
            if bounds[i] < c + d < bounds[i + 2]:
                out.add(cuts[:i] + (c + d,) + cuts[i + 1:])
    for a, b in zip(bounds, bounds[1:]):
        if b - a >= 2:
            csum = np.cumsum(sizes_in_order[a:b])
            mid = a + 1 + int(np.searchsorted(csum, csum[-1] / 2.0))
            mid = min(max(mid, a + 1), b - 1)
            out.add(tuple(sorted((*cuts, mid))))
    out.discard(cuts)
    return sorted(out)


def _local_search(search: LayoutSearch, start: list[list[int]], budget: int) -> None:
    """Best-improvement moves from ``start`` until none helps or ``budget`` layouts are
    replayed; every layout that a list can build is added as a candidate."""
    order = search.order
    n = len(order)
    pos = {p: i for i, p in enumerate(order)}
    if any([pos[p] for p in b] != list(range(pos[b[0]], pos[b[0]] + len(b))) for b in start):
        return  # buckets not consecutive in ready order: not a partition this search moves
    sizes = [search.sizes[p] for p in order]
    cuts = tuple(pos[b[0]] for b in start[1:])
    best = search.step_ms(start)
    spent = 0
    while spent < budget:
        moves = []
        for nc in _neighbours(cuts, n, sizes):
            layout = [order[a:b] for a, b in zip((0, *nc), (*nc, n))]
            fresh = tuple(map(tuple, layout)) not in search.seen
            moves.append((search.step_ms(layout), nc, layout))
            spent += fresh
            if spent >= budget:
                break
        ms, nc, layout = min(moves, key=lambda m: m[0], default=(math.inf, None, None))
        if nc is None or ms >= best * (1 - 1e-4):
            return
        cap = list_for_layout(search, layout)
        if cap is None:
            return
        best, cuts = ms, nc
        search.add("per-bucket list", cap, layout)


def advise(trace: RunTrace, model: WhatIfModel | None = None, *, caps=DEFAULT_CAPS, lists=(),
           local_budget: int | None = None) -> Advice:
    """Search bucket layouts for ``trace`` (see the module) and recommend one.
    ``lists``: more ``bucket_cap_mb_list``s to try; ``local_budget``: layouts the local
    search may replay (0: none; default ``LOCAL_BUDGET``)."""
    model = model or fit_model(trace)
    local_budget = LOCAL_BUDGET if local_budget is None else local_budget
    search = LayoutSearch(trace, model)
    noise = gain_noise_ms(trace)
    advice = _advise(trace, search, noise, caps, lists, local_budget)
    if not search.rebuilds and not unused_parameters(trace):  # the flag looks for parameters that are never unused
        # the same steps searched again as DDP would bucket them with the flag off
        off = _advise(replace(trace, run={**trace.run, "find_unused_parameters": False}), search.rebuilding(), noise,
                      caps, lists, local_budget)
        advice = replace(advice, flag_off=FlagOff(flag="find_unused_parameters=False", setting=off.setting,
                                                  step_ms=off.step_ms, gain_ms=advice.traced_step_ms - off.step_ms,
                                                  buckets=off.buckets,
                                                  in_code=flag_in_code(trace.run, "find_unused_parameters", False)))
    return advice


def _advise(trace: RunTrace, search: LayoutSearch, noise: float, caps, lists, local_budget: int) -> Advice:
    """``advise``'s search and choice on ``search`` (its steps replayed), ``noise`` (ms)
    the run's own; no flag-off prediction."""
    model = search.model
    own = traced_cap(trace)
    search.add("traced", own)
    for c in caps:
        search.add("uniform", float(c))
    single_dtype = len(set(search.dtypes)) == 1
    note = None
    if not search.rebuilds:  # lists would be cut from the first registered parameter: not what they mean
        note = ("find_unused_parameters=True: DDP never rebuilds its buckets, so they stay in registration order "
                "(bucket 0 holds the last registered parameters) and a bucket_cap_mb_list is cut from the first "
                "registered one: only uniform caps are searched; without find_unused_parameters (or with "
                "static_graph=True) DDP would rebuild them in gradient-ready order")
    for c in [*growing_lists(), *[tuple(map(float, x)) for x in lists]] if search.rebuilds else []:
        search.add("growing list", c)
    # torch.compile'd: DDPOptimizer splits at the largest limit, not at a list's buckets (compiled.py)
    if single_dtype and local_budget > 0 and search.rebuilds and not search.compiled:
        top = min(search.rows, key=lambda r: r["step_ms"])
        _local_search(search, search.layout(top["setting"]), local_budget)
    table = pd.DataFrame(search.rows)
    table["setting"] = pd.Series([r["setting"] for r in search.rows], dtype=object)  # None (DDP's default) stays None
    table["label"] = [setting_text(c) for c in table["setting"]]
    # the search compared layouts on a few steps; every candidate's step is its replay on all
    # of them, the sweep's number for the same setting (one replay, one number)
    table["search_ms"] = table["step_ms"]
    table["step_ms"] = [search.full_ms(layout, cap) for layout, cap in zip(table.pop("layout"), table["setting"])]
    kinds = table["kind"].value_counts().to_dict()
    # no change, then a uniform cap, then the shortest list; then the fewest buckets
    table["simplicity"] = [(_KINDS[k], len(s) if is_cap_list(s) else 0, n)
                           for k, s, n in zip(table["kind"], table["setting"], table["buckets"])]
    table = table.drop_duplicates("label").sort_values(["step_ms", "simplicity"], kind="stable").reset_index(drop=True)
    table = mark_within_noise(table, noise)
    fastest = float(table["step_ms"].iloc[0])
    near = table[table["step_ms"] <= fastest * (1 + SIMPLER)]
    best = near.sort_values(["simplicity", "step_ms"], kind="stable").iloc[0]["setting"]

    pred_best = predict_run(trace, best, model)
    pred_own = predict_run(trace, own, model)
    mb, mo = _medians(pred_best), _medians(pred_own)
    gain = mo["step_ms"] - mb["step_ms"]
    floor = MIN_GAIN * mo["step_ms"]
    worth = lambda g: (g > noise or not math.isfinite(noise)) and g >= floor  # noqa: E731
    worst = None  # the steal not measured: the gain must hold at its other end too (all the compute overlapped lost)
    if model.steal_max_us_per_mib is not None and worth(gain):
        most = model.at_most_steal()
        worst = _medians(predict_run(trace, own, most))["step_ms"] - _medians(predict_run(trace, best, most))["step_ms"]
    more = len(pred_best.run["bucket_layout"]) - len(pred_own.run["bucket_layout"])
    unmeasured_fixed = worth(gain) and more > 0 and not model.cost.latency_fitted
    if unmeasured_fixed:
        # each all-reduce costs its bytes alone: a layout of more buckets is predicted too fast by
        # the fixed cost of each one added, which this trace cannot put a number on (one of fewer
        # buckets is predicted too slow: its gain stands)
        change, why = False, (f"no change is worth it until a fixed cost per all-reduce is measured: the best layout "
                              f"found, {setting_text(best)}, is predicted {gain:.1f} ms faster a step with {more} "
                              f"more all-reduce{'s' if more > 1 else ''} a step, each costing its bytes alone, and "
                              "this trace cannot say what each costs beyond its bytes (run `ddpscope calibrate`, "
                              "the What-if page's Calibrate, and ask again)")
    elif worst is not None and not worth(worst):
        change, why = False, (f"no change is worth it until communication's cost to backward is measured: the best "
                              f"layout found, {setting_text(best)}, is predicted {gain:.1f} ms faster a step if "
                              f"all-reduces take no compute from backward, {abs(worst):.1f} ms "
                              f"{'faster' if worst >= 0 else 'slower'} if they take all they overlap, and this trace "
                              "cannot tell which (run `ddpscope calibrate` and ask again)")
    elif worth(gain):
        change, why = True, (f"predicted {gain:.1f} ms faster a step, more than the noise (±{noise:.1f} ms)"
                             if math.isfinite(noise) else f"predicted {gain:.1f} ms faster a step (noise unknown: "
                             "too few steps)")
    else:
        change = False
        why = (f"no change is worth it: the best layout found is predicted {max(gain, 0.0):.1f} ms faster a step, "
               + (f"inside the noise (±{noise:.1f} ms)" if math.isfinite(noise) and gain <= noise else
                  f"under {100 * MIN_GAIN:.0f} % of the step"))
    if not change and not model.cost.latency_fitted and not unmeasured_fixed:
        # the other side of the same missing cost: fewer, larger buckets are predicted too slow
        why += ("; no fixed cost per all-reduce was measured, so layouts of fewer, larger buckets may be faster "
                "than predicted (run `ddpscope calibrate` and ask again)")
    chosen, m = (best, mb) if change else (own, mo)
    return Advice(setting=chosen, best=best, change=change, why=why, step_ms=m["step_ms"], exposed_ms=m["exposed_ms"],
                  buckets=len((pred_best if change else pred_own).run["bucket_layout"]), traced=own,
                  traced_step_ms=mo["step_ms"], measured_step_ms=_medians(trace)["step_ms"], gain_ms=gain,
                  noise_ms=noise, searched={k: int(kinds.get(k, 0)) for k in _KINDS if k != "traced"},
                  candidates=table.drop(columns="simplicity"), prediction=pred_best if change else pred_own,
                  note=note, gain_if_overlap_lost_ms=worst,
                  in_code=where_to_set(trace.run, chosen, table) if change else None)
