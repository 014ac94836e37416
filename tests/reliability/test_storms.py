"""Cancel and disconnect storms leave nothing behind on any node.

Against a real `pddgw serve` process: responses cancelled right after
`response.created` (and a little later, mid-prefill or mid-stream), then
client sockets torn down (TCP reset) at the same moments.  Afterwards no KV
block, prefix pin, session, transfer, engine stream or router entry is left,
and the server still answers a request with exactly the reference tokens.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from pddgw.harness.leaks import wait_quiescent
from tests.pipeline.pdd_client import chat, reference

from .served import Served

CONFIG = '''
[model]
dtype = "float64"

[server]
allow_request_steering = true       # the storms force each pipeline per request

[engine]
num_blocks = 128
block_size = 16
max_num_batched_tokens = 256

[[net.links]]
name = "wan"
gbps = 0.02
latency_ms = 10.0
'''

SHARED = [(j * 13) % 90 + 10 for j in range(200)]     # a system prompt every request starts with


def prompt(i: int) -> list[int]:
    return SHARED + [(i * 17 + j) % 90 + 10 for j in range(10 + i % 40)]


@pytest.fixture
def served(tmp_path):
    srv = Served(tmp_path, CONFIG).start()
    yield srv
    srv.stop()


async def _created(ws) -> str:
    while True:
        ev = orjson.loads((await ws.receive()).data)
        if ev["type"] == "response.created":
            return ev["response"]["id"]


async def _create(ws, i: int, pipeline: str) -> None:
    ext = {"pddgw": {"pipeline": pipeline}} if pipeline else {}
    await ws.send_str(orjson.dumps({"type": "response.create", "prompt_token_ids": prompt(i),
                                    "max_output_tokens": 200, "temperature": 0, **ext}).decode())


PIPELINES = ("P-MD", "P-RLD-MD", "P-RLD", None)     # None: the policy decides


async def test_cancel_storm(served):
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> dict:
            async with s.ws_connect(served.ws_url) as ws:
                await _create(ws, i, PIPELINES[i % 4])
                rid = await _created(ws)
                await asyncio.sleep((i % 5) * 0.02)      # at created, and a little later
                await ws.send_str(orjson.dumps({"type": "response.cancel", "response_id": rid}).decode())
                while True:
                    ev = orjson.loads((await ws.receive()).data)
                    if ev["type"] in ("error", "response.completed"):
                        return ev

        ends = await asyncio.gather(*(one(i) for i in range(40)))
    # A response may finish before its cancel lands; none ends any other way.
    assert {e["type"] if e["type"] != "error" else e["error"]["code"] for e in ends} <= {
        "cancelled", "response.completed"}
    await wait_quiescent(served.state)
    await _still_serves(served)


async def test_disconnect_storm(served):
    async with aiohttp.ClientSession() as s:
        async def one(i: int) -> None:
            ws = await s.ws_connect(served.ws_url)
            await _create(ws, i, PIPELINES[i % 4])
            await _created(ws)
            await asyncio.sleep((i % 5) * 0.02)
            ws._response.connection.transport.abort()      # TCP reset: no close handshake
            await ws.close()

        await asyncio.gather(*(one(i) for i in range(100)))
    await wait_quiescent(served.state)
    await _still_serves(served)


async def _still_serves(served: Served) -> None:
    async with aiohttp.ClientSession() as s, s.ws_connect(served.ws_url) as ws:
        r = await chat(ws, prompt_token_ids=prompt(7), max_output_tokens=16, temperature=0)
    assert r.token_ids == reference(prompt(7), 16)
    await wait_quiescent(served.state)
