"""ddpscope's capture side: trace a real DistributedDataParallel run, bucket by bucket.

``from ddpscope.tracer import DDPTracer, TracerConfig`` (torch is imported on first use, so
that readers of ``tracer.format`` stay light).
"""

__all__ = ["DDPTracer", "TracerConfig"]


def __getattr__(name):
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("ddpscope.tracer.capture.ddp.tracer"), name)
    raise AttributeError(name)
