"""core.ids: the range facts of token-id tuples, once per tuple object."""

from __future__ import annotations

import pytest

from pddgw.core import ids


def test_facts_of_long_and_short_sequences():
    long = tuple(range(5, 5 + 4096))
    assert ids.id_facts(long) == (True, 5, 4100)
    assert ids.id_facts([3, 1, 2]) == (True, 1, 3)
    assert ids.in_range(long, 4101) and not ids.in_range(long, 4100)
    assert ids.in_range((), 1) and ids.in_range([0], 1) and not ids.in_range([-1], 10)


@pytest.mark.parametrize("odd", [True, 1.0, "7", None])
def test_a_value_that_is_not_an_exact_int_fails_in_any_length(odd):
    for n in (3, 4096):
        values = tuple(range(n - 1)) + (odd,)
        assert ids.id_facts(values) == (False, 0, 0)
        assert not ids.in_range(values, 1 << 20)


def test_a_long_tuple_is_checked_once_and_an_equal_new_one_afresh(monkeypatch):
    seen: list[int] = []
    real = ids._facts
    monkeypatch.setattr(ids, "_facts", lambda v: (seen.append(len(v)), real(v))[1])
    t = tuple(range(ids.SHORT))
    for _ in range(3):
        assert ids.in_range(t, ids.SHORT)
    assert seen == [ids.SHORT]
    assert ids.in_range(tuple(list(t)), ids.SHORT)      # equal, but another object
    assert seen == [ids.SHORT, ids.SHORT]
    short = tuple(range(ids.SHORT - 1))
    ids.in_range(short, ids.SHORT)
    ids.in_range(short, ids.SHORT)
    assert seen == [ids.SHORT, ids.SHORT, ids.SHORT - 1, ids.SHORT - 1]   # not kept


def test_the_memo_keeps_the_last_keep_tuples_within_keep_tokens(monkeypatch):
    ids.MEMO.clear()
    keep = ids.MEMO.keep
    kept = [tuple(range(i, i + ids.SHORT)) for i in range(keep + 5)]
    for t in kept:
        ids.in_range(t, 1 << 20)
    assert len(ids.MEMO) == keep and ids.MEMO.items == keep * ids.SHORT
    assert all(ids.MEMO.holds(t) for t in kept[5:]) and not any(ids.MEMO.holds(t) for t in kept[:5])
    monkeypatch.setattr(ids.MEMO, "keep_items", 3 * ids.SHORT)
    big = tuple(range(2 * ids.SHORT))
    ids.in_range(big, 1 << 20)
    assert len(ids.MEMO) == 2 and ids.MEMO.holds(big) and ids.MEMO.holds(kept[-1])   # big and one before it
    assert ids.MEMO.items == 3 * ids.SHORT
