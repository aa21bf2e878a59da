"""The sharded loader's reading of a memory sample's host-memory bytes (``offloaded``,
DeepSpeed's ZeRO-Offload): a damaged one is refused in one line, never summed."""

from __future__ import annotations

import pytest

from ddpscope.viz.sharded.trace import _offloaded


def test_offloaded_bytes_read_by_category():
    assert _offloaded(None) is None
    assert _offloaded({}) == {}
    assert _offloaded({"optimizer_state_bytes": 8, "sharded_params_bytes": 4}) == \
        {"optimizer_state_bytes": 8, "sharded_params_bytes": 4}


@pytest.mark.parametrize("bad", [[["optimizer_state_bytes", 8]], {"host": 8}, {"optimizer_state_bytes": -1},
                                 {"optimizer_state_bytes": 1.5}, {"optimizer_state_bytes": True}])
def test_a_damaged_offloaded_is_one_line_value_error(bad):
    with pytest.raises(ValueError) as e:
        _offloaded(bad)
    assert "\n" not in str(e.value)
