"""Layout every figure shares.

``LEGEND_BELOW``: a horizontal legend at the foot of the whole figure (``yref="container"``).
A legend placed at a fraction below the plot (``y=-0.2``) is anchored by its bottom and
grows upward over the x axis' title, and a narrow column's rotated tick labels are cut;
referenced to the container, plotly grows the bottom margin to hold the legend below both."""

from __future__ import annotations

LEGEND_BELOW = dict(orientation="h", yref="container", y=0, yanchor="bottom", x=0, xanchor="left")
