"""An FSDP2 model's units, as ddpscope traces them: one per ``FSDPParamGroup`` (a module
``fully_shard`` was applied to, or a group of modules given to it together), found from
the root's state after FSDP's lazy initialisation, in the order FSDP registered them.

A unit's bytes are this rank's: ``sharded_bytes`` its padded local shards (what it holds
between uses), ``unsharded_bytes`` the gathered parameters while it is unsharded (every
rank's padded shard, in the parameters' compute dtype). Bytes throughout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ROOT_NAME = "(root)"


@dataclass
class Unit:
    index: int
    name: str  # the module's qualified name in the root ("(root)" for the root itself)
    group: Any  # the FSDPParamGroup
    param_names: list[str]
    numel: int  # parameters' elements (unpadded, all ranks)
    sharded_bytes: int
    unsharded_bytes: int
    reshard_after_forward: bool | int
    is_root: bool
    shard_size: int = 1  # ranks the unit is sharded over
    replicate_size: int = 1  # HSDP: replicas its gradients are all-reduced across (1: plain FSDP)

    @property
    def replicated(self) -> bool:
        return self.replicate_size > 1 or _replicate_group(self.group) is not None

    def facts(self) -> dict:
        """JSON-able, for run.json and the rank file's metadata."""
        return {"index": self.index, "name": self.name, "params": self.param_names, "numel": self.numel,
                "sharded_bytes": self.sharded_bytes, "unsharded_bytes": self.unsharded_bytes,
                "reshard_after_forward": self.reshard_after_forward, "root": self.is_root,
                "shard_size": self.shard_size, "replicate_size": self.replicate_size}


def find_units(root_state) -> list[Unit]:
    """The units of the model whose root FSDP state is ``root_state`` (lazily initialised)."""
    units: list[Unit] = []
    modules = root_state._modules
    module_names = {id(m): n for n, m in modules[0].named_modules()} if modules else {}
    for state in root_state._state_ctx.all_states:  # the root first, as FSDP's lazy init listed them
        for group in param_groups(state):
            params = list(group.fsdp_params)
            world = _shard_world(group)
            name = group._module_fqn or ROOT_NAME
            sharded = sum(p._sharded_param_data.numel() * p._sharded_param_data.element_size() for p in params)
            item = _compute_item_size(group, params)
            unsharded = sum(p._sharded_param_data.numel() * world * item for p in params)
            units.append(Unit(index=len(units), name=name, group=group,
                              param_names=[_param_name(p, i, module_names) for i, p in enumerate(params)],
                              numel=sum(int(p._orig_size.numel()) for p in params), sharded_bytes=sharded,
                              unsharded_bytes=unsharded, reshard_after_forward=_reshard_setting(group, world),
                              is_root=state is root_state, shard_size=world,
                              replicate_size=int(getattr(group.mesh_info, "replicate_mesh_size", 1) or 1)))
    return units


def _param_name(param, i: int, module_names: dict[int, str]) -> str:
    """An ``FSDPParam``'s qualified name: FSDP's own ``_param_fqn``, else its module's name in
    the root and its name there. FSDP's lazy init names only the parameters sharded at that
    moment (it looks them up by identity): a root the script unsharded before its first
    forward (``model.unshard()``, PyTorch's FSDP2 example) holds its unsharded ones then."""
    name = getattr(param, "_param_fqn", None)
    if name:
        return name
    info = getattr(param, "_module_info", None)
    prefix = module_names.get(id(getattr(info, "module", None)))
    if prefix is not None and getattr(info, "param_name", None):
        return f"{prefix}.{info.param_name}" if prefix else info.param_name
    return f"param[{i}]"


def param_groups(state) -> list:
    """An FSDP state's parameter groups: ``_fsdp_param_groups`` (torch 2.13), else the one
    ``_fsdp_param_group`` of earlier torch (None where the module holds no parameter of
    its own; seen on a GPU machine's torch 2.11)."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def _replicate_group(group):
    """The process group a unit all-reduces its gradients over (HSDP), or None."""
    return getattr(group.mesh_info, "replicate_process_group", None)


def _shard_world(group) -> int:
    mesh_info = group.mesh_info
    return int(getattr(mesh_info, "shard_mesh_size", 1) or 1)


def _compute_item_size(group, params) -> int:
    """Bytes per gathered element: the mixed-precision ``param_dtype`` when set, else the
    parameter's own."""
    if not params:
        return 4
    dtype = getattr(params[0], "param_dtype", None)  # FSDPParam.init_dtype_attrs: None without a policy
    return torch.empty((), dtype=dtype).element_size() if dtype is not None else params[0]._sharded_param_data.element_size()


def _reshard_setting(group, world: int) -> bool | int:
    """``reshard_after_forward`` as the group has it now: False (kept unsharded until
    backward), True (resharded to the full shard group), or N (resharded to N ranks)."""
    info = group.post_forward_mesh_info
    if info is None:
        return False
    size = int(getattr(info, "shard_mesh_size", world) or world)
    return True if size == world else size


def problems(units: list[Unit]) -> list[str]:
    """What ddpscope cannot trace as measured, each one line (said, and traced anyway
    where the trace still means something)."""
    out = []
    offload = [u.name for u in units if type(getattr(u.group, "offload_policy", None)).__name__ == "CPUOffloadPolicy"]
    if offload:
        out.append(f"CPU offload (CPUOffloadPolicy) on {len(offload)} unit(s), e.g. {offload[0]}: parameters and "
                   "gradients move between host and device; the memory figures count the device's only")
    return out


def meta_params(root_module: torch.nn.Module) -> list[str]:
    """Parameters still on the meta device (meta-device initialisation not materialised)."""
    return [n for n, p in root_module.named_parameters() if getattr(p, "is_meta", False)]


def signature(units: list[Unit]) -> list[tuple[str, int]]:
    """What must be the same on every rank: each unit's name and parameter count."""
    return [(u.name, u.numel) for u in units]
