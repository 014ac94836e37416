"""Node kills, a restarting P, a WAN cut and healed, a bandwidth collapse: real processes.

Router, P and RLD (cluster A) and MD (cluster B) run as separate processes
(tests/e2e/cluster.py); MD is reached through a proxy this test owns, so it
can cut the WAN.  Every request must still stream exactly what one node
generates (position-keyed sampling makes re-driven tokens identical), and
every test ends with nothing in use on any live node.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from pddgw.harness.leaks import wait_quiescent
from pddgw.harness.reference import generate_cli as generate_one_node
from tests.e2e.cluster import Cluster, fresh  # noqa: F401 (fresh: a fixture)
from tests.pipeline.pdd_client import Response, chat


pytestmark = pytest.mark.slow

PROMPT = [33 + (i * 11) % 80 for i in range(120)]


async def _request(c: Cluster, pipeline: str | None, n_out: int, after: int = -1, action=None,
                   role: str | None = None, handoff_mode: str | None = None) -> Response:
    """One sampled request; `action()` once position `after` (from `role`, if given) streamed."""
    ext = {"pddgw": {"pipeline": pipeline}} if pipeline else {}
    if handoff_mode:
        ext["pddgw"]["handoff_mode"] = handoff_mode
    r = Response()
    async with aiohttp.ClientSession() as s, s.ws_connect(c.url + "/v1/responses") as ws:
        await ws.send_str(orjson.dumps({"type": "response.create", "prompt_token_ids": PROMPT,
                                        "max_output_tokens": n_out, "temperature": 0.7, "seed": 9,
                                        "return_token_ids": True, **ext}).decode())
        acted = action is None
        async with asyncio.timeout(120):
            while True:
                ev = orjson.loads((await ws.receive()).data)
                r.events.append(ev)
                if (not acted and ev["type"] == "response.output_text.delta" and ev["pddgw"]["position"] >= after
                        and role in (None, ev["pddgw"]["role"])):
                    acted = True
                    action()
                if ev["type"] in ("response.completed", "error"):
                    return r


def _exact(r: Response, c: Cluster, n_out: int) -> None:
    assert r.final["type"] == "response.completed", (r.final, c.log("router"))
    assert r.token_ids == generate_one_node(PROMPT, n_out, 0.7, 9)
    r.assert_positions_once_in_order()


async def test_p_killed_during_prefill_is_redriven_exactly(fresh):
    c = fresh(gbps=0.002)
    r = await _request(c, "P-MD", 200, action=None)       # warm: the WAN estimator, every link
    _exact(r, c, 200)
    loop = asyncio.get_running_loop()
    task = loop.create_task(_request(c, "P-MD", 200))
    # Killed once it prefills (a kill before the router picks it leaves no P to pick at all):
    # its KV crawls over a 2 Mbps WAN for seconds after.
    async with asyncio.timeout(60):
        while (await c.state())["nodes"]["p0"]["inflight"]["transfers"] == 0:
            await asyncio.sleep(0.02)
    await loop.run_in_executor(None, c.kill, "p0")
    r = await task
    _exact(r, c, 200)
    await wait_quiescent(c.state)


async def test_rld_killed_mid_stream_is_redriven_exactly(fresh):
    c = fresh()
    r = await _request(c, "P-RLD", 300, after=5, action=lambda: c.kill("rld0"))
    _exact(r, c, 300)
    tl = r.timeline
    assert tl["redrives"] and tl["tokens_by_role"]["rld"] >= 6 and tl["tokens_by_role"]["md"] > 0, tl
    await wait_quiescent(c.state)


async def test_a_restarting_p_is_waited_for(fresh):
    c = fresh(server="node_wait_s = 120")
    c.kill("p0")
    task = asyncio.get_running_loop().create_task(_request(c, "P-MD", 40))
    await asyncio.sleep(1.0)
    assert not task.done()                                   # waiting for a P, not failed at once
    c.restart("p0")
    r = await task
    _exact(r, c, 40)
    assert r.timeline["redrives"] == [] and r.timeline["pipeline"] == "P-MD"
    assert "waiting_for_node" in c.log("router")
    await wait_quiescent(c.state)


async def test_wan_cut_then_healed(fresh):
    c = fresh(gbps=0.002)
    r = await _request(c, "P-RLD-MD", 300, after=3, action=c.proxy.cut)
    _exact(r, c, 300)
    assert r.timeline["pipeline"] == "P-RLD"                 # RLD finished alone
    c.proxy.heal()
    async with aiohttp.ClientSession() as s, s.ws_connect(c.url + "/v1/responses") as ws:
        for _ in range(600):                                 # until the router's link to MD redialed
            st = await c.state()
            if st["nodes"]["md0"].get("healthy"):
                break
            await asyncio.sleep(0.1)
        r2 = await chat(ws, prompt_token_ids=PROMPT, max_output_tokens=20, temperature=0.7, seed=9,
                        pddgw={"pipeline": "P-MD"})
    _exact(r2, c, 20)
    await wait_quiescent(c.state)


async def test_bandwidth_collapse_mid_request(fresh):
    # 50 Mbps for 1 s, then 0.1 Mbps for 2 s, repeating: transfers and handoff rounds
    # straddle a 500x collapse.
    c = fresh(wan="trace = [[0.0, 0.05], [1.0, 0.0001]]\ntrace_period_s = 3.0")
    rs = await asyncio.gather(*(_request(c, p, 150) for p in ("P-MD", "P-RLD-MD", None)))
    for r in rs:
        _exact(r, c, 150)
    await wait_quiescent(c.state)
