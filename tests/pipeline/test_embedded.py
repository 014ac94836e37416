"""The whole deployment in one process (in-process links, shaped WAN), through the front door.

The tiny model in float64 (clear margins): every path must stream exactly
what one local engine generates.
"""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
import pytest

from pddgw.api.server import build_app
from pddgw.config import (Config, EngineConfig, ModelConfig, NetConfig, NodeConfig, PolicyConfig, ServerConfig,
                          ShapingConfig)
from pddgw.core.roles import Role
from pddgw.deploy.serve import Embedded

from .pdd_client import chat, collect, create, reference

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 8      # layers x (K, V) x kv heads x head dim x float64


def make_cfg(gbps: float = 0.05, **policy) -> Config:
    return Config(model=ModelConfig(dtype="float64"),
                  engine=EngineConfig(num_blocks=256, block_size=16, max_num_batched_tokens=256),
                  net=NetConfig(links=(ShapingConfig(name="wan", gbps=gbps, latency_ms=20.0),)),
                  policy=PolicyConfig(**{"first_token_from_p": True, **policy}),    # the embedded default's
                  server=ServerConfig(max_streams_per_connection=4))


def relay_on_p(cfg: Config) -> Config:
    """The same deployment with P relaying what it prefills (`relay = true`), no RLD node."""
    md_engine = dataclasses.replace(cfg.engine, block_size=32)
    return dataclasses.replace(cfg, nodes=(NodeConfig("router", Role.ROUTER, "A"),
                                           NodeConfig("p0", Role.PREFILL, "A", relay=True),
                                           NodeConfig("md0", Role.MD, "B", engine=md_engine)))


@pytest.fixture
async def deploy(aiohttp_client):
    """-> start(cfg) -> (ws, side, client); everything is stopped and checked for leaks after."""
    started = []

    async def start(cfg: Config):
        emb = Embedded(cfg)
        side = await emb.start()
        client = await aiohttp_client(build_app(side.door))
        ws = await client.ws_connect("/v1/responses")
        started.append((emb, side, client))
        return ws, side, client

    yield start
    for emb, side, _ in started:
        await side.router.drain()
        state = await side.state()
        await emb.stop()
        for name, st in state["nodes"].items():
            assert st["kv_blocks_in_use"] == 0, (name, st)
            assert st["inflight"] == {"requests": 0, "transfers": 0, "sessions": 0, "pins": 0, "streams": 0}, (name, st)


def prompt_of(n: int, start: int = 40) -> list[int]:
    return [start + (i * 7) % 80 for i in range(n)]


async def test_p_md_and_second_turn_sends_only_missing_blocks(deploy):
    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    p1 = prompt_of(150)
    r1 = await chat(ws, prompt_token_ids=p1, max_output_tokens=20, temperature=0)
    assert r1.final["type"] == "response.completed", r1.final
    assert r1.token_ids == reference(p1, 20)
    r1.assert_positions_once_in_order()
    tl = r1.timeline
    # P's first token goes to the client as P samples it, before its KV reaches MD.
    assert (tl["pipeline"], tl["tokens_by_role"]) == ("P-MD", {"prefill": 1, "md": 19})
    assert [d["pddgw"]["role"] for d in r1.deltas] == ["prefill"] + ["md"] * 19
    assert tl["wan_kv_bytes"] == 150 * BYTES_PER_TOKEN          # MD held nothing
    await side.router.drain()
    # Turn 2 re-sends turn 1 + the answer + a new question: MD (block 32) holds
    # the full blocks of what it computed (prompt + answer minus the last token).
    p2 = p1 + r1.token_ids + prompt_of(25, 50)
    r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=8, temperature=0)
    assert r2.token_ids == reference(p2, 8)
    held = (150 + 20 - 1) // 32 * 32
    assert r2.final["response"]["usage"]["input_tokens_details"]["cached_tokens"] == held
    assert r2.timeline["wan_kv_bytes"] == (len(p2) - held) * BYTES_PER_TOKEN


async def test_p_md_first_token_reaches_the_client_before_md_has_the_kv(deploy, monkeypatch):
    """P sends the router its first token as it samples it: the client has it while MD has not
    even taken the KV (held here until the client has it), and then the rest, exact."""
    from pddgw.pipeline.decode import DecodeWorker

    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    gate, kv_done = asyncio.Event(), DecodeWorker.kv_done

    async def held(self, *args):
        await gate.wait()
        return await kv_done(self, *args)

    monkeypatch.setattr(DecodeWorker, "kv_done", held)
    p = prompt_of(100)
    await create(ws, prompt_token_ids=p, max_output_tokens=12, temperature=0)
    first = {}
    async with asyncio.timeout(60):
        while first.get("type") != "response.output_text.delta":
            first = orjson.loads((await ws.receive()).data)
            assert first["type"] not in ("response.completed", "error"), first
    assert not gate.is_set()
    assert (first["pddgw"]["position"], first["pddgw"]["role"], first["pddgw"]["token_ids"]) == (
        0, "prefill", reference(p, 1))
    gate.set()
    r = (await collect(ws))[None]
    r.events.insert(0, first)
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == reference(p, 12)
    r.assert_positions_once_in_order()
    assert r.timeline["tokens_by_role"] == {"prefill": 1, "md": 11}


async def test_p_s_link_closed_as_the_attempt_starts_is_a_lost_p(deploy, monkeypatch):
    """The router's stream on P's link cannot open (the link closed): P is lost for the request,
    which is re-driven on MD (computing the prompt there) and ends exact."""
    from pddgw.net.errors import CloseCode, LinkClosed
    from pddgw.pipeline.request_driver import RequestDriver

    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    run, refused = RequestDriver.run, []

    async def p_closed_first(self):
        if not refused:
            def closed(rid, **kw):
                refused.append(rid)
                raise LinkClosed(f"link to {self.p.name} closed (test)", CloseCode.GOING_AWAY)
            monkeypatch.setattr(self.p.link, "stream", closed)
        return await run(self)

    monkeypatch.setattr(RequestDriver, "run", p_closed_first)
    p = prompt_of(60)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=8, temperature=0)
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == reference(p, 8) and len(refused) == 1
    assert r.timeline["redrives"] and r.timeline["tokens_by_role"] == {"md": 8}


async def test_a_stop_token_first_ends_on_the_decoder_and_p_sends_none_early(deploy):
    """A first token that ends the request (a stop token) is not sent ahead: the decoder emits it
    with the request's end, as before."""
    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    p = prompt_of(40)
    stop = reference(p, 1)[0]
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=12, temperature=0, stop_token_ids=[stop])
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == [stop] and r.timeline["tokens_by_role"] == {"md": 1}


@pytest.mark.parametrize("relay", ["rld node", "relay on p"])
@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
async def test_p_rld_md_handoff_same_tokens(deploy, mode, relay):
    # The tiny model decodes faster than a 40 ms round trip, so catch-up never
    # gets under its threshold by itself: the round cap (2) ends it, after two
    # non-final rounds, well before RLD reaches the end.  403 tokens, as in the
    # stream-interval test below: the handoff ends near token 230 on this machine,
    # which left 300 only ~70 tokens of margin.  The relay is an RLD node, or P itself.
    cfg = make_cfg(pipeline="P-RLD-MD", handoff_mode=mode, catchup_threshold=2, catchup_threshold_md_loaded=2,
                   catchup_max_rounds=2)
    ws, side, _ = await deploy(relay_on_p(cfg) if relay == "relay on p" else cfg)
    p = prompt_of(120)
    n = 403
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=n, temperature=0.8, seed=77)
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == reference(p, n, temperature=0.8, seed=77)
    r.assert_positions_once_in_order()
    tl = r.timeline
    assert tl["pipeline"] == "P-RLD-MD" and tl["handoff_mode"] == mode
    at = tl["handoff_position"]
    # A relaying P emits its first token as the relay; else P's comes straight from P.
    by_role = {"rld": at, "md": n - at} if relay == "relay on p" else {"prefill": 1, "rld": at - 1, "md": n - at}
    assert 0 < at < n and tl["tokens_by_role"] == by_role
    assert [d["pddgw"]["role"] for d in r.deltas] == [role for role, k in by_role.items() for _ in range(k)]
    assert tl["handoff_stall_ms"] is not None and tl["handoff_stall_ms"] >= 20.0  # >= one WAN one-way
    assert tl["wan_kv_bytes"] == 120 * BYTES_PER_TOKEN
    if mode == "catch-up":
        assert len(tl["handoff_positions"]) == 3        # two catch-up rounds, then the final one


@pytest.mark.parametrize("mode", ["one-shot", "catch-up"])
async def test_a_stream_interval_sends_tokens_in_runs_and_keeps_every_path_exact(deploy, mode):
    """engine.stream_interval = 5: RLD and MD send a request's tokens five at a time (the first
    each decodes at once, the last run at the end or at RLD's freeze); same tokens, every
    position once."""
    cfg = make_cfg(pipeline="P-RLD-MD", handoff_mode=mode, catchup_threshold=2, catchup_threshold_md_loaded=2,
                   catchup_max_rounds=2)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, stream_interval=5))
    ws, side, _ = await deploy(cfg)
    # 403 tokens: the KV reaches MD ~90 tokens in and each catch-up round lasts ~57 more, so the
    # handoff ends near token 230 on this machine; with 203 RLD sometimes finished first
    # (handoff_position None, about one run in six).
    p, n = prompt_of(120), 403
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=n, temperature=0.8, seed=77)
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == reference(p, n, temperature=0.8, seed=77)
    r.assert_positions_once_in_order()
    tl = r.timeline
    at = tl["handoff_position"]
    assert tl["pipeline"] == "P-RLD-MD" and 0 < at < n
    assert tl["tokens_by_role"] == {"prefill": 1, "rld": at - 1, "md": n - at}
    sizes = [(d["pddgw"]["role"], len(d["pddgw"]["token_ids"])) for d in r.deltas]
    # P's first token alone, from P; then each decoder's first token alone, runs of five, and
    # what is left at its end (RLD: its freeze).  Where the handoff falls is the WAN's timing, so
    # the pattern is pinned from each side's count; one side holds >= 201 of the 402 tokens.
    assert sizes[0] == ("prefill", 1)
    runs = {}
    for role, count in (("rld", at - 1), ("md", n - at)):
        runs[role] = [k for rl, k in sizes[1:] if rl == role]
        assert runs[role] == [1] + [5] * ((count - 1) // 5) + ([(count - 1) % 5] if (count - 1) % 5 else []), \
            (role, runs[role])
    assert max(len(r) for r in runs.values()) >= 41
    assert sum(k for _, k in sizes) == n


async def test_a_final_handoff_round_md_refuses_is_redriven(deploy, monkeypatch):
    """RLD froze for the final round and MD refused it: the request is re-driven from the
    emitted tokens (it used to wait for tokens nobody would send)."""
    ws, side, _ = await deploy(make_cfg(pipeline="P-RLD-MD", handoff_mode="one-shot"))
    from pddgw.engines.types import RequestError
    from pddgw.pipeline.decode import DecodeWorker

    extend = DecodeWorker.extend
    refused: list[str] = []

    async def refuse_first_final(self, rid, start, ids, final):
        if final and not refused:            # the handoff's final round (the re-drive's passes)
            refused.append(rid)
            raise RequestError(f"request {rid!r}: MD refuses the final round (test)")
        return await extend(self, rid, start, ids, final)

    monkeypatch.setattr(DecodeWorker, "extend", refuse_first_final)
    p = prompt_of(120)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=200, temperature=0.8, seed=5)
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == reference(p, 200, temperature=0.8, seed=5)
    r.assert_positions_once_in_order()
    assert r.timeline["redrives"], r.timeline


async def test_rld_local_and_eager_tokens_first(deploy):
    ws, side, _ = await deploy(make_cfg(pipeline="P-RLD"))
    p = prompt_of(60)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=12, temperature=0)
    assert r.token_ids == reference(p, 12)
    assert r.timeline["pipeline"] == "P-RLD" and r.timeline["tokens_by_role"] == {"prefill": 1, "rld": 11}
    assert r.timeline["wan_kv_bytes"] == 0


async def test_policy_picks_by_missing_kv(deploy):
    """Default policy over a 4 Mbps WAN: a cold 300-token prompt takes P-RLD-MD, its follow-up P-MD."""
    ws, side, _ = await deploy(make_cfg(gbps=0.004))
    p1 = prompt_of(300)
    r1 = await chat(ws, prompt_token_ids=p1, max_output_tokens=10, temperature=0)
    assert r1.timeline["pipeline"] == "P-RLD-MD" and r1.timeline["route_reason"] == "transfer_over_budget"
    assert r1.token_ids == reference(p1, 10)
    await side.router.drain()                 # MD takes the conversation into its cache meanwhile
    p2 = p1 + r1.token_ids + prompt_of(20, 60)
    r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=10, temperature=0)
    assert r2.timeline["pipeline"] == "P-MD" and r2.token_ids == reference(p2, 10)


async def test_chat_text_input_and_multiplexing(deploy):
    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    await create(ws, input="Hello there", max_output_tokens=6, temperature=0, stream_id="a", metadata={"k": "v"})
    await create(ws, input=[{"role": "user", "content": "Second"}], max_output_tokens=4, temperature=0,
                 stream_id="b")
    got = await collect(ws, 2)
    tok = side.door.tok
    for sid, text, n in (("a", "Hello there", 6), ("b", "Second", 4)):
        r = got[sid]
        ids = tok.apply_chat_template([("user", text)])
        assert r.events[0]["type"] == "response.created"
        assert r.final["type"] == "response.completed"
        assert r.token_ids == reference(ids, n)
        assert r.final["response"]["output"][0]["content"][0]["text"] == tok.decode(r.token_ids)
        assert "".join(d["delta"] for d in r.deltas) == tok.decode(r.token_ids)
    assert got["a"].final["response"]["metadata"] == {"k": "v"}


async def test_cancel_frees_everything(deploy):
    ws, side, _ = await deploy(make_cfg(pipeline="P-RLD-MD", gbps=0.001))
    await create(ws, prompt_token_ids=prompt_of(100), max_output_tokens=400, temperature=0)
    rid = None
    while rid is None or True:
        ev = await asyncio.wait_for(ws.receive_json(), 30)
        if ev["type"] == "response.created":
            rid = ev["response"]["id"]
        if ev["type"] == "response.output_text.delta" and ev["pddgw"]["position"] >= 3:
            break
    await ws.send_json({"type": "response.cancel", "response_id": rid})
    while True:
        ev = await asyncio.wait_for(ws.receive_json(), 30)
        if ev["type"] == "error":
            break
    assert ev["error"]["code"] == "cancelled" and ev["response_id"] == rid
    # The node states are checked by the fixture: no block in use, nothing in flight.


async def test_bad_input_gets_clear_errors_and_node_keeps_serving(deploy):
    ws, side, _ = await deploy(make_cfg(pipeline="P-MD"))
    r = await chat(ws, prompt_token_ids=[1] * 5000, max_output_tokens=4)
    assert r.final["type"] == "error" and r.final["error"]["code"] == "context_length_exceeded"
    assert r.final["error"]["param"] == "prompt_token_ids"
    r = await chat(ws, input="x" * 5000, max_output_tokens=4)
    assert r.final["error"]["code"] == "context_length_exceeded" and r.final["error"]["param"] == "input"
    r = await chat(ws, prompt_token_ids=[1, 99999])
    assert r.final["error"]["param"] == "prompt_token_ids"
    await ws.send_str("{oops")
    ev = await asyncio.wait_for(ws.receive_json(), 10)
    assert ev["type"] == "error" and "not valid JSON" in ev["error"]["message"]
    r = await chat(ws, prompt_token_ids=prompt_of(10), max_output_tokens=3, temperature=0)
    assert r.token_ids == reference(prompt_of(10), 3)


async def test_api_key_required_when_configured(aiohttp_client):
    cfg = make_cfg()
    from dataclasses import replace
    cfg = replace(cfg, server=replace(cfg.server, api_keys=("sekrit-key",)))
    emb = Embedded(cfg)
    side = await emb.start()
    try:
        client = await aiohttp_client(build_app(side.door))
        async with client.get("/v1/responses") as resp:
            assert resp.status == 401
        ws = await client.ws_connect("/v1/responses", headers={"Authorization": "Bearer sekrit-key"})
        r = await chat(ws, prompt_token_ids=prompt_of(8), max_output_tokens=2, temperature=0)
        assert r.final["type"] == "response.completed"
        await ws.close()
    finally:
        await emb.stop()


async def test_refusing_prefill_is_retried_on_another(deploy):
    """Two P nodes; p0's pool is too small for the prompt and refuses it: p1 serves it."""
    from dataclasses import replace

    from pddgw.config import NodeConfig

    base = make_cfg(pipeline="P-MD")
    # Least-loaded choice (no prefix affinity): with both idle, p0 is tried first.
    base = replace(base, policy=replace(base.policy, prefix_affinity=False))
    small = replace(base.engine, num_blocks=4, max_num_batched_tokens=64, max_num_seqs=4)
    nodes = (NodeConfig("router", "router", "A"), NodeConfig("p0", "prefill", "A", engine=small),
             NodeConfig("p1", "prefill", "A"), NodeConfig("rld0", "rld", "A"), NodeConfig("md0", "md", "B"))
    ws, side, _ = await deploy(replace(base, nodes=nodes))
    p = prompt_of(100)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=10, temperature=0, pddgw={"states": True})
    assert r.final["type"] == "response.completed", r.final
    assert r.token_ids == reference(p, 10)
    tl = r.timeline
    assert [x["reason"] for x in tl["redrives"]][0].startswith("prefill p0")
    assert any(st["reason"] == "P p1" for st in tl["states"] if st["state"] == "PREFILLING")


async def test_a_full_prefill_link_queues_requests_instead_of_losing_p(deploy):
    """net.max_inflight_requests = 4: the router runs at most three prefills at once on P (a
    quarter of its link stays for control requests) and a decoder's `overloaded` refusal is a
    full node, so no request sees a node lost (before, P's or MD's refusal re-drove); of twelve
    requests arriving together, those beyond wait in the room queue until prefills end."""
    cfg = make_cfg(pipeline="P-MD")
    cfg = dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, max_inflight_requests=4))
    ws, side, client = await deploy(cfg)
    sockets = [ws] + [await client.ws_connect("/v1/responses") for _ in range(2)]
    prompts = {str(i): prompt_of(200, 40 + i) for i in range(12)}
    for i, (sid, p) in enumerate(prompts.items()):
        await create(sockets[i % 3], prompt_token_ids=p, max_output_tokens=4, temperature=0, stream_id=sid)
    got = {}
    for sock in sockets:
        got.update(await collect(sock, 4))
    for sid, p in prompts.items():
        r = got[sid]
        assert r.final["type"] == "response.completed", r.final
        assert r.token_ids == reference(p, 4)
        assert r.timeline["redrives"] == [], r.timeline["redrives"]
    assert side.router.counts.redrives == 0
    assert side.router.room.waited >= 1
    assert {n.name: n.prefills for n in side.router.nodes.values()} == {"p0": 0, "rld0": 0, "md0": 0}
    for sock in sockets[1:]:
        await sock.close()


async def test_router_balances_instances_of_a_role(deploy):
    """Two RLDs: a burst of concurrent requests is spread over both."""
    from dataclasses import replace

    from pddgw.config import NodeConfig

    base = make_cfg(pipeline="P-RLD")
    nodes = (NodeConfig("router", "router", "A"), NodeConfig("p0", "prefill", "A"),
             NodeConfig("rld0", "rld", "A"), NodeConfig("rld1", "rld", "A"), NodeConfig("md0", "md", "B"))
    ws, side, _ = await deploy(replace(base, nodes=nodes))
    for i in range(4):
        await create(ws, prompt_token_ids=prompt_of(30, 40 + i), max_output_tokens=30, temperature=0,
                     stream_id=str(i))
    got = await collect(ws, 4)
    assert all(r.final["type"] == "response.completed" for r in got.values())
    for i in range(4):
        assert got[str(i)].token_ids == reference(prompt_of(30, 40 + i), 30)
    st = await side.state()
    # Each RLD took part: its engine saw prompts (prefix queries count every admitted prompt).
    assert st["nodes"]["rld0"]["prefix_query_tokens"] > 0 and st["nodes"]["rld1"]["prefix_query_tokens"] > 0
    assert {n.name: n.inflight for n in side.router.nodes.values()} == {
        "p0": 0, "rld0": 0, "rld1": 0, "md0": 0}


async def test_serves_a_hugging_face_checkpoint_on_every_role(deploy, tmp_path):
    """model.path (`--model DIR`): every role loads the checkpoint; outputs match one local engine."""
    from dataclasses import replace

    from pddgw.engines.weights import build_tiny, save_hf_checkpoint

    save_hf_checkpoint(build_tiny(0, "float64", "cpu"), tmp_path / "ckpt")
    cfg = make_cfg(pipeline="P-RLD-MD")
    ws, side, _ = await deploy(replace(cfg, model=replace(cfg.model, path=str(tmp_path / "ckpt"))))
    p = prompt_of(80)
    r = await chat(ws, prompt_token_ids=p, max_output_tokens=40, temperature=0)
    assert r.final["response"]["model"] == "ckpt"
    assert r.token_ids == reference(p, 40)


@pytest.mark.parametrize("pipeline", ["P-MD", "P-RLD-MD"])
async def test_a_full_md_batch_makes_imported_requests_wait_their_turn(deploy, pipeline):
    """max_num_seqs = 1 on every node: three requests at once, so RLD's and MD's imported
    requests wait (READY) for the one place in the batch, for ~80-200 steps in all here
    (test_kv_import pins the bound itself).  The pipeline lives with it: every request
    completes with the one-node tokens, on its planned path, nothing leaks."""
    cfg = make_cfg(pipeline=pipeline, handoff_mode="catch-up", catchup_threshold=2,
                   catchup_threshold_md_loaded=2, catchup_max_rounds=2)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_num_seqs=1))
    ws, side, _ = await deploy(cfg)
    prompts = {sid: prompt_of(90 + 10 * i, 40 + i) for i, sid in enumerate("abc")}
    for sid, p in prompts.items():
        await create(ws, stream_id=sid, prompt_token_ids=p, max_output_tokens=60, temperature=0.8, seed=3)
    got = await collect(ws, 3)
    for sid, p in prompts.items():
        r = got[sid]
        assert r.final["type"] == "response.completed", r.final
        assert r.token_ids == reference(p, 60, temperature=0.8, seed=3)
        r.assert_positions_once_in_order()
        assert r.timeline["pipeline"] == pipeline


@pytest.mark.parametrize("pipeline, decoder, blocks", [("P-MD", "md0", 128), ("P-RLD-MD", "rld0", 144)])
async def test_kv_is_cut_at_each_decoders_blocks_and_lands_in_its_pool(aiohttp_client, pipeline, decoder, blocks):
    """MD's blocks are twice P's (the default topology): P cuts MD's chunks at MD's blocks, as
    RLD's at RLD's, so every whole block lands in the decoder's pool as it arrives; only the
    prompt's partial tail is copied.  In-process, P's export writes each chunk into the
    decoder's memory and the link hands it over.  (MD's KV in P-RLD-MD may be cancelled on the
    slow WAN once RLD has finished the request: not counted.)"""
    cfg = make_cfg(pipeline=pipeline)
    # One P block (16 tokens) a chunk, where the chunk size alone decides.
    cfg = dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, kv_frame_bytes=16 * BYTES_PER_TOKEN))
    emb = Embedded(cfg)
    side = await emb.start()
    try:
        assert [n.engine.block_size for n in emb.cfg.nodes if n.engine] == [16, 16, 32]
        client = await aiohttp_client(build_app(side.door))
        ws = await client.ws_connect("/v1/responses")
        prompt = prompt_of(150)
        r = await chat(ws, prompt_token_ids=prompt, max_output_tokens=4, temperature=0)
        assert (r.token_ids, r.timeline["pipeline"]) == (reference(prompt, 4), pipeline)
        await ws.close()
        engine = emb.workers[decoder].engine
        assert (engine.kv_bytes_landed, engine.kv_bytes_copied) == (blocks * BYTES_PER_TOKEN,
                                                                    (150 - blocks) * BYTES_PER_TOKEN)
        inbound = [link.stats for link in emb.net.links if (link.local, link.peer) == (decoder, "p0")]
        assert [(st.kv_bytes_received, st.kv_bytes_handed) for st in inbound] == [(150 * BYTES_PER_TOKEN,) * 2]
    finally:
        await side.router.drain()
        await emb.stop()
