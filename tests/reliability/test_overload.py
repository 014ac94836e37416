"""A full cluster queues and pushes back; it never reports healthy nodes as lost.

A real `pddgw serve` process whose decoders hold about ten requests' KV is
offered more concurrent requests than that.  With the queue bound above the
offered load every request completes with exactly the tokens one local engine
generates; with a tiny bound the surplus is refused with `overloaded`, and
nothing else goes wrong.  Either way nothing is left in use afterwards.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from pddgw.harness.leaks import wait_quiescent
from tests.pipeline.pdd_client import chat, reference

from .served import Served

OFFERED = 24
MAX_TOKENS = 24


def config(max_queued: int) -> str:
    # P / RLD: 64 blocks of 16 tokens; MD: 64 blocks of 32.  A 150-token prompt with
    # its output needs 6 MD blocks: about ten requests fit at once.
    return f'''
[model]
dtype = "float64"

[engine]
num_blocks = 64
block_size = 16
max_num_batched_tokens = 256

[server]
max_queued_requests = {max_queued}
max_queue_wait_s = 300

[[net.links]]
name = "wan"
gbps = 0.05
latency_ms = 10.0
'''


def prompt(i: int) -> list[int]:
    return [(i * 31 + j * 7) % 90 + 10 for j in range(150)]


async def offer(served: Served) -> list:
    async with aiohttp.ClientSession() as s:
        async def one(i: int):
            async with s.ws_connect(served.ws_url) as ws:
                return await chat(ws, timeout=300, prompt_token_ids=prompt(i), max_output_tokens=MAX_TOKENS,
                                  temperature=0)

        return await asyncio.gather(*(one(i) for i in range(OFFERED)))


@pytest.fixture
def served(tmp_path):
    started: list[Served] = []

    def start(cfg: str) -> Served:
        s = Served(tmp_path, cfg).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


async def test_more_requests_than_kv_room_all_complete_exactly(served):
    srv = served(config(max_queued=256))
    responses = await offer(srv)
    finals = [r.final for r in responses]
    assert [f["type"] for f in finals] == ["response.completed"] * OFFERED, [
        f["error"] for f in finals if f["type"] == "error"]
    for i, r in enumerate(responses):
        assert r.token_ids == reference(prompt(i), MAX_TOKENS), i
        r.assert_positions_once_in_order()
    log = srv.log()
    assert "node_lost" not in log
    assert "request_queued" in log           # the decoders were really full
    state = await wait_quiescent(srv.state)
    assert state["router"]["pipelines"]["redrives"] == 0


async def test_a_queue_bound_below_the_load_refuses_with_overloaded_only(served):
    srv = served(config(max_queued=1))
    responses = await offer(srv)
    codes = sorted({r.final["error"]["code"] for r in responses if r.final["type"] == "error"})
    done = [i for i, r in enumerate(responses) if r.final["type"] == "response.completed"]
    assert codes == ["overloaded"]
    refused = [r.final["error"]["message"] for r in responses if r.final["type"] == "error"]
    assert all("server.max_queued_requests = 1" in m for m in refused), refused
    assert 0 < len(done) < OFFERED
    for i in done:
        assert responses[i].token_ids == reference(prompt(i), MAX_TOKENS), i
    assert "node_lost" not in srv.log()
    await wait_quiescent(srv.state)
