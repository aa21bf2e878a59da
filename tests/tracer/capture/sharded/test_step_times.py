"""A closed sharded step's times made final (tracer/capture/sharded/step_times.py): compute
segments cut around the holes of collectives and waits recorded whole."""

from __future__ import annotations

from ddpscope.tracer.capture.sharded.recorder import BACKWARD, FORWARD
from ddpscope.tracer.capture.sharded.step_times import cut_holes


def test_holes_are_cut_out_of_segments_wherever_they_fall():
    segs = [(0, FORWARD, 0.0, 10.0), (1, BACKWARD, 20.0, 30.0)]
    # one inside, one over a segment's end, two overlapping, one over a whole segment, one between
    holes = [(2.0, 3.0), (9.0, 12.0), (14.0, 15.0), (21.0, 24.0), (23.0, 25.0)]
    assert cut_holes(segs, holes) == [(0, FORWARD, 0.0, 2.0), (0, FORWARD, 3.0, 9.0),
                                              (1, BACKWARD, 20.0, 21.0), (1, BACKWARD, 25.0, 30.0)]
    assert cut_holes(segs, [(0.0, 40.0)]) == []
    assert cut_holes(segs, []) == segs
