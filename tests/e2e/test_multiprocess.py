"""End to end: router, P, RLD and MD as separate processes on loopback, a shaped WAN between.

float64 tiny model (clear margins): every path must stream exactly what
`pddgw generate` prints on one node.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from pddgw.harness.reference import generate_cli as generate_one_node
from tests.pipeline.pdd_client import chat, collect, create

from .cluster import Cluster, fresh  # noqa: F401 (fresh: a fixture)

pytestmark = pytest.mark.slow

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 8


def prompt_of(n: int, start: int = 40) -> list[int]:
    return [start + (i * 11) % 80 for i in range(n)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # The tiny model decodes faster than the WAN round trip, so catch-up never
    # gets under its threshold by itself: the round cap ends it after 2 rounds.
    c = Cluster(tmp_path_factory.mktemp("pdd"), policy="catchup_threshold = 2\n"
                "catchup_threshold_md_loaded = 2\ncatchup_max_rounds = 2")
    c.start()
    yield c
    c.stop()


async def ws_to(c: Cluster, session: aiohttp.ClientSession):
    return await session.ws_connect(c.url + "/v1/responses")


CASES = [("P-MD", None), ("P-RLD-MD", "one-shot"), ("P-RLD-MD", "catch-up"), ("P-RLD", None)]


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (0.9, 4242)])
async def test_every_path_streams_what_one_node_generates(cluster, temperature, seed):
    prompt = prompt_of(140)
    n = 240
    expected = generate_one_node(prompt, n, temperature, seed)
    async with aiohttp.ClientSession() as s:
        ws = await ws_to(cluster, s)
        for _, (pipeline, mode) in enumerate(CASES):
            r = await chat(ws, prompt_token_ids=prompt, max_output_tokens=n, temperature=temperature,
                           seed=seed, pddgw={"pipeline": pipeline, "handoff_mode": mode})
            assert r.final["type"] == "response.completed", (pipeline, mode, r.final)
            assert r.token_ids == expected, (pipeline, mode)
            r.assert_positions_once_in_order()
            tl = r.timeline
            assert tl["pipeline"] == pipeline
            if pipeline == "P-RLD-MD":
                assert tl["handoff_mode"] == mode and tl["handoff_position"] > 0, tl
                if mode == "catch-up":
                    assert len(tl["handoff_positions"]) == 3, tl     # 2 catch-up rounds + the final
            if pipeline == "P-RLD":
                assert tl["tokens_by_role"] == {"rld": n}
            await cluster.wait_idle()
        await ws.close()


async def test_second_turn_sends_only_missing_blocks(cluster):
    p1 = prompt_of(200, 45)
    async with aiohttp.ClientSession() as s:
        ws = await ws_to(cluster, s)
        r1 = await chat(ws, prompt_token_ids=p1, max_output_tokens=30, temperature=0, pddgw={"pipeline": "P-MD"})
        hit1 = r1.final["response"]["usage"]["input_tokens_details"]["cached_tokens"]
        assert r1.timeline["wan_kv_bytes"] == (200 - hit1) * BYTES_PER_TOKEN
        await cluster.wait_idle()
        p2 = p1 + r1.token_ids + prompt_of(40, 50)
        r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=10, temperature=0, pddgw={"pipeline": "P-MD"})
        held = (200 + 30 - 1) // 32 * 32       # MD's full blocks of turn 1 (block size 32)
        assert r2.final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == held
        assert r2.timeline["wan_kv_bytes"] == (len(p2) - held) * BYTES_PER_TOKEN
        assert r2.token_ids == generate_one_node(p2, 10)
        await ws.close()
    st = await cluster.wait_idle()
    assert {n: s["kv_blocks_in_use"] for n, s in st["nodes"].items()} == {"p0": 0, "rld0": 0, "md0": 0}


async def test_cancel_mid_stream_frees_every_node(cluster):
    async with aiohttp.ClientSession() as s:
        ws = await ws_to(cluster, s)
        await create(ws, prompt_token_ids=prompt_of(150, 60), max_output_tokens=1500, temperature=0,
                     pddgw={"pipeline": "P-RLD-MD"})
        rid = None
        async with asyncio.timeout(30):
            while True:
                ev = await ws.receive_json()
                if ev["type"] == "response.created":
                    rid = ev["response"]["id"]
                elif ev["type"] == "response.output_text.delta" and ev["pddgw"]["position"] > 5:
                    break
        await ws.send_json({"type": "response.cancel", "response_id": rid})
        got = await collect(ws)
        assert got[None].final["type"] == "error" and got[None].final["error"]["code"] == "cancelled"
        await ws.close()
    await cluster.wait_idle()


# ---- failures: each on its own deployment -------------------------------------------


async def _long_request(c: Cluster, pipeline: str, n_out: int, after: int, action, role: str | None = None):
    """Start a request, run `action` once `after` tokens (from `role`, if given) have streamed."""
    prompt = prompt_of(120, 33)
    async with aiohttp.ClientSession() as s:
        ws = await ws_to(c, s)
        await create(ws, prompt_token_ids=prompt, max_output_tokens=n_out, temperature=0.7, seed=9,
                     pddgw={"pipeline": pipeline})
        events = []
        acted = False
        async with asyncio.timeout(90):
            while True:
                msg = await ws.receive()
                if msg.type != aiohttp.WSMsgType.TEXT:      # the router went away
                    events.append({"type": "closed"})
                    break
                ev = orjson.loads(msg.data)
                events.append(ev)
                if (ev["type"] == "response.output_text.delta" and not acted and ev["pddgw"]["position"] >= after
                        and role in (None, ev["pddgw"]["role"])):
                    acted = True
                    action()
                if ev["type"] in ("response.completed", "error"):
                    break
        await ws.close()
    from tests.pipeline.pdd_client import Response
    return prompt, Response(events)


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD"])
async def test_md_killed_mid_request_still_completes(fresh, pipeline):
    c = fresh(gbps=0.002)            # slow WAN: P-RLD-MD is still before its handoff when MD dies
    # Long enough that MD (P-MD) is still decoding when the kill lands: the tiny model makes
    # a token in about a millisecond.
    n = 1500
    prompt, r = await _long_request(c, pipeline, n, 3, lambda: c.kill("md0"))
    assert r.final["type"] == "response.completed", (r.final, c.log("router"))
    assert r.token_ids == generate_one_node(prompt, n, 0.7, 9)
    r.assert_positions_once_in_order()
    tl = r.timeline
    if pipeline == "P-RLD-MD":
        assert tl["pipeline"] == "P-RLD" and "md0" in tl["fallback_reason"]
    else:
        assert tl["redrives"] and tl["tokens_by_role"].get("rld", 0) > 0
    await c.wait_idle()


async def test_md_killed_after_handoff_is_redriven(fresh):
    c = fresh()                      # fast WAN: MD takes over early
    prompt, r = await _long_request(c, "P-RLD-MD", 600, 0, lambda: c.kill("md0"), role="md")
    assert r.final["type"] == "response.completed", (r.final, c.log("router"))
    assert r.token_ids == generate_one_node(prompt, 600, 0.7, 9)
    r.assert_positions_once_in_order()
    tl = r.timeline
    assert tl["handoff_position"] is not None and tl["redrives"], tl
    roles = [d["pddgw"]["role"] for d in r.deltas]
    first_md = roles.index("md")
    assert "rld" in roles[first_md:]            # the re-drive went back to RLD (MD is gone)
    await c.wait_idle()


async def test_wan_cut_mid_request_still_completes(fresh):
    c = fresh(gbps=0.002)
    prompt, r = await _long_request(c, "P-RLD-MD", 400, 3, c.proxy.cut)
    assert r.final["type"] == "response.completed", (r.final, c.log("router"))
    assert r.token_ids == generate_one_node(prompt, 400, 0.7, 9)
    assert r.timeline["pipeline"] == "P-RLD"
    await c.wait_idle()


async def test_prefill_refusal_is_retried_elsewhere(fresh):
    # P's pool holds 4 blocks of 16 = 64 tokens: a 120-token prompt is refused by P.
    c = fresh(p_engine="num_blocks = 4\nmax_num_batched_tokens = 64\nmax_num_seqs = 4")
    prompt = prompt_of(120, 33)
    async with aiohttp.ClientSession() as s:
        ws = await ws_to(c, s)
        r = await chat(ws, prompt_token_ids=prompt, max_output_tokens=20, temperature=0, pddgw={"pipeline": "P-MD"})
        await ws.close()
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == generate_one_node(prompt, 20)
    assert "refused" in r.timeline["redrives"][0]["reason"] or "prefill" in r.timeline["redrives"][0]["reason"]
    await c.wait_idle()


async def test_router_death_frees_every_worker(fresh):
    """The router dies mid-request: every worker frees what it opened or pinned for it."""
    import time

    c = fresh(gbps=0.002)
    _, r = await _long_request(c, "P-RLD-MD", 400, 3, lambda: c.kill("router"))
    assert r.final["type"] != "response.completed"           # the socket died with the router
    ports = {"p0": c.ports["p0"], "rld0": c.ports["rld0"], "md0": c.ports["md0"]}
    deadline = time.monotonic() + 20
    async with aiohttp.ClientSession() as s:
        for name, port in ports.items():
            while True:
                async with s.get(f"http://127.0.0.1:{port}/debug/state",
                                 headers={"Authorization": f"Bearer {Cluster.SECRET}"}) as resp:
                    st = await resp.json()
                if st["kv_blocks_in_use"] == 0 and not any(st["inflight"].values()):
                    break
                assert time.monotonic() < deadline, (name, st)
                await asyncio.sleep(0.2)
