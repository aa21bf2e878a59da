"""The sharded what-if's own rules (viz/sharded/predict.py) that need no run: the
``reshard_after_forward`` settings a rerun can take. The predictions themselves are
checked against real reruns in test_rerun_check.py and tests/tracer/capture/sharded."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest

from ddpscope.viz.sharded.predict import reshard_choices


def _trace(world: int, shard: int, replicas: int) -> SimpleNamespace:
    units = pd.DataFrame([{"unit": k, "shard_size": shard, "replicate_size": replicas} for k in range(3)])
    return SimpleNamespace(world_size=world, shards=SimpleNamespace(units=units))


@pytest.mark.parametrize("world, shard, replicas, ns", [
    (8, 8, 1, [2, 4]),  # plain FSDP: the world's proper factors
    (4, 4, 1, [2]),
    (2, 2, 1, []),
    (4, 2, 2, []),  # HSDP 2 x 2: N = 2 is the shard group, True itself (the world's 2 is no hybrid)
    (6, 3, 2, []),  # HSDP 2 x 3: FSDP2 refuses 2 (no factor of 3), reads 3 as True
    (12, 6, 2, [2, 3]),  # HSDP 2 x 6: 4 divides the world, not the shard group
    (4, 1, 4, []),  # shard groups of one rank (DDP by FSDP2): nothing to reshard to
    (4, 0, 1, [2]),  # a trace from before shard_size: the world is the shard group
])
def test_reshard_choices_are_factors_of_the_shard_group_as_fsdp2_takes_them(world, shard, replicas, ns):
    choices = reshard_choices(_trace(world, shard, replicas))
    assert choices == [True, False, *ns]
    # each N is one FSDP2 takes as a hybrid: a factor of the shard group, neither 1 (False) nor S (True)
    size = shard or world
    assert all(size % n == 0 and 1 < n < size for n in ns)
