"""DDP's analysis: overlap of each bucket's all-reduce with backward, the buckets, the
Gantt (and its profiler-kernel variant), stragglers, every rank at once, ZeRO-1 on DDP,
and the tracer checked against torch.profiler."""
