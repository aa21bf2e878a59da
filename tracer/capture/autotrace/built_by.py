"""Who built a traced model: the framework on the stack (torchtitan, the Hugging Face
Trainer, Lightning, Fabric, Accelerate, or the script itself) and the innermost line outside
torch and ddpscope, when ``DistributedDataParallel`` was constructed (run.json's
``ddp_built_by``) or an FSDP2 root ran its first forward (``fsdp_trained_by``, the framework
only: that line is a forward, not where ``fully_shard`` was called). So a recommended
setting can be said where the user sets it (``TrainingArguments(ddp_bucket_cap_mb=...)``,
``DDPStrategy(bucket_cap_mb=...)``, the script's own ``DistributedDataParallel(...)`` call,
torchtitan's ``--parallelism.fsdp_reshard_after_forward``).

Read from the frames alone: nothing is imported, nothing called."""

from __future__ import annotations

import sys

# module-name prefixes of each framework, the first found on the stack (outermost first in
# this order) naming it: the Trainer builds DDP through Accelerate, so Accelerate comes last
FRAMEWORKS = (
    ("torchtitan", ("torchtitan.",)),
    ("transformers", ("transformers.",)),
    ("lightning", ("lightning.pytorch.", "pytorch_lightning.")),
    ("fabric", ("lightning.fabric.", "lightning_fabric.")),
    ("accelerate", ("accelerate.",)),
)
_OURS = ("torch.", "ddpscope.")  # and ``torch`` itself
_DEPTH = 80  # frames read at most: a DDP is built a few dozen frames below the script


def built_by(depth: int = 1) -> dict | None:
    """``{"framework", "module", "file", "line", "function"}`` for the model being built now:
    ``framework`` one of ``FRAMEWORKS``' names or ``"script"``; the rest the innermost
    frame outside torch and ddpscope, counted from ``depth`` frames above this call (the
    caller of ``DistributedDataParallel.__init__``, of FSDP2's lazy init). None where the
    stack cannot be read."""
    try:  # called inside the script's DistributedDataParallel(...): never its error
        frame = sys._getframe(depth + 1)
        site, modules = None, []
        for _ in range(_DEPTH):
            if frame is None:
                break
            name = str(frame.f_globals.get("__name__", ""))
            modules.append(name)
            if site is None and name != "torch" and not name.startswith(_OURS):
                site = {"module": name, "file": str(frame.f_code.co_filename), "line": int(frame.f_lineno or 0),
                        "function": str(frame.f_code.co_name)}
            frame = frame.f_back
    except Exception:  # noqa: BLE001 - an odd frame (a C extension's globals): nothing said, training goes on
        return None
    if site is None:
        return None
    framework = next((fw for fw, prefixes in FRAMEWORKS if any(m.startswith(prefixes) for m in modules)), "script")
    return {"framework": framework, **site}
