"""The advisor's candidates, replayed: each bucket layout simulated on a few of the trace's
steps to compare them, and on every step for the number the advisor reports; a layout is
simulated once per (layout, steps).

A ``torch.compile``'d model (``compiled.py``) also moves when its gradients are ready with
the cap (DDPOptimizer splits its graph at ``bucket_bytes_cap``): its steps are rewritten
for each candidate's cap before they are replayed, and a layout is then known by its cap
too. A candidate the model cannot be given (``layout.runnable``: a compiled model takes no
cap under 1 MiB) is not replayed.
"""

from __future__ import annotations

import math

import numpy as np

from ddpscope.viz.trace import RunTrace, TraceError
from ddpscope.viz.whatif.compiled import at_cap
from ddpscope.viz.whatif.layout import (
    Cap,
    assign_buckets,
    bucket_limits,
    cap_bytes,
    first_layout,
    rebuilds,
    runnable,
    smallest_cap_bytes,
)
from ddpscope.viz.whatif.model import WhatIfModel, step_inputs
from ddpscope.viz.whatif.simulate import ready_order, simulate_step

#: steps replayed per candidate while searching (evenly spaced); the winners replay all
SEARCH_STEPS = 8


class LayoutSearch:
    """Candidates replayed on a few steps; layouts remembered so none is simulated twice.
    ``rows``: one per candidate added (kind, setting, buckets, step_ms, layout)."""

    def __init__(self, trace: RunTrace, model: WhatIfModel) -> None:
        run = self.run = trace.run
        self.sizes = [int(b) for b in run["param_bytes"]]
        self.dtypes = run.get("param_dtypes") or ["float32"] * len(self.sizes)
        self.order = ready_order(trace)
        self.rebuilds = rebuilds(run)  # False: DDP keeps its first layout, in registration order
        self.compiled = smallest_cap_bytes(run) > 0  # torch.compile's DDPOptimizer: the cap moves ready times
        self.model = model
        inputs = step_inputs(trace, model)
        if not inputs:
            raise TraceError(f"{trace.path.name}: no step to replay")
        pick = np.unique(np.linspace(0, len(inputs) - 1, min(SEARCH_STEPS, len(inputs))).round().astype(int))
        self.inputs = [inputs[i] for i in pick]  # what the search compares layouts on
        self.all_inputs = inputs  # what a candidate's step is: every step, as the sweep's table
        m = trace.steps.set_index(["rank", "step"])
        self.measured = {k: (float(row["end_us"] - row["start_us"]), float(row.get("sync_end_us", np.nan)))
                         for k, row in m.iterrows()}
        self.seen: dict[tuple, float] = {}
        self.full: dict[tuple, float] = {}
        self.rows: list[dict] = []
        self._at_cap: dict[tuple, list] = {}  # (which steps, graph cap bytes) -> steps rewritten (compiled)

    def rebuilding(self) -> "LayoutSearch":
        """A fresh search of the same steps (inputs, model, measured times) as if DDP
        rebuilt its buckets in gradient-ready order (``find_unused_parameters=False``)."""
        other = object.__new__(LayoutSearch)
        other.__dict__.update(self.__dict__, rebuilds=True, seen={}, full={}, rows=[])
        return other

    def layout(self, cap: Cap) -> list[list[int]]:
        if not self.rebuilds:
            return first_layout(self.sizes, self.dtypes, bucket_limits(cap))
        return assign_buckets(self.sizes, self.dtypes, self.order, bucket_limits(cap))

    def _key(self, layout: list[list[int]], cap: Cap) -> tuple:
        key = tuple(map(tuple, layout))
        return (key, cap_bytes(cap)) if self.compiled else key

    def step_ms(self, layout: list[list[int]], cap: Cap = None) -> float:
        """The median step (ms) of ``layout`` replayed on the search's steps (``cap``: the
        setting that builds it, which a compiled model's ready times depend on)."""
        key = self._key(layout, cap)
        if key not in self.seen:
            self.seen[key] = self._replay(layout, self._steps(False, cap))
        return self.seen[key]

    def full_ms(self, layout: list[list[int]], cap: Cap = None) -> float:
        """The median step (ms) of ``layout`` replayed on every step: the number the sweep's
        table (``predict_run``, then ``compute_waited_steps``) gives the same layout."""
        key = self._key(layout, cap)
        if key not in self.full:
            self.full[key] = self._replay(layout, self._steps(True, cap))
        return self.full[key]

    def _steps(self, every: bool, cap: Cap) -> list:
        steps = self.all_inputs if every else self.inputs
        if not self.compiled:
            return steps
        key = (every, cap_bytes(cap))
        if key not in self._at_cap:
            self._at_cap[key] = at_cap(steps, self.run, cap)
        return self._at_cap[key]

    def _replay(self, layout: list[list[int]], inputs: list) -> float:
        """The median over steps of the step's mean over ranks (ms), as ``compute_waited_steps``."""
        nbytes = [float(sum(self.sizes[p] for p in b)) for b in layout]
        vals = []
        for inp in inputs:
            sim = simulate_step(inp, layout, nbytes, self.model)
            per_rank = []
            for r, res in sim["ranks"].items():
                step_us, sync_end = self.measured[(r, inp.step)]
                # as predict_run: the step moves by what its sync end moves
                per_rank.append(step_us + (res["sync_end"] - sync_end if math.isfinite(sync_end) else 0.0))
            vals.append(sum(per_rank) / len(per_rank))
        return float(np.median(vals)) / 1e3

    def add(self, kind: str, cap: Cap, layout: list[list[int]] | None = None) -> float:
        """Replay the candidate ``cap`` (its ``layout`` when known) and keep it as a row;
        one the model cannot be given is not kept (inf)."""
        if kind != "traced" and not runnable(self.run, cap):  # torch.compile'd: no cap under 1 MiB
            return math.inf
        layout = layout if layout is not None else self.layout(cap)
        ms = self.step_ms(layout, cap)
        self.rows.append({"kind": kind, "setting": cap, "buckets": len(layout), "step_ms": ms, "layout": layout})
        return ms
