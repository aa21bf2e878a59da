"""What torchtitan 0.3 needs to train on this CPU-only machine, for the tests alone (never
in ddpscope): torchtitan assumes an accelerator and a newer torch. Each shim replaces
one thing right after its module is imported; none touches what ddpscope traces (FSDP2's
own fully_shard, its collectives, autograd).

- Triton: the modules of torchtitan's Triton kernels (never run on CPU) are stubs.
- The device: ``torchtitan.tools.utils``' device type and module are the CPU's.
- FlexAttention has no backward on CPU: its compiled call is dense SDPA with the block
  mask made dense (the same attention, another kernel).
- Gloo has no ``PREMUL_SUM``: torchtitan's divide factor of 1.0 becomes FSDP2's plain
  SUM (``set_force_sum_reduction_for_comms``, then a post-divide by 1.0).
- torch 2.13 has no ``torch.distributed.set_timeout``: the timeouts stay as initialised.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

_STUBS = {"torchtitan.distributed.minimal_async_ep.kernels", "torchtitan.overrides.fused_mla",
          "torchtitan.overrides.fused_swiglu"}


class _Stub(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name}: a Triton kernel, stubbed on CPU")
        return unavailable


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in _STUBS else None

    def create_module(self, spec):
        return _Stub(spec.name)

    def exec_module(self, module):
        pass


class _After(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after the module ``name`` is imported."""

    def __init__(self, name: str, patch) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if isinstance(finder, (_After, _Stubs)):
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                run, patch = spec.loader.exec_module, self.patch

                def exec_module(module):
                    run(module)
                    patch(module)
                spec.loader.exec_module = exec_module
                return spec
        return None


class _CpuDevice(types.ModuleType):
    """``torch.cpu`` with what torchtitan asks of a device module."""

    @staticmethod
    def current_device() -> int:
        return 0  # torchtitan passes it to a barrier as a device index

    def __getattr__(self, name):
        import torch

        if hasattr(torch.cpu, name):
            return getattr(torch.cpu, name)
        return {"get_device_name": lambda *a: "cpu", "device_count": lambda: 1,
                "get_device_properties": lambda *a: types.SimpleNamespace(total_memory=1 << 34, name="cpu"),
                "memory_stats": lambda *a: {}, "reset_peak_memory_stats": lambda *a: None,
                "empty_cache": lambda: None, "set_device": lambda *a: None}[name]


def _cpu(utils) -> None:
    import torch

    utils.device_type, utils.device_module = "cpu", _CpuDevice("torchtitan_cpu_device")
    utils.get_local_device = lambda: torch.device("cpu")


def _dense_flex(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_aux=None,
                kernel_options=None):
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None:
        raise NotImplementedError("the CPU shim of FlexAttention takes no score_mod")
    mask = None if block_mask is None else create_mask(block_mask.mask_mod, q.shape[0], None, q.shape[2],
                                                       k.shape[2], device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, types.SimpleNamespace(lse=None, max_scores=None)


def _flex(attention) -> None:
    attention.FlexAttention._compiled_flex_attn = staticmethod(_dense_flex)


def _sum(fsdp) -> None:
    disable = fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model) -> None:
        disable(model)
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


def _timeouts(dist_utils) -> None:
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None


def install() -> None:
    sys.meta_path[:0] = [_Stubs(), _After("torchtitan.tools.utils", _cpu),
                         _After("torchtitan.models.common.attention", _flex),
                         _After("torchtitan.distributed.fsdp", _sum),
                         _After("torchtitan.distributed.utils", _timeouts)]
