"""The router's memory of which MD holds which prompt blocks."""

from __future__ import annotations

import pytest

from pddgw.pipeline.affinity import PrefixIndex


def test_longest_remembered_prefix_per_instance():
    idx = PrefixIndex()
    shared, a, b = [1, 2, 3], [10, 11], [20, 21, 22]
    idx.record("md0", shared + a)
    idx.record("md1", shared + b)          # the shared prefix now lives on both
    assert idx.match("md0", shared + a + [12]) == 5
    assert idx.match("md1", shared + a + [12]) == 3
    assert idx.match("md1", shared + b) == 6
    assert idx.match("md2", shared) == 0
    assert len(idx) == 11                  # 5 on md0, 6 on md1


def test_least_recent_blocks_are_forgotten_first():
    idx = PrefixIndex(capacity=4)
    idx.record("md0", [1, 2, 3])
    idx.record("md0", [1, 4, 5])           # 1 is refreshed; 2 is the oldest
    assert idx.match("md0", [1, 2, 3]) == 1
    assert idx.match("md0", [1, 4, 5]) == 3
    with pytest.raises(ValueError):
        PrefixIndex(capacity=0)
