"""sim.workload: prompt token ids drawn as numpy draws them, as shared int objects."""

from __future__ import annotations

import numpy as np

from pddgw.sim import workload


def test_drawn_ids_are_numpys_draw_and_one_object_per_value():
    got = workload.shared_prefix(4096, 3)
    want = tuple(np.random.default_rng([3, 7]).integers(1000, 30000, size=4096).tolist())
    assert got == want and {type(t) for t in got} == {int}
    again = workload.shared_prefix(4096, 3)
    assert again is not got and all(a is b for a, b in zip(again, got))     # the same int objects
