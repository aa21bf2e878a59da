"""ddpscope's analysis side: trace model, metrics and Plotly figures (pure functions).

At the top: the trace model (``trace.py``) and what reads a run folder's files
(``run_files.py``, ``parallel.py``), the lanes every timeline draws (``lanes.py``),
interval arithmetic (``intervals.py``) and the Perfetto export (``perfetto.py``). The
rooms: ``sources/`` (what a folder holds: rank events, profiler traces, archives,
merges), ``ddp/``, ``sharded/``, ``ring/``, ``zero/`` and ``whatif/``.
"""

from ddpscope.tracer.moved import alias_moved

# the modules' paths before the rooms (0.2), kept for this release (``viz.ring``, now the room,
# still gives what ``viz/ring.py`` held: see ring/__init__.py)
alias_moved("ddpscope.viz", {
    "archive": "sources.archive", "merge": "sources.merge", "rank_events": "sources.rank_events",
    "buckets": "ddp.buckets", "ddp_stages": "ddp.stages", "gantt": "ddp.gantt", "kernel_gantt": "ddp.kernel_gantt",
    "kernel_overlap": "ddp.kernel_overlap", "overlap": "ddp.overlap", "profile_check": "ddp.profile_check",
    "stragglers": "ddp.stragglers", "rank_overview": "ddp.rank_overview",
    "ring_anim": "ring.animation", "ring_cost": "ring.cost", "ring_trace": "ring.trace",
    "zero_model": "zero.model", "zero_trace": "zero.trace", "zero_figures": "zero.figures",
    "sharded_trace": "sharded.trace", "sharded_metrics": "sharded.metrics", "sharded_predict": "sharded.predict",
    "sharded_figures": "sharded.figures",
})
