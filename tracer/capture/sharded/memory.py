"""Memory a sharded rank holds, by category, at a point of the step (bytes).

From the tensors themselves, as FSDP2 keeps them:

- sharded parameters: every unit's padded local shards (they never change size);
- unsharded parameters: the all-gather outputs whose storage is allocated now (FSDP frees
  a unit's by resizing its storage to 0 when it reshards), and a unit's all-gathered
  buffer not yet copied out (a prefetched unit's, until its own forward or backward);
  ``unsharded_by_unit`` splits them by unit: ``[[unit, bytes], ...]`` for the units that
  hold any (the what-if replays each unit's own, and keeps as measured a unit the script
  gathered or kept itself: torchtitan's chunked loss ``unshard()``s its lm_head and keeps it
  gathered through its chunks' backwards, whatever the unit's ``reshard_after_forward``);
- sharded gradients: the local shards' ``.grad``; unsharded gradients: a unit's
  full-size gradients between its backward and its reduce-scatter (and those kept
  for accumulation without reduction);
- optimizer state: the optimizer's state tensors (counted again only when its shape
  changes, as for DDP);
- activations: tensors autograd saved for backward during the step's forwards, counted
  by a saved-tensor pack hook on measured steps only (``SavedActivations``); parameters
  saved by their layers are the unsharded parameters' bytes, not counted twice;
- communication buffers: the last forward all-gather's buffer FSDP keeps until the
  next copy-out (``comm_ctx.all_gather_state``), and the reduce-scatter inputs it holds
  (``comm_ctx.reduce_scatter_states``);
- other: on CUDA the caching allocator's ``memory_allocated`` beyond all of the above
  (temporaries, gradients of activations, communication buffers); absent on CPU, which
  has no allocator counter.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from ddpscope.tracer.capture.memory import _OptimizerStateBytes, allocator_counters, local_tensor
from ddpscope.tracer.capture.sharded.units import Unit


def _storage_bytes(t: torch.Tensor | None) -> tuple[int, int]:
    if t is None:
        return 0, 0
    st = local_tensor(t).untyped_storage()
    return st.data_ptr(), st.nbytes()


class SavedActivations:
    """Bytes of tensors saved for backward that are alive now, counted per storage.

    ``start()`` pushes a pack hook for one forward, ``stop()`` pops it (the root's forward
    hooks call both, on measured steps). The hook hands autograd a detached alias of the
    tensor (no copy: the same storage and version counter, which is what
    ``save_on_cpu``'s hooks give back too, without its copy), and a finalizer on that alias
    takes its bytes off when autograd releases it after its backward."""

    def __init__(self) -> None:
        self.bytes = 0
        self._live: dict[int, list[int]] = {}  # storage ptr -> [bytes, saved tensors on it]
        self._hooks = None

    def start(self) -> bool:
        if self._hooks is not None or not torch._C._autograd._saved_tensors_hooks_is_enabled():
            return False  # some code disabled saved-tensor hooks here: activations are not measured
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._hooks = hooks
        return True

    def stop(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or t.device.type == "meta":
            return t  # a parameter (counted as one), never a cycle through a grad_fn
        alias = t.detach()
        ptr, n = _storage_bytes(alias)
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [n, 1]
            self.bytes += n
        else:
            entry[1] += 1
        weakref.finalize(alias, self._release, ptr)
        return alias

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self.bytes -= entry[0]
                del self._live[ptr]


def _unpack(t):
    return t


class ShardedMemory:
    """``meter()`` -> bytes by category now (see the module's docstring)."""

    def __init__(self, units: list[Unit], device: torch.device, optimizer: Callable[[], object]) -> None:
        self.params = [(p, u.index) for u in units for p in u.group.fsdp_params]
        self.groups = [(u.group, u.index) for u in units]
        self.sharded_params_bytes = sum(u.sharded_bytes for u in units)
        self.device = device
        self.optimizer = optimizer
        self.activations = SavedActivations()
        self._state = _OptimizerStateBytes()

    def __call__(self) -> dict[str, int]:
        # Called at every unit boundary of a measured step (~50 parameters x 4 tensors a
        # call): the storage reads inlined, a DTensor's local shard read directly.
        unsharded, sharded_grads, unsharded_grads = {}, {}, {}  # storage -> bytes (unsharded: (bytes, unit))
        for p, unit in self.params:
            for t in p.all_gather_outputs:
                st = t.untyped_storage()
                n = st.nbytes()
                if n:
                    unsharded[st.data_ptr()] = (n, unit)
            # reshard_after_forward=N keeps 1/N of the gathered parameter from forward to
            # backward, a clone outside all_gather_outputs (FSDPParam.to_sharded_post_forward)
            post = getattr(p, "_sharded_post_forward_param_data", None)
            if post is not None:
                st = post.untyped_storage()
                n = st.nbytes()
                if n:
                    unsharded[st.data_ptr()] = (n, unit)
            g = p.sharded_param.grad
            if g is not None:
                st = getattr(g, "_local_tensor", g).untyped_storage()
                n = st.nbytes()
                if n:
                    sharded_grads[st.data_ptr()] = n
            full = getattr(p, "_unsharded_param", None)
            for g in (None if full is None else full.grad, getattr(p, "unsharded_accumulated_grad", None)):
                if g is not None:
                    st = getattr(g, "_local_tensor", g).untyped_storage()
                    n = st.nbytes()
                    if n:
                        unsharded_grads[st.data_ptr()] = n
        for g, unit in self.groups:  # gathered, waiting for its copy-out (prefetched)
            result = g._all_gather_result
            if result is not None:
                ptr, n = _storage_bytes(result.all_gather_output)
                unsharded[ptr] = (n, unit)
        by_unit: dict[int, int] = {}
        for n, unit in unsharded.values():
            by_unit[unit] = by_unit.get(unit, 0) + n
        comm = {}
        ctx = getattr(self.groups[0][0], "comm_ctx", None) if self.groups else None
        held = getattr(ctx, "all_gather_state", None)
        if held is not None:
            ptr, n = _storage_bytes(held.all_gather_result.all_gather_output)
            if ptr not in unsharded:
                comm[ptr] = n
        for state in getattr(ctx, "reduce_scatter_states", None) or []:
            ptr, n = _storage_bytes(getattr(state, "reduce_scatter_input", None))
            if n:
                comm[ptr] = n
        out = {
            "sharded_params_bytes": self.sharded_params_bytes,
            "unsharded_params_bytes": sum(by_unit.values()),
            "sharded_grads_bytes": sum(sharded_grads.values()),
            "unsharded_grads_bytes": sum(unsharded_grads.values()),
            "optimizer_state_bytes": self._state(self.optimizer()),
            "activations_bytes": max(0, self.activations.bytes),
            "comm_buffers_bytes": sum(comm.values()),
        }
        if self.device.type == "cuda":
            # Allocator statistics are host-side counters: no CPU-GPU sync.
            allocated = allocator_counters(self.device)["allocated_bytes"]
            out["other_bytes"] = max(0, allocated - sum(out.values()))
        out["unsharded_by_unit"] = [[unit, n] for unit, n in sorted(by_unit.items())]  # not a category: no total
        return out
