"""Stream merger: every position once, in order, under overlap, duplicates,
reordering and conflicts (invariant 2)."""

from __future__ import annotations

import random

import pytest

from pddgw.core.tokens import TokenRun
from pddgw.pipeline.ordering import OrderingError, StreamGap, StreamMerger, TokenConflict

REF = [1000 + 7 * i for i in range(100)]  # the "true" output


def toks(a: int, b: int) -> list[int]:
    return REF[a:b]


def flat(runs: list[TokenRun]) -> list[tuple[int, int, str]]:
    return [(r.position + i, t, r.role) for r in runs for i, t in enumerate(r.ids)]


def push(m: StreamMerger, position: int, ids: list[int], role: str) -> list[TokenRun]:
    """A source's piece of m's request, as its stream edge hands it over."""
    return m.push(TokenRun(m.request_id, position, tuple(ids), role=role))  # type: ignore[arg-type]


def run(position: int, ids: tuple[int, ...], role: str, rid: str = "r") -> TokenRun:
    """An emitted run."""
    return TokenRun(rid, position, ids, role=role)  # type: ignore[arg-type]


def test_in_order_single_source():
    m = StreamMerger("r")
    assert push(m, 0, toks(0, 3), "rld") == [run(0, tuple(toks(0, 3)), "rld")]
    assert push(m, 3, toks(3, 4), "rld") == [run(3, (REF[3],), "rld")]
    assert push(m, 4, [], "rld") == []
    assert (m.next_position, m.pending, m.emitted_tokens) == (4, 0, tuple(toks(0, 4)))


def test_a_lone_next_token_is_passed_on_as_it_came_unless_it_ends_its_stream():
    m = StreamMerger("r")
    got = TokenRun("r", 0, (REF[0],), role="md")
    assert m.push(got)[0] is got             # a decoder's step: no new run for it
    last = TokenRun("r", 1, (REF[1],), True, "stop", role="md")
    assert m.push(last) == [run(1, (REF[1],), "md")]      # what is emitted says nothing of the stream's end
    assert m.emitted_tokens == (REF[0], REF[1])


def test_rld_then_overlapping_md_after_catch_up():
    m = StreamMerger("r")
    assert push(m, 0, toks(0, 41), "rld")[0].end == 41
    runs = push(m, 35, toks(35, 61), "md")
    assert runs == [run(41, tuple(toks(41, 61)), "md")]
    assert m.duplicates == 6
    assert m.tokens_by_role() == {"rld": 41, "md": 20}
    assert (m.role_at(40), m.role_at(41)) == ("rld", "md")


def test_md_overtakes_slow_rld_piece():
    m = StreamMerger("r")
    assert push(m, 0, toks(0, 30), "rld") != []
    # MD's stream (from the handoff at 40) arrives before RLD's last piece.
    assert push(m, 40, toks(40, 50), "md") == []
    assert m.pending == 10
    runs = push(m, 30, toks(30, 40), "rld")
    assert runs == [run(30, tuple(toks(30, 40)), "rld"), run(40, tuple(toks(40, 50)), "md")]
    assert m.pending == 0 and m.next_position == 50


def test_out_of_order_same_role_is_one_run():
    m = StreamMerger("r")
    assert push(m, 10, toks(10, 20), "md") == []
    assert push(m, 5, toks(5, 10), "md") == []
    assert push(m, 0, toks(0, 5), "md") == [run(0, tuple(toks(0, 20)), "md")]


def test_first_delivery_is_credited():
    m = StreamMerger("r")
    push(m, 5, toks(5, 10), "md")      # buffered first, from MD
    push(m, 0, toks(0, 10), "rld")     # RLD duplicates 5..9
    assert [m.role_at(p) for p in range(10)] == ["rld"] * 5 + ["md"] * 5
    assert m.duplicates == 5


def test_duplicates_after_redrive_emit_nothing():
    m = StreamMerger("r")
    push(m, 0, toks(0, 30), "md")
    assert push(m, 0, toks(0, 30), "md") == []
    assert push(m, 10, toks(10, 35), "md") == [run(30, tuple(toks(30, 35)), "md")]
    assert m.duplicates == 50
    assert m.emitted_tokens == tuple(toks(0, 35))


def test_conflict_with_emitted_token_raises_and_changes_nothing():
    m = StreamMerger("req-9")
    push(m, 0, toks(0, 10), "rld")
    bad = toks(8, 12)
    bad[1] = 5  # position 9
    with pytest.raises(TokenConflict) as ei:
        push(m, 8, bad, "md")
    e = ei.value
    assert (e.position, e.kept, e.kept_role, e.got, e.got_role) == (9, REF[9], "rld", 5, "md")
    assert "request req-9: position 9" in str(e)
    # Atomic: positions 10 and 11 of the bad piece were not taken.
    assert (m.next_position, m.pending, m.duplicates) == (10, 0, 0)
    assert push(m, 10, toks(10, 12), "md") == [run(10, tuple(toks(10, 12)), "md", "req-9")]


def test_conflict_with_pending_token():
    m = StreamMerger("r")
    push(m, 20, toks(20, 25), "md")
    with pytest.raises(TokenConflict) as ei:
        push(m, 0, toks(0, 22) + [1], "rld")  # position 22 disagrees with MD's buffered token
    assert (ei.value.position, ei.value.kept_role, ei.value.got_role) == (22, "md", "rld")
    assert (m.next_position, m.pending) == (0, 5)


def test_seal_and_completion():
    m = StreamMerger("r")
    push(m, 0, toks(0, 10), "rld")
    push(m, 15, toks(15, 20), "md")
    m.seal(20)                         # positions 10..14 still in flight
    assert not m.complete
    with pytest.raises(StreamGap, match="position 10 never arrived"):
        m.assert_complete()
    assert push(m, 10, toks(10, 15), "rld") != []
    assert m.complete
    m.assert_complete()
    m.seal(20)                         # idempotent
    assert push(m, 18, toks(18, 20), "rld") == []      # late duplicate, still checked
    with pytest.raises(OrderingError, match="past the end"):
        push(m, 19, toks(19, 21), "md")
    with pytest.raises(OrderingError, match="sealed at 20, then at 21"):
        m.seal(21)


def test_seal_rejects_tokens_past_the_end():
    m = StreamMerger("r")
    push(m, 0, toks(0, 10), "rld")
    with pytest.raises(OrderingError, match="position 9 was delivered"):
        m.seal(9)
    m2 = StreamMerger("r")
    push(m2, 0, toks(0, 5), "rld")
    push(m2, 12, toks(12, 14), "md")
    with pytest.raises(OrderingError, match="position 12 was delivered"):
        m2.seal(10)
    with pytest.raises(StreamGap, match="never sealed"):
        m2.assert_complete()


def test_input_validation():
    m = StreamMerger("r", max_ahead=100)
    with pytest.raises(ValueError):
        push(m, -1, [1], "rld")
    with pytest.raises(ValueError):
        push(m, 0, [-3], "rld")
    with pytest.raises(ValueError):
        push(m, 0, [True], "rld")
    with pytest.raises(ValueError):
        push(m, 0, [1], "gpu")  # type: ignore[arg-type]
    with pytest.raises(OrderingError, match="more than 100 past position 0"):
        push(m, 95, toks(0, 6), "md")
    assert push(m, 94, toks(94, 100), "md") == []
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
        out += flat(push(m, pos, ts, role))
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
