"""A request's reservations (pipeline/flight.py): taken once, given back once, all at the end."""

from __future__ import annotations

from dataclasses import dataclass

from pddgw.pipeline.flight import Ledger, Reservation


@dataclass(slots=True)
class _Counters:
    name: str = "n0"
    inflight: int = 0
    relays: int = 0
    relay_tokens: int = 0


def test_a_reservation_gives_its_amounts_back_once():
    c = _Counters()
    r = Reservation(c, {"relays": 1, "relay_tokens": 300})
    assert (c.relays, c.relay_tokens) == (1, 300)
    assert r.release() is True
    assert r.release() is False
    assert (c.relays, c.relay_tokens) == (0, 0)


def test_taking_a_held_key_again_counts_once():
    c = _Counters()
    led = Ledger()
    first = led.take(("node", c.name), c, inflight=1)
    assert led.take(("node", c.name), c, inflight=1) is first
    assert c.inflight == 1 and led.holder(("node", c.name)) is c
    assert led.release(("node", c.name)) is True
    assert led.release(("node", c.name)) is False
    assert c.inflight == 0 and led.holder(("node", c.name)) is None


def test_a_key_released_through_its_reservation_may_be_taken_again():
    c = _Counters()
    led = Ledger()
    led.take("relay", c, relays=1).release()
    led.take("relay", c, relays=1)
    assert c.relays == 1
    led.release_all()
    assert c.relays == 0


def test_release_all_gives_everything_back_and_owners_keep_the_order_taken():
    a, b, c = _Counters("a"), _Counters("b"), _Counters("c")
    led = Ledger()
    for n in (b, a, c):
        led.take(("node", n.name), n, inflight=1)
    led.take("relay", a, relays=1, relay_tokens=64)
    led.release(("node", "a"))
    led.take(("node", "a"), a, inflight=1)       # taken again: now last
    assert [n.name for n in led.owners("node")] == ["b", "c", "a"]
    led.release_all()
    led.release_all()
    assert [(n.inflight, n.relays, n.relay_tokens) for n in (a, b, c)] == [(0, 0, 0)] * 3
    assert led.owners("node") == []
