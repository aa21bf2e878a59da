"""DeepSpeed's ZeRO engine (stages 1-3), beside DDP's and FSDP2's rooms: recognising the
engine a script builds with ``deepspeed.initialize`` (``engine_facts``), the settings a
rerun changes before it is built (``config_override``), and the patches that see it
(``patches``). Nothing here imports DeepSpeed: its modules are patched as the script
imports them (see docs/deepspeed-design.md for where DeepSpeed communicates)."""
