"""Stream merger: every position once, in order, under overlap, duplicates,
reordering and conflicts (invariant 2)."""

from __future__ import annotations

import random

import pytest

from pddgw.pipeline.ordering import OrderingError, StreamGap, StreamMerger, TokenConflict, TokenRun

REF = [1000 + 7 * i for i in range(100)]  # the "true" output


def toks(a: int, b: int) -> list[int]:
    return REF[a:b]


def flat(runs: list[TokenRun]) -> list[tuple[int, int, str]]:
    return [(r.position + i, t, r.role) for r in runs for i, t in enumerate(r.token_ids)]


def test_in_order_single_source():
    m = StreamMerger("r")
    assert m.push(0, toks(0, 3), "rld") == [TokenRun(0, tuple(toks(0, 3)), "rld")]
    assert m.push(3, toks(3, 4), "rld") == [TokenRun(3, (REF[3],), "rld")]
    assert m.push(4, [], "rld") == []
    assert (m.next_position, m.pending, m.emitted_tokens) == (4, 0, tuple(toks(0, 4)))


def test_rld_then_overlapping_md_after_catch_up():
    m = StreamMerger("r")
    assert m.push(0, toks(0, 41), "rld")[0].end == 41
    runs = m.push(35, toks(35, 61), "md")
    assert runs == [TokenRun(41, tuple(toks(41, 61)), "md")]
    assert m.duplicates == 6
    assert m.tokens_by_role() == {"rld": 41, "md": 20}
    assert (m.role_at(40), m.role_at(41)) == ("rld", "md")


def test_md_overtakes_slow_rld_piece():
    m = StreamMerger("r")
    assert m.push(0, toks(0, 30), "rld") != []
    # MD's stream (from the handoff at 40) arrives before RLD's last piece.
    assert m.push(40, toks(40, 50), "md") == []
    assert m.pending == 10
    runs = m.push(30, toks(30, 40), "rld")
    assert runs == [TokenRun(30, tuple(toks(30, 40)), "rld"), TokenRun(40, tuple(toks(40, 50)), "md")]
    assert m.pending == 0 and m.next_position == 50


def test_out_of_order_same_role_is_one_run():
    m = StreamMerger("r")
    assert m.push(10, toks(10, 20), "md") == []
    assert m.push(5, toks(5, 10), "md") == []
    assert m.push(0, toks(0, 5), "md") == [TokenRun(0, tuple(toks(0, 20)), "md")]


def test_first_delivery_is_credited():
    m = StreamMerger("r")
    m.push(5, toks(5, 10), "md")      # buffered first, from MD
    m.push(0, toks(0, 10), "rld")     # RLD duplicates 5..9
    assert [m.role_at(p) for p in range(10)] == ["rld"] * 5 + ["md"] * 5
    assert m.duplicates == 5


def test_duplicates_after_redrive_emit_nothing():
    m = StreamMerger("r")
    m.push(0, toks(0, 30), "md")
    assert m.push(0, toks(0, 30), "md") == []
    assert m.push(10, toks(10, 35), "md") == [TokenRun(30, tuple(toks(30, 35)), "md")]
    assert m.duplicates == 50
    assert m.emitted_tokens == tuple(toks(0, 35))


def test_conflict_with_emitted_token_raises_and_changes_nothing():
    m = StreamMerger("req-9")
    m.push(0, toks(0, 10), "rld")
    bad = toks(8, 12)
    bad[1] = 5  # position 9
    with pytest.raises(TokenConflict) as ei:
        m.push(8, bad, "md")
    e = ei.value
    assert (e.position, e.kept, e.kept_role, e.got, e.got_role) == (9, REF[9], "rld", 5, "md")
    assert "request req-9: position 9" in str(e)
    # Atomic: positions 10 and 11 of the bad piece were not taken.
    assert (m.next_position, m.pending, m.duplicates) == (10, 0, 0)
    assert m.push(10, toks(10, 12), "md") == [TokenRun(10, tuple(toks(10, 12)), "md")]


def test_conflict_with_pending_token():
    m = StreamMerger("r")
    m.push(20, toks(20, 25), "md")
    with pytest.raises(TokenConflict) as ei:
        m.push(0, toks(0, 22) + [1], "rld")  # position 22 disagrees with MD's buffered token
    assert (ei.value.position, ei.value.kept_role, ei.value.got_role) == (22, "md", "rld")
    assert (m.next_position, m.pending) == (0, 5)


def test_seal_and_completion():
    m = StreamMerger("r")
    m.push(0, toks(0, 10), "rld")
    m.push(15, toks(15, 20), "md")
    m.seal(20)                         # positions 10..14 still in flight
    assert not m.complete
    with pytest.raises(StreamGap, match="position 10 never arrived"):
        m.assert_complete()
    assert m.push(10, toks(10, 15), "rld") != []
    assert m.complete
    m.assert_complete()
    m.seal(20)                         # idempotent
    assert m.push(18, toks(18, 20), "rld") == []      # late duplicate, still checked
    with pytest.raises(OrderingError, match="past the end"):
        m.push(19, toks(19, 21), "md")
    with pytest.raises(OrderingError, match="sealed at 20, then at 21"):
        m.seal(21)


def test_seal_rejects_tokens_past_the_end():
    m = StreamMerger("r")
    m.push(0, toks(0, 10), "rld")
    with pytest.raises(OrderingError, match="position 9 was delivered"):
        m.seal(9)
    m2 = StreamMerger("r")
    m2.push(0, toks(0, 5), "rld")
    m2.push(12, toks(12, 14), "md")
    with pytest.raises(OrderingError, match="position 12 was delivered"):
        m2.seal(10)
    with pytest.raises(StreamGap, match="never sealed"):
        m2.assert_complete()


def test_input_validation():
    m = StreamMerger("r", max_ahead=100)
    with pytest.raises(ValueError):
        m.push(-1, [1], "rld")
    with pytest.raises(ValueError):
        m.push(0, [-3], "rld")
    with pytest.raises(ValueError):
        m.push(0, [True], "rld")
    with pytest.raises(ValueError):
        m.push(0, [1], "gpu")  # type: ignore[arg-type]
    with pytest.raises(OrderingError, match="more than 100 past position 0"):
        m.push(95, toks(0, 6), "md")
    assert m.push(94, toks(94, 100), "md") == []
    with pytest.raises(IndexError):
        m.role_at(0)


@pytest.mark.parametrize("seed", range(40))
def test_random_races(seed: int):
    """RLD covers a prefix, MD (and a re-driven MD) overlap it; pieces shuffled."""
    rng = random.Random(seed)
    n = rng.randint(1, 100)
    handoff = rng.randint(0, n)
    pieces: list[tuple[int, list[int], str]] = []

    def cut(a: int, b: int, role: str) -> None:
        while a < b:
            k = rng.randint(1, 9)
            pieces.append((a, toks(a, min(b, a + k)), role))
            a += k

    cut(0, handoff, "rld")
    md_from = rng.randint(max(0, handoff - 15), handoff)   # catch-up overlap
    cut(md_from, n, "md")
    if rng.random() < 0.5:                                 # a re-drive replays a span
        a = rng.randint(0, n)
        cut(a, rng.randint(a, n), "md")
    rng.shuffle(pieces)
    m = StreamMerger("r")
    out = []
    for pos, ts, role in pieces:
        out += flat(m.push(pos, ts, role))
        assert m.next_position == len(out)
    m.seal(n)
    m.assert_complete()
    assert [p for p, _, _ in out] == list(range(n))
    assert [t for _, t, _ in out] == REF[:n]
    assert sum(m.tokens_by_role().values()) == n
    assert m.duplicates == sum(len(ts) for _, ts, _ in pieces) - n
    # A position only one role ever sent is credited to that role.
    senders: dict[int, set[str]] = {}
    for pos, ts, role in pieces:
        for p in range(pos, pos + len(ts)):
            senders.setdefault(p, set()).add(role)
    for p, who in senders.items():
        if len(who) == 1:
            assert m.role_at(p) in who
    assert all(m.role_at(p) == "md" for p in range(handoff, n))
