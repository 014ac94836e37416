"""A WAN cut under concurrent P-MD streams, real processes: every request not finished is
re-driven on the path that still works (RLD, from the tokens already emitted), none fails.

Tracker issue 23: P-MD requests failed with `unavailable` within 8 ms of a cut - a re-drive
that found its decoder full took it for a lost node and ran out of nodes.  A full decoder
now makes the re-drive wait for room instead.  Position-keyed sampling makes the re-driven
tokens identical to one node's.
"""

from __future__ import annotations

import asyncio

import pytest

from pddgw.harness.leaks import wait_quiescent
from pddgw.harness.reference import generate_engine
from tests.e2e.cluster import fresh  # noqa: F401 (a fixture)
from tests.reliability.test_p_death import PROMPT, QUIET_BOUND_S, _assert_exact, _stream

pytestmark = pytest.mark.slow


async def test_wan_cut_redrives_every_p_md_stream_on_rld(fresh):
    c = fresh(gbps=0.05)
    prompts = [[1 + i] + PROMPT for i in range(8)]
    loop = asyncio.get_running_loop()
    wants = await loop.run_in_executor(None, lambda: generate_engine([(tuple(p), 80) for p in prompts],
                                                                     temperature=0.7, seed=9))
    first = asyncio.Event()
    tasks = [loop.create_task(_stream(c, p, 80, "P-MD", first)) for p in prompts]
    async with asyncio.timeout(30):
        await first.wait()                   # MD streams: the cut lands mid-decode (and mid-transfer)
    c.proxy.cut()
    async with asyncio.timeout(60):
        rs = await asyncio.gather(*tasks)
    for r, want in zip(rs, wants):
        _assert_exact(r, want, c.log("router"))
        tl = r["final"]["response"]["pddgw"]
        assert tl["tokens_by_role"]["rld"] > 0 and tl["redrives"], tl
    assert "no healthy decode node left" not in c.log("router")
    doc = await wait_quiescent(c.state, QUIET_BOUND_S)          # md0 is unreachable: not checked
    assert not doc["nodes"]["md0"]["healthy"]
