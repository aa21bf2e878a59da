"""Memory a DeepSpeed rank holds, by category, at a point of the step (bytes), read from
ZeRO's own partitions (docs/deepspeed-design.md, §6), each storage counted once (the
first category that names it keeps it), in the sharded trace's categories:

- sharded parameters: the fp32 master partition (stages 1-2
  ``single_partition_of_fp32_groups``; stage 3 ``fp32_partitioned_groups_flat``) and, at
  stage 3, the model-dtype partitions (``fp16_partitioned_groups_flat``, also fp32 in
  fp32 training) and those of the frozen parameters (``requires_grad=False``, in no
  optimizer group: each its own ``ds_tensor``);
- unsharded parameters: stages 1-2 the whole model-dtype parameters
  (``bit16_groups_flat``, which every trained parameter is a view of, and the frozen
  parameters, left whole on the module); stage 3 the parameters gathered now (a
  partitioned one's data is empty);
- sharded gradients: stage 2's ``grads_in_partition``, stage 3's
  ``grad_partitions_flat_buffer``, the averaged gradients kept for the step and the
  master partition's gradient during it;
- unsharded gradients: whole gradients on the model's parameters (stage 1 keeps them
  to the step; 2 and 3 until their bucket is reduced);
- optimizer state: the wrapped optimizer's state tensors (Adam's two moments);
- communication buffers: the gradient buckets (``ipg_buckets``);
- activations: tensors autograd saved in the measured forwards (``SavedActivations``).

With offload (``offload_optimizer`` / ``offload_param`` to ``cpu``) the categories hold
the device's bytes only, and ``offloaded`` ({category: bytes}) what DeepSpeed keeps of
each in host memory: on a GPU, every storage counted that lives on the CPU; on the CPU
accelerator (where both are the same memory) what DeepSpeed puts at its offload device
(``_host_tensors``). Offload's own host storages are counted there too: stages 1-2's
model-dtype staging copy of the partition (``param_buffer_of_bit16_for_cpu_offload_groups``,
a sharded parameter) and gradient staging (``temp_grad_buffer_for_cpu_offload``,
``accumulated_grads_in_cpu``: sharded gradients; its device twin,
``temp_grad_buffer_for_gpu_offload``, stays on the device).
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

    def __init__(self, optimizer, params: list[torch.nn.Parameter], stage: int, *, offload: bool = False) -> None:
        self.opt = optimizer
        self.params = params
        self.stage = stage
        self.offload = offload
        # on a GPU a storage on the CPU is host memory; on the CPU accelerator DeepSpeed's roles say
        self.on_cpu = not params or params[0].device.type == "cpu"
        self.frozen = [p for p in params if not p.requires_grad]  # held, in no optimizer group
        self.activations = SavedActivations()
        self._state = _OptimizerStateBytes()

    def _host_tensors(self) -> list:
        """What DeepSpeed keeps at its offload device (0.19.8): stages 1-2 with
        ``cpu_offload`` the fp32 master partition and its gradient, the model-dtype staging
        copy, the gradient staging buffers; stage 3 the fp32 partitions (of the subgroups
        ``subgroup_to_device`` puts on the CPU) and their gradients, the gradient partitions'
        flat buffer, and with ``offload_param`` the model-dtype partitions."""
        opt = self.opt
        if self.stage < 3:
            if not getattr(opt, "cpu_offload", False):
                return []
            master = list(_tensors(getattr(opt, "single_partition_of_fp32_groups", None)))
            return [*master, *(t.grad for t in master if t.grad is not None),
                    getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None),
                    getattr(opt, "temp_grad_buffer_for_cpu_offload", None),
                    getattr(opt, "accumulated_grads_in_cpu", None)]
        out = []
        if getattr(opt, "offload_optimizer", False):
            where = getattr(opt, "subgroup_to_device", None) or {}
            fp32 = list(_tensors(getattr(opt, "fp32_partitioned_groups_flat", None)))
            fp32 = [t for i, t in enumerate(fp32) if where.get(i, "cpu") == "cpu"]
            out += [*fp32, *(t.grad for t in fp32 if t.grad is not None),
                    getattr(opt, "grad_partitions_flat_buffer", None)]
        if getattr(opt, "offload_param", False):
            out += [getattr(opt, "fp16_partitioned_groups_flat", None),
                    [p.ds_tensor for p in self.params if getattr(p, "ds_tensor", None) is not None]]
        return out

    def __call__(self) -> dict[str, int]:
        opt, seen = self.opt, set()
        host = set()  # storages in host memory (offload)
        if self.offload and self.on_cpu:
            host = {t.untyped_storage().data_ptr() for t in _tensors(self._host_tensors())}
        offloaded: dict[str, int] = {}

        def count(*values, cat: str = "") -> int:
            total = 0
            for t in (t for v in values for t in _tensors(v)):
                st = t.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
                if n and ptr not in seen:
                    seen.add(ptr)
                    if self.offload and (ptr in host if self.on_cpu else t.device.type == "cpu"):
                        offloaded[cat] = offloaded.get(cat, 0) + n
                    else:
                        total += n
            return total

        buckets = [b.buffer for b in (getattr(opt, "ipg_buckets", None) or {}).values() if b is not None]
        if self.stage == 3:
            sharded = count(getattr(opt, "fp32_partitioned_groups_flat", None),
                            getattr(opt, "fp16_partitioned_groups_flat", None),
                            [p.ds_tensor for p in self.frozen if getattr(p, "ds_tensor", None) is not None],
                            cat="sharded_params_bytes")
            # a partitioned parameter's data is empty: what has data now is gathered (or persistent)
            unsharded = count([p.data for p in self.params if p.data.numel()], cat="unsharded_params_bytes")
            sharded_grads = count(getattr(opt, "grad_partitions_flat_buffer", None),
                                  getattr(opt, "averaged_gradients", None),
                                  [t.grad for t in _tensors(getattr(opt, "fp32_partitioned_groups_flat", None))],
                                  cat="sharded_grads_bytes")
        else:
            sharded = count(getattr(opt, "single_partition_of_fp32_groups", None),
                            getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None),
                            cat="sharded_params_bytes")
            unsharded = count(getattr(opt, "bit16_groups_flat", None), [p.data for p in self.frozen],
                              cat="unsharded_params_bytes")
            sharded_grads = count(getattr(opt, "grads_in_partition", None), getattr(opt, "averaged_gradients", None),
                                  [t.grad for t in _tensors(getattr(opt, "single_partition_of_fp32_groups", None))],
                                  getattr(opt, "temp_grad_buffer_for_cpu_offload", None),
                                  getattr(opt, "temp_grad_buffer_for_gpu_offload", None),
                                  getattr(opt, "accumulated_grads_in_cpu", None), cat="sharded_grads_bytes")
        state = self._state(getattr(opt, "optimizer", None))
        out = {
            "sharded_params_bytes": sharded,
            "unsharded_params_bytes": unsharded,
            "sharded_grads_bytes": sharded_grads,
            "unsharded_grads_bytes": count([p.grad for p in self.params], cat="unsharded_grads_bytes"),
            "optimizer_state_bytes": state,
            "activations_bytes": max(0, self.activations.bytes),
            "comm_buffers_bytes": count(buckets, cat="comm_buffers_bytes"),
        }
        if self.offload:
            host_state = self._host_state(getattr(opt, "optimizer", None), host)
            out["optimizer_state_bytes"] = state - host_state
            if host_state:
                offloaded["optimizer_state_bytes"] = host_state
            out["offloaded"] = offloaded
        return out

    def _host_state(self, inner, host: set) -> int:
        """Bytes of the optimizer state kept in host memory: the state of a parameter (an
        fp32 partition) that is itself there."""
        if inner is None or not isinstance(getattr(inner, "state", None), dict):
            return 0
        regions = set()
        for param, state in inner.state.items():
            where = param.untyped_storage().data_ptr() in host if self.on_cpu else param.device.type == "cpu"
            if where:
                regions |= {(t.data_ptr(), t.nbytes) for t in _tensors(state) if t.nbytes}  # as distinct_bytes
        return sum(n for _, n in regions)
