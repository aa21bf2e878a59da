"""Which ranks' events a trace holds: a trace opened from its summaries (``load_run(...,
events_for=...)``) given the events of more ranks as they are shown, or cut to the ranks
whose events it holds, for what needs every table of every rank (the what-if model)."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import pandas as pd

from ddpscope.tracer import format as fmt
from ddpscope.viz.parallel import map_on_cores
from ddpscope.viz.run_files import open_run_folder
from ddpscope.viz.trace import EVENT_TABLES, RunTrace, TraceError, join_tables, read_rank_tables


def with_events(trace: RunTrace, ranks: Iterable[int], missing_ok: bool = False) -> RunTrace:
    """``trace`` (read from summaries) with the events of ``ranks`` read too: its
    buckets, gradients and passes then hold those ranks as well (on every core when
    several big files are read); steps and memory are unchanged (a step folded from the
    events is the row its summary holds). A rank whose events are not in the folder
    (only its summary) is a ``TraceError``, or, with ``missing_ok``, left out."""
    if trace.event_ranks is None:
        return trace
    have = set(trace.event_ranks)
    new = sorted({int(r) for r in ranks} - have)
    if not new:
        return trace
    folder = open_run_folder(trace.path, (fmt.KIND_DDP, fmt.KIND_SHARDED), allow_missing_ranks=True, summaries=True)
    absent = [r for r in new if r not in folder.rank_files]
    if missing_ok:
        new, absent = [r for r in new if r not in absent], []
        if not new:
            return trace
    if absent:
        raise TraceError(f"{trace.path.name}: the events of rank {', '.join(map(str, absent))} are not in the folder "
                         "(only their summaries): copy their rank-<r>.json beside them to see them")
    parsed = map_on_cores(read_rank_tables, [(r, folder.rank_files[r]) for r in new],
                          [folder.rank_files[r].stat().st_size for r in new])

    tables = {name: join_tables([getattr(trace, name), *(getattr(t, name) for t in parsed)], name)
              for name in EVENT_TABLES}
    return dataclasses.replace(trace, **tables, event_ranks=tuple(sorted(have | set(new))), cache={})


def select_ranks(trace: RunTrace, ranks: Iterable[int]) -> RunTrace:
    """``trace`` with only ``ranks`` in its ranks and tables (the run, world size
    included, unchanged): what a model that needs every table of every rank reads."""
    keep = {int(r) for r in ranks}

    def of(df: pd.DataFrame) -> pd.DataFrame:
        return df[df["rank"].isin(keep)].reset_index(drop=True) if "rank" in df else df

    return dataclasses.replace(
        trace, ranks={r: m for r, m in trace.ranks.items() if r in keep}, steps=of(trace.steps),
        buckets=of(trace.buckets), grads=of(trace.grads), passes=of(trace.passes), memory=of(trace.memory),
        event_ranks=None if trace.event_ranks is None else tuple(r for r in trace.event_ranks if r in keep), cache={})
