"""A worker node under races and one-way failures (in-process links, real engines).

* A KV chunk MD cannot import fails the request at once: its router hears an
  Error on the request's stream (nobody waits for a reply to P's frames).
* A Cancel that lands while a Submit or a prefix query is still being served
  undoes it when it completes: no session, block or pin is left.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from pddgw.config import EngineConfig
from pddgw.engines.block_manager import chain_hashes
from pddgw.engines.torch_engine import TorchEngine
from pddgw.engines.types import SamplingParams
from pddgw.engines.weights import build_tiny
from pddgw import messages as m
from pddgw.net.errors import RemoteError
from pddgw.net.inproc import InProcNetwork
from pddgw.pipeline.node import WorkerNode

PROMPT = tuple(range(10, 74))      # 64 tokens: 4 blocks of 16


@pytest.fixture(scope="module")
def model():
    return build_tiny(0, torch.float64, "cpu")


@pytest.fixture
async def node(model):
    """-> (the node, a router link to it, a P link to it); the node is checked empty after."""
    net = InProcNetwork()
    eng = TorchEngine(model, model.spec, EngineConfig(num_blocks=64, block_size=16, max_num_batched_tokens=64),
                      torch.float64)
    made: list[WorkerNode] = []

    async def start(role: str):
        async def connect(name: str):
            raise AssertionError(f"no peer {name} in this test")

        w = WorkerNode(role, role, eng, connect)
        made.append(w)
        net.listen(role, w.handle)
        router = await net.connect("router", role)
        p = await net.connect("p0", role)
        return w, router, p

    yield start
    for w in made:
        st = await w.state()
        await w.stop()
        assert (st.kv_blocks_in_use, st.requests, st.sessions, st.pins, st.streams) == (0, 0, 0, 0, 0), st
    await net.close()


def submit(rid: str) -> m.Submit:
    return m.Submit(request_id=rid, kv="import", hold=False, prompt=PROMPT,
                     sampling=SamplingParams(max_tokens=4))


async def test_a_kv_chunk_md_cannot_import_fails_the_request_at_once(node):
    md, router, p = await node("md")
    stream = router.stream("r1", timeout=30)
    opened = await router.request(submit("r1"))
    assert opened == m.Opened("r1", 0)
    spec = md.engine.kv_layout
    # A chunk with the wrong number of KV heads: MD's pool cannot take it.
    heads = spec.num_kv_heads + 1
    span = m.KVSpan("r1", 0, spec.num_layers, 0, 16, "float64", (spec.num_layers, 2, 16, heads, spec.head_dim))
    await p.send(m.KVChunk(span, bytes(span.nbytes), 0, False))
    with pytest.raises(RemoteError) as err:
        async with asyncio.timeout(30):       # far below the request timeout it used to take
            async for _ in stream:
                pass
    assert err.value.code == "request"
    assert "r1" in str(err.value)


async def _cancel_while_engine_waits(w: WorkerNode, method: str, router, request: m.Message, rid: str):
    """Send `request`, and a Cancel that the node serves while the engine call `method` of the
    request is held on the engine thread; -> the reply future."""
    entered, gate = threading.Event(), threading.Event()
    held = getattr(w.engine, method)

    def gated(*args):
        entered.set()
        assert gate.wait(30)
        return held(*args)

    setattr(w.engine, method, gated)
    try:
        reply = asyncio.ensure_future(router.request(request))
        while not entered.is_set():              # the request is inside the engine call
            await asyncio.sleep(0.01)
        await router.send(m.Cancel(rid, "client left"))
        while rid not in w._cancelled:           # the Cancel has been served (it found nothing yet)
            await asyncio.sleep(0.01)
    finally:
        gate.set()
        setattr(w.engine, method, held)
    return reply


async def test_a_cancel_during_submit_leaves_nothing(node):
    md, router, _ = await node("md")
    reply = await _cancel_while_engine_waits(md, "add_request", router, submit("r2"), "r2")
    try:
        got = await reply
    except RemoteError as e:
        got = e
    assert isinstance(got, RemoteError) and "cancelled while opening" in str(got), got
    assert md.decode.sessions == {}


async def test_a_cancel_during_a_prefix_query_releases_the_pin(node):
    p_node, router, _ = await node("prefill")
    hashes = tuple(chain_hashes(PROMPT, 16))
    reply = await _cancel_while_engine_waits(p_node, "match_prefix", router, m.PrefixQuery("r3", hashes), "r3")
    with pytest.raises(RemoteError) as err:
        await reply
    assert "was cancelled" in str(err.value)
