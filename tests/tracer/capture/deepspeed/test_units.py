"""A DeepSpeed model's units (tracer/capture/deepspeed/units.py): one per module holding
parameters of its own, the top module first, bytes per rank from the parameters' sizes
(ZeRO-3's whole size from ``ds_numel``)."""

from __future__ import annotations

import torch
from torch import nn

from ddpscope.tracer.capture.deepspeed.units import ROOT_NAME, find_units


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))  # the top module's own
        self.body = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))


def test_units_are_modules_with_their_own_parameters_in_order():
    net = Net()
    units, unit_of, owner_of = find_units(net, stage=2, world=2, itemsize=4)
    assert [u.name for u in units] == [ROOT_NAME, "body.0", "body.2"]
    assert [u.numel for u in units] == [3, 25, 12]
    assert units[1].param_names == ["body.0.weight", "body.0.bias"]
    assert units[1].unsharded_bytes == 100 and units[1].sharded_bytes == 4 * (10 + 3)  # ceil(20/2) + ceil(5/2)
    assert unit_of[id(net.body[2].weight)] == 2 and owner_of[id(net.body[0])] == 1
    assert not units[1].reshard_after_forward and units[0].facts()["root"]


def test_zero3_sizes_come_from_ds_numel():
    net = nn.Linear(4, 4)
    for p in net.parameters():  # as ZeRO-3 leaves them between uses: empty data, whole size on the side
        p.ds_numel = p.numel()
        p.data = torch.empty(0)
    units, _, _ = find_units(net, stage=3, world=2, itemsize=2)
    assert units[0].numel == 20 and units[0].unsharded_bytes == 40 and units[0].reshard_after_forward


def test_tied_weights_count_once_in_their_first_holder():
    """GPT-2's head shares the embedding's weight: DeepSpeed partitions it once, so the
    units' bytes (the ZeRO model's D) count it once, in the embedding's unit; the head,
    holding nothing else, is no unit: its fetches are the embedding's, not a prefetch."""
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(10, 4)
            self.mid = nn.Linear(4, 4)
            self.head = nn.Linear(4, 10, bias=False)
            self.out = nn.Linear(4, 10)
            self.head.weight = self.wte.weight
            self.out.weight = self.wte.weight  # tied too, with a bias of its own

    net = Tied()
    units, unit_of, owner_of = find_units(net, stage=3, world=2, itemsize=4)
    assert [u.name for u in units] == [ROOT_NAME, "wte", "mid", "out"]
    assert [u.numel for u in units] == [0, 40, 20, 10]
    assert sum(u.unsharded_bytes for u in units) == 4 * sum(p.numel() for p in net.parameters())  # each once
    assert units[3].param_names == ["out.bias"]
    assert unit_of[id(net.wte.weight)] == 1 and owner_of[id(net.head)] == 1 and owner_of[id(net.out)] == 3
