"""The prefetch depths read from a real FSDP2 model's units (``settings.read_prefetch``),
in process: one rank on gloo, four blocks each ``fully_shard``-ed, then the root, as
PyTorch's FSDP2 example builds them; its prefetch lists set as the script sets them
(``set_modules_to_*_prefetch``) or as a rerun does (``apply_prefetch``)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddpscope.tracer.capture.sharded.settings import apply_prefetch, read_prefetch
from ddpscope.tracer.capture.sharded.units import find_units


@pytest.fixture
def blocks(tmp_path):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        for block in model:
            fully_shard(block)
        fully_shard(model)
        model(torch.randn(2, 8)).sum().backward()  # FSDP's lazy init: every unit known
        yield model, find_units(model._get_fsdp_state())
    finally:
        dist.destroy_process_group()


def _example(model, ahead: int, behind: int) -> None:
    """distributed/FSDP2/example.py's set_modules_to_{forward,backward}_prefetch."""
    for i, block in enumerate(model):
        if i >= len(model) - ahead:
            break
        block.set_modules_to_forward_prefetch([model[i + j] for j in range(1, ahead + 1)])
    for i, block in enumerate(model):
        if i >= behind:
            block.set_modules_to_backward_prefetch([model[i - j] for j in range(1, behind + 1)])


def _read(units) -> tuple:
    got = read_prefetch(units)
    return got["forward_prefetch"], got["backward_prefetch"]


def test_prefetch_depths_are_read_as_the_units_run_them(blocks):
    model, units = blocks
    assert [u.name for u in units] == ["0", "1", "2", "3"]  # the root holds no parameter of its own
    assert _read(units) == (0, 1)  # FSDP's defaults: none ahead in forward, one (implicit) in backward
    _example(model, 2, 2)
    assert _read(units) == (2, 2)  # the example's last two blocks prefetch nothing ahead: still depth 2
    apply_prefetch(units, 0, None)  # a rerun's --forward-prefetch 0: the script's forward prefetching gone
    assert _read(units) == (0, 2)
    apply_prefetch(units, 1, 3)
    assert _read(units) == (1, 3)
    model[0].set_modules_to_forward_prefetch([model[2]])  # skips a block: no one depth
    assert _read(units) == (None, 3)
    model[0].set_modules_to_forward_prefetch([model[1]])
    model[1].set_modules_to_forward_prefetch([])  # cut short in the middle, not at the end: no one depth
    assert _read(units) == (None, 3)
