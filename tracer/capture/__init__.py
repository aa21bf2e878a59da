"""What runs inside a rank: the shared pieces at the top (clocks, cross-rank offsets,
memory, the rank's trace file and live file, the hook guard, ``--profile``, the tracer
config) and one room per kind of training: ``ddp/`` (``DDPTracer``), ``sharded/``
(FSDP2), with ``autotrace/`` (zero-code capture) and ``native/`` (the compiled capture)."""

from ddpscope.tracer.moved import alias_moved

alias_moved("ddpscope.tracer.capture", {"tracer": "ddp.tracer"})  # 0.2's path of DDPTracer, kept for this release
