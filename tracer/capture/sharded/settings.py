"""Sharding settings a rerun overrides with no change to the script (``ddpscope run
--reshard-after-forward``, ``--forward-prefetch``, ``--backward-prefetch``), applied
once FSDP knows every unit (its lazy initialisation, at the root's first forward).

- ``reshard_after_forward``: True (ZeRO-3), False (ZeRO-2) or N (resharded to N ranks
  after forward), for every unit but the root, as ``fully_shard`` would have set it
  (FSDP's own ``_get_post_forward_mesh_info``: N must divide the shard group; an N of
  the whole group is True). The root keeps FSDP's rule: not resharded after forward,
  since backward gathers it again at once.
- prefetch depths: each unit all-gathers the next ``forward`` units in forward order
  ahead of its own forward (FSDP's ``set_modules_to_forward_prefetch``), and the next
  ``backward`` units in backward order (``set_modules_to_backward_prefetch``; FSDP's
  default is one, implicitly). Forward order is the order of the units in the model
  (``named_modules``), the order FSDP itself lists them in.
"""

from __future__ import annotations


def parse_reshard(text: str | None) -> bool | int | None:
    """``"true"``/``"false"``/``"N"`` -> True/False/N; None stays None. ``ValueError``
    names the flag."""
    if text is None:
        return None
    value = str(text).strip().lower()
    if value in ("true", "1.0", "yes"):
        return True
    if value in ("false", "no"):
        return False
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"--reshard-after-forward takes true, false or a number of ranks, got {text!r}") from None
    if n < 1:
        raise ValueError(f"--reshard-after-forward N must be a number of ranks >= 1, got {n}")
    return n


def apply_reshard(units, value: bool | int) -> None:
    """Set ``reshard_after_forward`` on every unit but the root (``ValueError`` as FSDP's),
    where ``fully_shard`` sets it: the group's mesh and each parameter's (an N keeps a
    1/N shard from forward to backward, cut by the parameter's own post-forward size,
    which ``FSDPParam.__init__`` computes from the mesh: computed here again from the
    parameter's original size, on the meta device: no memory)."""
    import torch
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_post_forward_mesh_info

    targets = [u for u in units if not u.is_root]
    # every check before any change: a refused setting leaves every unit as the script set it
    infos = [_get_post_forward_mesh_info(value, u.group.mesh_info) for u in targets]
    if not isinstance(value, bool) and any(p.is_dtensor for u in targets for p in u.group.fsdp_params):
        raise ValueError(f"reshard_after_forward={value} needs plain parameters: FSDP2 cannot reshard DTensor "
                         "(tensor-parallel) ones to fewer ranks")
    for u, info in zip(targets, infos):
        u.group.post_forward_mesh_info = info
        for p in u.group.fsdp_params:
            p.post_forward_mesh_info = info
            if info is not None:
                p._init_sharded_post_forward_param_metadata(torch.empty(p._orig_size, device="meta"))


def apply_prefetch(units, forward: int | None, backward: int | None) -> None:
    """Explicit prefetching, ``forward``/``backward`` units ahead (None: FSDP's default)."""
    order = [u for u in units if not u.is_root]
    modules = [u.group.modules[0] for u in order]
    for k, module in enumerate(modules):
        if forward is not None:
            module.set_modules_to_forward_prefetch(modules[k + 1:k + 1 + forward])
        if backward is not None:
            before = modules[max(0, k - backward):k][::-1]  # backward runs the units in reverse
            module.set_modules_to_backward_prefetch(before)


def read_prefetch(units) -> dict:
    """The prefetch depths the units run with, as ``apply_prefetch`` names them:
    ``{"forward_prefetch": d, "backward_prefetch": d}``, read from each unit's FSDP state
    (the script's own ``set_modules_to_*_prefetch`` lists, or a rerun's). None where the
    lists are no one depth of the units' forward order (a script's own choice per unit).
    A unit without a backward list prefetches one, implicitly (FSDP's default). A list cut
    short where the model ends (PyTorch's FSDP2 example gives its last d blocks none) is
    depth d too."""
    order = [u for u in units if not u.is_root]
    try:
        states = [u.group.modules[0]._get_fsdp_state() for u in order]
        fwd = [list(s._states_to_forward_prefetch) for s in states]
        bwd = [list(s._states_to_backward_prefetch) or states[max(0, k - 1):k][::-1] for k, s in enumerate(states)]
    except (AttributeError, IndexError):  # another FSDP2 than the one read here: said as unknown
        return {"forward_prefetch": None, "backward_prefetch": None}

    def depth(lists, expected, floor: int, at_end) -> int | None:
        d = max([floor, *map(len, lists)])
        for k, got in enumerate(lists):  # a list cut short only at the model's end, and a start of the depth's
            if got != expected(k, d) and not (at_end(k, d) and got == expected(k, d)[:len(got)]):
                return None
        return d

    n = len(states)
    return {"forward_prefetch": depth(fwd, lambda k, d: states[k + 1:k + 1 + d], 0, lambda k, d: k >= n - d),
            "backward_prefetch": depth(bwd, lambda k, d: states[max(0, k - d):k][::-1], 1, lambda k, d: k < d)}
