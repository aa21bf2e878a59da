"""The ring all-reduce: its trace, metrics and chunk states, the animation, and the
alpha-beta cost model fitted to it."""


def __getattr__(name: str):
    """``from ddpscope.viz.ring import compute_ring_summary``: what ``viz/ring.py`` held
    before the rooms (0.2), now ``viz.ring.metrics``; kept for this release."""
    import importlib

    metrics = importlib.import_module("ddpscope.viz.ring.metrics")
    if name.startswith("__") or not hasattr(metrics, name):
        raise AttributeError(f"module 'ddpscope.viz.ring' has no attribute {name!r}")
    return getattr(metrics, name)
