"""Memory a DeepSpeed rank holds, by category, at a point of the step (bytes), read from
ZeRO's own partitions (docs/deepspeed-design.md, §6), each storage counted once (the
first category that names it keeps it), in the sharded trace's categories:

- sharded parameters: the fp32 master partition (stages 1-2
  ``single_partition_of_fp32_groups``; stage 3 ``fp32_partitioned_groups_flat``) and, at
  stage 3, the model-dtype partitions (``fp16_partitioned_groups_flat``, also fp32 in
  fp32 training);
- unsharded parameters: stages 1-2 the whole model-dtype parameters
  (``bit16_groups_flat``, which every parameter is a view of); stage 3 the parameters
  gathered now (a partitioned one's data is empty);
- sharded gradients: stage 2's ``grads_in_partition``, stage 3's
  ``grad_partitions_flat_buffer``, the averaged gradients kept for the step and the
  master partition's gradient during it;
- unsharded gradients: whole gradients on the model's parameters (stage 1 keeps them
  to the step; 2 and 3 until their bucket is reduced);
- optimizer state: the wrapped optimizer's state tensors (Adam's two moments);
- communication buffers: the gradient buckets (``ipg_buckets``);
- activations: tensors autograd saved in the measured forwards (``SavedActivations``).
"""

from __future__ import annotations

from typing import Any

import torch

from ddpscope.tracer.capture.memory import _OptimizerStateBytes
from ddpscope.tracer.capture.sharded.memory import SavedActivations


def _tensors(value: Any):
    """The tensors in a tensor, a list/tuple of them, or a dict's values (nested once)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class DeepSpeedMemory:
    """``meter()`` -> bytes by category now (see the module's docstring)."""

    def __init__(self, optimizer, params: list[torch.nn.Parameter], stage: int) -> None:
        self.opt = optimizer
        self.params = params
        self.stage = stage
        self.activations = SavedActivations()
        self._state = _OptimizerStateBytes()

    def __call__(self) -> dict[str, int]:
        opt, seen = self.opt, set()

        def count(*values) -> int:
            total = 0
            for t in (t for v in values for t in _tensors(v)):
                st = t.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
                if n and ptr not in seen:
                    seen.add(ptr)
                    total += n
            return total

        buckets = [b.buffer for b in (getattr(opt, "ipg_buckets", None) or {}).values() if b is not None]
        if self.stage == 3:
            sharded = count(getattr(opt, "fp32_partitioned_groups_flat", None),
                            getattr(opt, "fp16_partitioned_groups_flat", None))
            # a partitioned parameter's data is empty: what has data now is gathered (or persistent)
            unsharded = count([p.data for p in self.params if p.data.numel()])
            sharded_grads = count(getattr(opt, "grad_partitions_flat_buffer", None),
                                  getattr(opt, "averaged_gradients", None),
                                  [t.grad for t in _tensors(getattr(opt, "fp32_partitioned_groups_flat", None))])
        else:
            sharded = count(getattr(opt, "single_partition_of_fp32_groups", None))
            unsharded = count(getattr(opt, "bit16_groups_flat", None))
            sharded_grads = count(getattr(opt, "grads_in_partition", None), getattr(opt, "averaged_gradients", None),
                                  [t.grad for t in _tensors(getattr(opt, "single_partition_of_fp32_groups", None))])
        out = {
            "sharded_params_bytes": sharded,
            "unsharded_params_bytes": unsharded,
            "sharded_grads_bytes": sharded_grads,
            "unsharded_grads_bytes": count([p.grad for p in self.params]),
            "optimizer_state_bytes": self._state(getattr(opt, "optimizer", None)),
            "activations_bytes": max(0, self.activations.bytes),
            "comm_buffers_bytes": count(buckets),
        }
        return out
