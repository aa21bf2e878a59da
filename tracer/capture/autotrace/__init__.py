"""Zero-code capture: trace every rank of an unmodified training script.

``ddpscope run -- train.py`` starts the script's ranks with ``bootstrap/`` on
``PYTHONPATH`` and a ``CaptureConfig`` in ``$DDPSCOPE_CAPTURE``. The bootstrap's
``sitecustomize`` calls ``install_from_env()``, which waits for torch's DDP module to be
imported (no torch import of its own) and then patches, in place:

- ``DistributedDataParallel.__init__``: the arguments are bound to DDP's real
  signature, ``bucket_cap_mb`` is overridden when asked, and once DDP is built the
  model is traced (``DDPTracer`` with ``optimizer="auto"``). The class itself stays
  the same object, so frameworks that import it by name and check ``isinstance``
  (Lightning, Accelerate) build and see the traced model;
- ``torch.distributed.destroy_process_group``: the trace is finished while the process
  group still works (its end clock offsets are a collective);
- FSDP2's ``FSDPState._lazy_init``: when a root is initialised (its first forward),
  the FSDP2 model is traced per unit (``sharded/fsdp_tracer.py``), after the rerun's
  sharding settings are applied; FSDP1's constructor: said to be untraced.

The user's training comes first: whatever goes wrong in here is said in one line on
stderr (rank 0) and in ``run.json`` (``notes``), and the script goes on, untraced.
With ``steps``, the job ends cleanly after that many traced optimizer steps: the
trace is closed (complete), then ``SystemExit(0)`` unwinds the script; a timer ends
the process after ``exit_grace_s`` should the script swallow it or hang in teardown.

The room: ``config.py`` (what a rank is asked to trace), ``install.py`` (the bootstrap's
entry, the excepthook, the stack dump), ``patches.py`` (DDP, destroy_process_group,
FSDP1, FSDP2), ``session.py`` (this process's capture), ``step_limit.py`` (``--steps``),
``after_import.py`` (patching a module once it is imported), ``zygote.py`` (the warm rank
factory) and ``bootstrap/`` (the ``sitecustomize`` on the ranks' path).
"""
