"""The sharded timeline's colours (viz/sharded/figures.py)."""

from __future__ import annotations

from plotly.colors import hex_to_rgb

from ddpscope.viz.sharded.figures import unit_colors


def test_no_unit_is_drawn_in_the_red_of_waiting_and_exposed_time():
    """FSDP2's unit 1 was drawn in plotly's red-orange, beside "waiting for an all-gather" in red."""
    colors = unit_colors([f"layers.{k}" for k in range(40)])
    for name, c in colors.items():
        r, g, b = hex_to_rgb(c)
        assert not (r > 180 and g < 110 and b < 110), (name, c)  # nothing red
    assert colors["layers.0"] != colors["layers.1"]
