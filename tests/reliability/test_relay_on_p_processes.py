"""A relaying P in real processes: router, p0 (`relay = true`) in cluster A, md0 in B.

Three `pddgw serve` processes (tests/e2e/cluster.py with `relay_on_p`), MD
behind a proxy over a shaped WAN.  Each request streams exactly what one node
generates on every path (P-MD, the relay's one-shot and catch-up handoffs),
a kill of p0 while it relays is re-driven on MD with nothing lost, and every
live node ends with nothing in use.
"""

from __future__ import annotations

import pytest

from pddgw.harness.leaks import wait_quiescent
from tests.e2e.cluster import fresh  # noqa: F401 (a fixture)
from tests.reliability.test_kills import _exact, _request

pytestmark = pytest.mark.slow


async def test_every_path_of_a_relaying_p_is_exact(fresh):
    c = fresh(relay_on_p=True, policy="catchup_threshold = 2\ncatchup_threshold_md_loaded = 2\ncatchup_max_rounds = 2")
    r = await _request(c, "P-MD", 60)
    _exact(r, c, 60)
    assert r.timeline["tokens_by_role"] == {"md": 60}
    for mode in ("one-shot", "catch-up"):
        r = await _request(c, "P-RLD-MD", 300, handoff_mode=mode)
        _exact(r, c, 300)
        tl = r.timeline
        at = tl["handoff_position"]
        assert tl["pipeline"] == "P-RLD-MD" and tl["handoff_mode"] == mode, tl
        assert 0 < at < 300 and tl["tokens_by_role"] == {"rld": at, "md": 300 - at}, tl
        assert [e["pddgw"]["role"] for e in r.deltas] == ["rld"] * at + ["md"] * (300 - at)
    await wait_quiescent(c.state)


async def test_a_relaying_p_killed_mid_relay_is_redriven_exactly(fresh):
    # 2 Mbps: MD waits for the prompt's KV long after p0 relays its first tokens.
    c = fresh(relay_on_p=True, gbps=0.002)
    r = await _request(c, "P-RLD-MD", 300, after=5, action=lambda: c.kill("p0"), role="rld")
    _exact(r, c, 300)
    tl = r.timeline
    assert tl["redrives"] and tl["tokens_by_role"]["rld"] >= 6 and tl["tokens_by_role"]["md"] > 0, tl
    await wait_quiescent(c.state)
