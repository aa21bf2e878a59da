"""A DeepSpeed model's units, as ddpscope names its collectives: one per module that
holds parameters of its own (``recurse=False``), in the order ``named_modules`` lists
them, the top module first (``(root)``, with whatever parameters it holds directly).
A parameter shared by several modules (tied weights: GPT-2's ``lm_head`` and ``wte``)
is its first holder's, counted once, as DeepSpeed partitions it once; a module whose
parameters are all another's is no unit of its own (its fetches are that unit's).
At ZeRO-3 these are exactly what DeepSpeed fetches: ``fetch_sub_module`` gathers a
module's own parameters. At stages 1-2 a gradient bucket is named for the unit of its
first parameter.

Bytes are this rank's (``sharded_bytes``: its partition, ``ceil(numel / N)`` elements;
``unsharded_bytes``: the whole parameters), in the model's training dtype. At ZeRO-3 a
parameter's full numel is ``ds_numel`` (the module's own tensor is empty between uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROOT_NAME = "(root)"


@dataclass
class DSUnit:
    index: int
    name: str
    param_names: list[str]
    numel: int
    sharded_bytes: int
    unsharded_bytes: int
    reshard_after_forward: bool  # ZeRO-3 frees gathered parameters after use; 1-2 keep them whole
    is_root: bool
    shard_size: int  # ranks its parameters are partitioned over

    def facts(self) -> dict:
        """JSON-able, in the sharded format's shape (``viz.sharded.trace`` reads it)."""
        return {"index": self.index, "name": self.name, "params": self.param_names, "numel": self.numel,
                "sharded_bytes": self.sharded_bytes, "unsharded_bytes": self.unsharded_bytes,
                "reshard_after_forward": self.reshard_after_forward, "root": self.is_root,
                "shard_size": self.shard_size, "replicate_size": 1}


def numel(p: torch.Tensor) -> int:
    """A parameter's whole element count (ZeRO-3's partitioned parameters keep it in ``ds_numel``)."""
    n = getattr(p, "ds_numel", None)
    return int(n) if isinstance(n, int) else int(p.numel())


def find_units(module: torch.nn.Module, stage: int, world: int, itemsize: int) -> tuple[list[DSUnit], dict, dict]:
    """The units of ``module``, and two maps: ``id(param) -> unit`` and ``id(module) -> unit``."""
    units: list[DSUnit] = []
    by_param: dict[int, int] = {}
    by_module: dict[int, int] = {}
    for name, m in module.named_modules():
        held = list(m.named_parameters(recurse=False))
        own = [(n, p) for n, p in held if id(p) not in by_param]  # tied: the first holder's
        if not own and name:
            if held:  # only tied parameters: the module's fetches gather its first parameter's unit
                by_module[id(m)] = by_param[id(held[0][1])]
            continue
        k = len(units)
        counts = [numel(p) for _, p in own]
        units.append(DSUnit(index=k, name=name or ROOT_NAME,
                            param_names=[f"{name}.{n}" if name else n for n, _ in own], numel=sum(counts),
                            sharded_bytes=sum(-(-c // world) for c in counts) * itemsize,
                            unsharded_bytes=sum(counts) * itemsize, reshard_after_forward=stage == 3,
                            is_root=not name, shard_size=world))
        by_module[id(m)] = k
        for _, p in own:
            by_param.setdefault(id(p), k)
    return units, by_param, by_module
