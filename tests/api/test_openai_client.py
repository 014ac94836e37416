"""The OpenAI HTTP API through the official `openai` client, against the embedded deployment.

The tiny model in float64 (clear margins), so greedy outputs must equal what
one local engine generates (`reference`) token for token.  The app serves on
a real 127.0.0.1 port (`aiohttp_client`), which `AsyncOpenAI` dials.
"""

from __future__ import annotations

import asyncio
import importlib.util

import aiohttp
import openai
import orjson
import pytest
from openai import AsyncOpenAI

from pddgw.config import Config, EngineConfig, ModelConfig
from pddgw.harness.leaks import wait_quiescent
from pddgw.core.tokens import TokenRun
from pddgw.pipeline.router import RouterError
from tests.api.deployment import ADMIN, KEY, make_cfg
from tests.pipeline.pdd_client import reference

SYSTEM = "You are a terse assistant. Answer in one short line, then stop. " * 2


def chat_ids(side, messages: list[tuple[str, str]]) -> list[int]:
    """The prompt the server builds for these messages (its chat template)."""
    return side.door.tok.apply_chat_template(messages)


async def test_chat_completions_greedy_stream_and_not_and_a_second_turn_hits_md_cache(deployment):
    side, _, oai = await deployment()
    tok = side.door.tok
    msgs = [("system", SYSTEM), ("user", "Name a colour.")]
    ids1 = chat_ids(side, msgs)
    ref1 = reference(ids1, 12)
    r = await oai.chat.completions.create(model=side.door.model_name, max_tokens=12, temperature=0,
                                          messages=[{"role": r, "content": c} for r, c in msgs],
                                          extra_body={"return_token_ids": True})
    assert r.object == "chat.completion" and r.model == side.door.model_name
    ch = r.choices[0]
    assert ch.message.role == "assistant" and ch.message.content == tok.decode(ref1)
    assert ch.finish_reason == ("length" if len(ref1) == 12 else "stop")
    assert ch.token_ids == r.pddgw["output_token_ids"] == ref1 and r.prompt_token_ids == ids1
    spans = r.pddgw["spans"]
    assert [s["start"] for s in spans] == [sum(x["count"] for x in spans[:i]) for i in range(len(spans))]
    assert sum(s["count"] for s in spans) == len(ref1)
    assert r.usage.prompt_tokens == len(ids1) and r.usage.completion_tokens == len(ref1)
    assert r.usage.total_tokens == len(ids1) + len(ref1)
    assert r.usage.prompt_tokens_details.cached_tokens == 0          # MD held nothing yet
    await side.router.drain()

    # Turn 2 extends turn 1 (its answer as text, then a new question), streamed with usage.
    msgs2 = [*msgs, ("assistant", ch.message.content), ("user", "And another?")]
    ids2 = chat_ids(side, msgs2)
    ref2 = reference(ids2, 10)
    stream = await oai.chat.completions.create(
        model=side.door.model_name, max_completion_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": r, "content": c} for r, c in msgs2],
        extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].prompt_token_ids == ids2
    runs = [c.pddgw for c in chunks if c.choices and getattr(c, "pddgw", None) and "position" in c.pddgw]
    assert [t for run in runs for t in run["token_ids"]] == ref2
    assert [t for c in chunks[1:] if c.choices for t in c.choices[0].token_ids] == ref2
    assert [run["position"] for run in runs] == [sum(len(x["token_ids"]) for x in runs[:i]) for i in range(len(runs))]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == tok.decode(ref2)
    last, usage = chunks[-2], chunks[-1]
    assert last.choices[0].finish_reason in ("length", "stop") and last.pddgw["output_token_ids"] == ref2
    assert usage.choices == [] and usage.usage.prompt_tokens == len(ids2)
    assert usage.usage.completion_tokens == len(ref2)
    cached = usage.usage.prompt_tokens_details.cached_tokens
    turn1 = [*ids1, *ref1]
    common = next((i for i, (a, b) in enumerate(zip(turn1, ids2, strict=False)) if a != b), len(turn1))
    assert 0 < cached <= common and cached % 16 == 0, (cached, common)


async def test_completions_with_text_and_token_id_prompts(deployment):
    side, _, oai = await deployment()
    tok = side.door.tok
    text = "Once upon a time"
    ref = reference(tok.encode(text), 8)
    r = await oai.completions.create(model=side.door.model_name, prompt=text, max_tokens=8, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert r.object == "text_completion" and r.choices[0].text == tok.decode(ref)
    assert r.choices[0].token_ids == r.pddgw["output_token_ids"] == ref
    assert r.choices[0].prompt_token_ids == tok.encode(text) and r.usage.prompt_tokens == len(tok.encode(text))

    ids = [40 + (i * 7) % 80 for i in range(50)]
    ref = reference(ids, 9)
    stream = await oai.completions.create(model=side.door.model_name, prompt=ids, max_tokens=9, temperature=0,
                                          stream=True, stream_options={"include_usage": True},
                                          extra_body={"return_token_ids": True})
    chunks = [c async for c in stream]
    got = [t for c in chunks if c.choices and "position" in (getattr(c, "pddgw", None) or {})
           for t in c.pddgw["token_ids"]]
    assert got == ref == [t for c in chunks if c.choices for t in c.choices[0].token_ids]
    assert chunks[0].choices[0].prompt_token_ids == ids
    assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(ref)
    assert chunks[-1].usage.completion_tokens == len(ref) and chunks[-1].usage.prompt_tokens == 50


async def test_responses_stream_and_not(deployment):
    side, _, oai = await deployment()
    tok = side.door.tok
    ids = chat_ids(side, [("system", "Be brief."), ("user", "Hello")])
    ref = reference(ids, 10)
    events = [e async for e in await oai.responses.create(
        model=side.door.model_name, instructions="Be brief.", input="Hello", max_output_tokens=10, temperature=0,
        stream=True, extra_body={"return_token_ids": True})]
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [t for d in deltas for t in d.pddgw["token_ids"]] == ref
    final = events[-1].response
    assert final.status == "completed" and final.output_text == tok.decode(ref)
    assert final.usage.input_tokens == len(ids) and final.usage.output_tokens == len(ref)
    assert final.usage.input_tokens_details.cached_tokens == 0
    assert final.pddgw["output_token_ids"] == ref and final.pddgw["pipeline"] == "P-MD"

    r = await oai.responses.create(model=side.door.model_name, instructions="Be brief.", input="Hello",
                                   max_output_tokens=10, temperature=0, extra_body={"return_token_ids": True})
    assert r.status == "completed" and r.output_text == tok.decode(ref) and r.pddgw["output_token_ids"] == ref
    assert r.usage.input_tokens_details.cached_tokens > 0         # the same prompt again: MD holds it


async def test_models(deployment):
    side, _, oai = await deployment()
    models = [m async for m in oai.models.list()]
    assert [(m.id, m.object, m.owned_by) for m in models] == [(side.door.model_name, "model", "pddgw")]
    assert (await oai.models.retrieve(side.door.model_name)).id == side.door.model_name
    with pytest.raises(openai.NotFoundError) as ei:
        await oai.models.retrieve("gpt-nope")
    assert ei.value.body["code"] == "model_not_found"


async def test_responses_connect_over_websocket(deployment):
    if importlib.util.find_spec("websockets") is None:      # openai's responses.connect() dials with it
        pytest.skip("openai.responses.connect() needs the `websockets` package (the openai[realtime] extra), "
                    "which is not installed")
    side, _, oai = await deployment()
    ids = chat_ids(side, [("user", "Hi there")])
    ref = reference(ids, 8)
    async with oai.responses.connect() as conn:
        # The connection's create() has no extra_body: pddgw's `return_token_ids` goes in a raw event.
        await conn.send({"type": "response.create", "model": side.door.model_name, "input": "Hi there",
                         "max_output_tokens": 8, "temperature": 0, "return_token_ids": True})
        events = []
        async for ev in conn:
            events.append(ev)
            if ev.type in ("response.completed", "error"):
                break
    assert events[-1].type == "response.completed", events[-1]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [t for d in deltas for t in d.pddgw["token_ids"]] == ref
    assert events[-1].response.usage.output_tokens == len(ref)


# ---- vLLM's sampling extensions: top_k, min_p ----------------------------------------


async def ws_final(client, **fields) -> dict:
    """One response.create over a fresh WebSocket -> its final event."""
    ws = await client.ws_connect("/v1/responses", headers={"Authorization": f"Bearer {KEY}"})
    await ws.send_str(orjson.dumps({"type": "response.create", **fields}).decode())
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed", "error"):
        pass
    await ws.close()
    return ev


async def test_top_k_and_min_p_reach_the_engine_sampling_on_every_route(deployment, monkeypatch):
    side, client, oai = await deployment()
    name = side.door.model_name
    real = side.router.run
    seen = []

    async def run(rid, prompt, sampling, emit, *rest):
        seen.append(sampling)
        return await real(rid, prompt, sampling, emit, *rest)

    monkeypatch.setattr(side.router, "run", run)
    for asked, top_k, min_p in (({"top_k": 40, "min_p": 0.05}, 40, 0.05), ({"top_k": -1}, 0, 0.0), ({}, 0, 0.0)):
        seen.clear()
        await oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          temperature=0.8, seed=3, extra_body=asked)
        await oai.completions.create(model=name, prompt="x", max_tokens=2, temperature=0.8, seed=3, extra_body=asked)
        await oai.responses.create(model=name, input="x", max_output_tokens=2, temperature=0.8,
                                   extra_body={"seed": 3, **asked})
        ev = await ws_final(client, input="x", max_output_tokens=2, temperature=0.8, seed=3, **asked)
        assert ev["type"] == "response.completed", ev
        assert [(p.temperature, p.top_p, p.top_k, p.min_p, p.seed) for p in seen] == [(0.8, 1.0, top_k, min_p, 3)] * 4


async def test_top_k_1_and_min_p_1_draw_exactly_the_greedy_tokens(deployment):
    """Each keeps only the most probable token (min_p 1: p >= p_max), so temperature 1 must draw greedy's."""
    side, client, oai = await deployment()
    name = side.door.model_name
    ids = [40 + (i * 7) % 80 for i in range(30)]
    msgs = [("user", "Name a colour.")]
    ref, chat_ref = reference(ids, 8), reference(chat_ids(side, msgs), 8)
    # Seeds whose unfiltered draw at temperature 1 differs from greedy's at position 0 (in P-MD P draws
    # it, MD the rest): a filter dropped on any node shows.
    seed, chat_seed = 0, 2
    assert reference(ids, 8, temperature=1.0, seed=seed)[0] != ref[0]
    assert reference(chat_ids(side, msgs), 8, temperature=1.0, seed=chat_seed)[0] != chat_ref[0]
    for only_argmax in ({"top_k": 1}, {"min_p": 1.0}):
        ask = {**only_argmax, "return_token_ids": True}
        r = await oai.completions.create(model=name, prompt=ids, max_tokens=8, temperature=1.0, seed=seed,
                                         extra_body=ask)
        assert r.choices[0].token_ids == ref, only_argmax
        c = await oai.chat.completions.create(model=name, messages=[{"role": who, "content": t} for who, t in msgs],
                                              max_tokens=8, temperature=1.0, seed=chat_seed, extra_body=ask)
        assert c.choices[0].token_ids == chat_ref, only_argmax
        rs = await oai.responses.create(model=name, max_output_tokens=8, temperature=1.0,
                                        extra_body={"prompt_token_ids": ids, "seed": seed, **ask})
        assert rs.pddgw["output_token_ids"] == ref, only_argmax
        ev = await ws_final(client, prompt_token_ids=ids, max_output_tokens=8, temperature=1.0, seed=seed, **ask)
        assert ev["type"] == "response.completed" and ev["response"]["pddgw"]["output_token_ids"] == ref, ev


# ---- errors ---------------------------------------------------------------------------


async def test_error_shapes_401_400_404(deployment):
    side, client, oai = await deployment()
    name = side.door.model_name
    bad = AsyncOpenAI(api_key="sk-wrong", base_url=str(oai.base_url), max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        await bad.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}])
    assert ei.value.status_code == 401
    assert ei.value.body == {"message": "invalid or missing API key (Authorization: Bearer KEY)",
                             "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}
    with pytest.raises(openai.AuthenticationError):
        await bad.models.list()
    await bad.close()

    cases = [
        (dict(n=17), "n", "invalid_request_error"),
        (dict(stop=["\n"] * 17), "stop", "invalid_request_error"),
        (dict(temperature=3), "temperature", "invalid_request_error"),
        (dict(seed=-1), "seed", "invalid_request_error"),
        (dict(max_tokens=0), "max_tokens", "invalid_request_error"),
        (dict(stream_options={"include_usage": True}), "stream_options", "invalid_request_error"),
        (dict(logit_bias={"1": 101}), "logit_bias", "invalid_request_error"),      # accepted in [-100, 100]
        (dict(extra_body={"top_k": -2}), "top_k", "invalid_request_error"),
        (dict(extra_body={"min_p": 1.5}), "min_p", "invalid_request_error"),
    ]
    for extra, param, code in cases:
        with pytest.raises(openai.BadRequestError) as ei:
            await oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], **extra)
        assert (ei.value.status_code, ei.value.body["param"], ei.value.body["code"]) == (400, param, code), extra
        assert ei.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.chat.completions.create(model=name, messages=[{"role": "narrator", "content": "x"}])
    assert ei.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.completions.create(model=name, prompt=[[1, 2], [3]])
    assert ei.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.completions.create(model=name, prompt=[1] * 5000)
    assert (ei.value.body["param"], ei.value.body["code"]) == ("prompt", "context_length_exceeded")
    with pytest.raises(openai.NotFoundError) as ei:
        await oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert (ei.value.body["code"], ei.value.body["param"]) == ("model_not_found", "model")

    auth = {"Authorization": f"Bearer {KEY}"}
    async with client.post("/v1/chat/completions", data=b"{not json", headers=auth) as resp:
        assert resp.status == 400 and (await resp.json())["error"]["type"] == "invalid_request_error"
    async with client.post("/v1/completions", data=b" " * ((1 << 20) + 1), headers=auth) as resp:
        assert resp.status == 413 and (await resp.json())["error"]["code"] == "request_too_large"
    async with client.get("/v1/nope", headers=auth) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
    async with client.get("/v1/chat/completions", headers=auth) as resp:
        assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("code,status,exc", [("overloaded", 429, openai.RateLimitError),
                                             ("unavailable", 503, openai.InternalServerError),
                                             ("server_error", 500, openai.InternalServerError)])
@pytest.mark.parametrize("stream", [False, True])
async def test_router_errors_map_to_http_status(deployment, monkeypatch, code, status, exc, stream):
    """Before the first token even a streamed answer is a plain HTTP error with its status."""
    side, _, oai = await deployment()

    async def refuses(*args, **kwargs):
        raise RouterError("server overloaded: test", code)

    monkeypatch.setattr(side.router, "run", refuses)
    with pytest.raises(exc) as ei:
        r = await oai.chat.completions.create(model=side.door.model_name, stream=stream,
                                              messages=[{"role": "user", "content": "x"}])
        [c async for c in r]
    assert ei.value.status_code == status
    assert ei.value.body["code"] == code and ei.value.body["message"] == "server overloaded: test"
    assert side.door.active == 0


async def test_an_error_after_the_first_token_ends_the_stream_with_an_error_event(deployment, monkeypatch):
    side, _, oai = await deployment()

    async def fails_midway(rid, prompt, sampling, emit, *rest):
        await emit(TokenRun(rid, 0, (104, 105), role="rld"))
        raise RouterError("no healthy decode node left", "unavailable")

    monkeypatch.setattr(side.router, "run", fails_midway)
    stream = await oai.chat.completions.create(model=side.door.model_name, stream=True,
                                               messages=[{"role": "user", "content": "x"}])
    got = []
    with pytest.raises(openai.APIError) as ei:
        async for c in stream:
            got.append(c)
    assert [c.choices[0].delta.content for c in got] == ["", "hi"] and got[1].pddgw["role"] == "rld"
    assert ei.value.body == {"message": "no healthy decode node left", "type": "server_error", "param": None,
                             "code": "unavailable"}
    events = [e async for e in await oai.responses.create(model=side.door.model_name, input="x", stream=True)]
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "error"]
    assert (events[-1].code, events[-1].message, events[-1].sequence_number) == (
        "unavailable", "no healthy decode node left", len(events))


async def test_front_door_bound_is_429_rate_limit_exceeded(deployment):
    side, _, oai = await deployment(make_cfg(max_concurrent_requests=1))
    with side.door.admission.try_acquire():          # one request in flight elsewhere
        with pytest.raises(openai.RateLimitError) as ei:
            await oai.completions.create(model=side.door.model_name, prompt="x", max_tokens=1)
        assert ei.value.body["code"] == "rate_limit_exceeded"
    assert side.door.active == 0
    await oai.completions.create(model=side.door.model_name, prompt="x", max_tokens=1)    # the slot came back


# ---- who may steer --------------------------------------------------------------------


async def test_steering_needs_an_admin_key_or_allow_request_steering(deployment):
    side, client, oai = await deployment()
    name = side.door.model_name
    steer = {"pddgw": {"pipeline": "P-RLD"}}
    with pytest.raises(openai.PermissionDeniedError) as ei:
        await oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                          extra_body=steer)
    assert ei.value.body == {"message": "forcing pddgw.pipeline needs an admin key ([server] admin_keys) or "
                                        "[server] allow_request_steering = true",
                             "type": "permission_error", "param": "pddgw.pipeline", "code": "permission_denied"}
    with pytest.raises(openai.PermissionDeniedError) as ei:
        await oai.responses.create(model=name, input="x", max_output_tokens=2,
                                   extra_body={"pddgw": {"handoff_mode": "one-shot"}})
    assert ei.value.body["param"] == "pddgw.handoff_mode"
    # An invalid value is still a 400 naming it, whoever asks.
    with pytest.raises(openai.BadRequestError) as ei:
        await oai.completions.create(model=name, prompt="x", extra_body={"pddgw": {"pipeline": "P-X"}})
    assert ei.value.body["param"] == "pddgw.pipeline"

    admin = AsyncOpenAI(api_key=ADMIN, base_url=str(oai.base_url), max_retries=0)
    r = await admin.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                            temperature=0, extra_body=steer)
    assert r.pddgw["pipeline"] == "P-RLD"
    await admin.close()

    # The WebSocket route: an error event naming the field, and the socket keeps serving.
    for key, ok in ((KEY, False), (ADMIN, True)):
        ws = await client.ws_connect("/v1/responses", headers={"Authorization": f"Bearer {key}"})
        await ws.send_str(orjson.dumps({"type": "response.create", "input": "x", "max_output_tokens": 2,
                                        "temperature": 0, "pddgw": {"pipeline": "P-RLD"}}).decode())
        while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed",
                                                                                        "error"):
            pass
        if ok:
            assert ev["type"] == "response.completed" and ev["response"]["pddgw"]["pipeline"] == "P-RLD", ev
        else:
            assert (ev["type"], ev["error"]["code"], ev["error"]["param"]) == (
                "error", "permission_denied", "pddgw.pipeline")
        await ws.close()


async def test_allow_request_steering_lets_any_client_steer(deployment):
    side, _, oai = await deployment(make_cfg(allow_request_steering=True))
    r = await oai.completions.create(model=side.door.model_name, prompt="x", max_tokens=2, temperature=0,
                                     extra_body={"pddgw": {"pipeline": "P-RLD"}})
    assert r.pddgw["pipeline"] == "P-RLD"


# ---- the context, disconnects ---------------------------------------------------------


async def test_max_tokens_past_the_context_is_clamped_and_says_so(deployment):
    cfg = make_cfg()
    cfg = Config(model=ModelConfig(dtype="float64", max_model_len=64), engine=cfg.engine, net=cfg.net,
                 policy=cfg.policy, server=cfg.server)
    side, client, oai = await deployment(cfg)
    ids = [40 + (i * 7) % 80 for i in range(50)]
    ref = reference(ids, 14)
    assert len(ref) == 14                # no stop token before the context is full
    r = await oai.completions.create(model=side.door.model_name, prompt=ids, max_tokens=1000, temperature=0,
                                     extra_body={"return_token_ids": True})
    assert r.choices[0].finish_reason == "length" and r.choices[0].token_ids == ref
    events = [e async for e in await oai.responses.create(
        model=side.door.model_name, max_output_tokens=1000, temperature=0, stream=True,
        extra_body={"prompt_token_ids": ids, "return_token_ids": True})]
    assert events[-1].type == "response.incomplete"
    resp = events[-1].response
    assert (resp.status, resp.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert resp.pddgw["output_token_ids"] == ref
    # Asking for exactly the room left is not a cut.
    r = await oai.responses.create(model=side.door.model_name, max_output_tokens=14, temperature=0,
                                   extra_body={"prompt_token_ids": ids})
    assert r.status == "completed" and r.pddgw["finish_reason"] == "length"
    # Over the WebSocket the last event stays response.completed; its status says incomplete.
    ws = await client.ws_connect("/v1/responses", headers={"Authorization": f"Bearer {KEY}"})
    await ws.send_str(orjson.dumps({"type": "response.create", "prompt_token_ids": ids, "temperature": 0,
                                    "return_token_ids": True}).decode())
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed", "error"):
        pass
    await ws.close()
    assert ev["type"] == "response.completed", ev
    assert (ev["response"]["status"], ev["response"]["incomplete_details"]) == (
        "incomplete", {"reason": "max_output_tokens"})
    assert ev["response"]["pddgw"]["output_token_ids"] == ref


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me everything."}], "stream": True}),
    ("/v1/responses", {"input": "Tell me everything.", "stream": True}),
    ("/v1/completions", {"prompt": "Tell me everything.", "stream": False}),
], ids=["chat-stream", "responses-stream", "completions-not-streamed"])
async def test_client_disconnect_cancels_the_request_everywhere(deployment, route, body):
    side, client, _ = await deployment()
    real = side.router.run
    ended: asyncio.Future[type] = asyncio.get_running_loop().create_future()
    first = asyncio.Event()

    async def run(rid, prompt, sampling, emit, *rest):
        async def spy(r):
            first.set()
            await emit(r)
        try:
            return await real(rid, prompt, sampling, spy, *rest)
        except BaseException as e:
            ended.set_result(type(e))
            raise

    side.router.run = run
    url = f"http://{client.server.host}:{client.server.port}{route}"
    async with aiohttp.ClientSession() as s:
        limit = "max_output_tokens" if route == "/v1/responses" else "max_tokens"
        resp_cm = s.post(url, json={**body, limit: 3000, "temperature": 0}, headers={"Authorization": f"Bearer {KEY}"})
        if body["stream"]:
            resp = await resp_cm
            assert resp.status == 200
            await resp.content.readline()          # the first event is out
            resp.close()                           # drops the connection mid-stream
        else:
            task = asyncio.create_task(resp_cm.__aenter__())
            await first.wait()                     # generating
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    assert await asyncio.wait_for(ended, 60) is asyncio.CancelledError
    await wait_quiescent(side.state)
    assert side.door.active == 0


def _local(prompt, sampling, tok=None) -> list[int]:
    """One local float64 engine's tokens for this exact sampling (the penalties' yardstick); `tok`
    (the model's tokenizer) lets it take a grammar."""
    from pddgw.engines.torch_engine import TorchEngine
    from pddgw.engines.types import EngineRequest
    from pddgw.engines.weights import build_tiny

    model = build_tiny(0, "float64", "cpu")
    eng = TorchEngine(model, model.spec, EngineConfig(num_blocks=256, max_num_batched_tokens=256), model.dtype,
                      tokenizer=tok)
    eng.add_request(EngineRequest("ref", tuple(prompt), sampling))
    out: list[int] = []
    while eng.has_work():
        for o in eng.step():
            out += o.ids
    return out


async def test_penalties_and_logit_bias_through_the_official_client(deployment):
    """frequency / presence penalties (OpenAI's fields), repetition_penalty (vLLM's, extra_body),
    and logit_bias: the tokens equal one local engine's under the same SamplingParams."""
    from pddgw.core.sampling import SamplingParams

    side, _, oai = await deployment()
    tok, name = side.door.tok, side.door.model_name
    text = "Once upon a time there was a"
    ids = tok.encode(text)
    r = await oai.completions.create(model=name, prompt=text, max_tokens=12, temperature=0,
                                     frequency_penalty=1.5, presence_penalty=0.5,
                                     extra_body={"repetition_penalty": 1.3, "return_token_ids": True})
    want = _local(ids, SamplingParams(max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5,
                                      repetition_penalty=1.3))
    assert r.choices[0].token_ids == want
    assert want != reference(ids, 12)             # the penalties changed the greedy tokens
    # A +100 bias makes that token the greedy choice at every position.
    forced = tok.encode("z")[0]
    r = await oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logit_bias={str(forced): 100},
                                          extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == [forced] * 5


async def test_stop_through_the_official_client(deployment):
    """A stop string cuts the chat answer right before its first occurrence, streamed and not; usage
    counts the tokens up to the one that completed it (the greedy tokens of one local engine)."""
    from pddgw.core.sampling import SamplingParams

    side, _, oai = await deployment()
    tok, name = side.door.tok, side.door.model_name
    msgs = [("user", "Tell me a story.")]
    full = _local(chat_ids(side, msgs), SamplingParams(max_tokens=40, ignore_eos=True))
    text = tok.decode(full)
    stop = text[12:14]
    at = text.find(stop)
    kept = next(k for k in range(1, len(full) + 1) if stop in tok.decode(full[:k]))
    assert kept < len(full)                          # the stop cuts inside the output
    kw = dict(model=name, messages=[{"role": r, "content": c} for r, c in msgs], max_tokens=40, temperature=0,
              stop=[stop, "\x00never"], extra_body={"ignore_eos": True, "return_token_ids": True})
    r = await oai.chat.completions.create(**kw)
    ch = r.choices[0]
    assert (ch.message.content, ch.finish_reason) == (text[:at], "stop")
    assert r.usage.completion_tokens == kept and ch.token_ids == r.pddgw["output_token_ids"] == full[:kept]
    chunks = [c async for c in await oai.chat.completions.create(**kw, stream=True,
                                                                 stream_options={"include_usage": True})]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text[:at]
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == kept
    assert [t for c in chunks[1:] if c.choices for t in c.choices[0].token_ids] == full[:kept]


async def test_n_2_through_the_official_client(deployment):
    """n=2: choice i samples as a single request with seed + i, streamed and not; usage counts the
    prompt once and both choices' tokens."""
    side, _, oai = await deployment()
    name = side.door.model_name
    msgs = [{"role": "user", "content": "Name a colour."}]
    kw = dict(model=name, messages=msgs, max_tokens=10, temperature=0.9, extra_body={"ignore_eos": True})
    singles = [(await oai.chat.completions.create(**kw, seed=5 + i)).choices[0].message.content for i in range(2)]
    assert singles[0] != singles[1]
    r = await oai.chat.completions.create(**kw, seed=5, n=2)
    assert [(c.index, c.message.content, c.finish_reason) for c in r.choices] == [
        (0, singles[0], "length"), (1, singles[1], "length")]
    n_prompt = len(chat_ids(side, [("user", "Name a colour.")]))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 2 * 10)
    chunks = [c async for c in await oai.chat.completions.create(**kw, seed=5, n=2, stream=True,
                                                                 stream_options={"include_usage": True})]
    texts = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(2)]
    assert texts == singles
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1] and chunks[-1].usage.completion_tokens == 2 * 10


# ---- tools and structured output: each a greedy decode under the grammar it implies -----

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                 "unit": {"enum": ["c", "f"]}},
                "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": WEATHER_ARGS}}


async def test_tools_with_tool_choice_required_through_the_official_client(deployment):
    """tool_choice="required" (one call): the answer is one call of the tool, its arguments valid
    for its schema, and its tokens are one local engine's greedy decode, on the prompt the
    template renders with the tools, under the call's schema (the built-in template's format:
    {"name": N, "arguments": {...}})."""
    import json

    import jsonschema

    from pddgw.core.sampling import SamplingParams

    side, _, oai = await deployment()
    tok, name = side.door.tok, side.door.model_name
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = await oai.chat.completions.create(model=name, messages=msgs, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=120, temperature=0,
                                          extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert (ch.finish_reason, ch.message.content) == ("tool_calls", None)
    [call] = ch.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather") and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_ARGS)
    call_schema = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": WEATHER_ARGS},
                   "required": ["name", "arguments"], "additionalProperties": False}
    want = _local(tok.apply_chat_template(msgs, tools=[WEATHER]),
                  SamplingParams(max_tokens=120, grammar=("json_schema", json.dumps(call_schema))), tok)
    assert ch.token_ids == want
    assert json.loads(tok.decode(want)) == {"name": "get_weather", "arguments": args}
    assert r.usage.completion_tokens == len(want)


async def test_response_format_json_schema_through_the_official_client(deployment):
    """response_format json_schema: the content is JSON valid for the schema, and its tokens are
    one local engine's greedy decode under that schema (the prompt: the plain chat template)."""
    import json

    import jsonschema

    from pddgw.core.sampling import SamplingParams

    side, _, oai = await deployment()
    tok, name = side.door.tok, side.door.model_name
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8},
                                               "score": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["answer", "score"], "additionalProperties": False}
    msgs = [("user", "Rate this.")]
    r = await oai.chat.completions.create(
        model=name, messages=[{"role": w, "content": c} for w, c in msgs], max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "rating", "schema": schema,
                                                                "strict": True}},
        extra_body={"return_token_ids": True})
    ch = r.choices[0]
    assert ch.finish_reason == "stop" and ch.message.tool_calls is None
    jsonschema.validate(json.loads(ch.message.content), schema)
    want = _local(chat_ids(side, msgs), SamplingParams(max_tokens=60, grammar=("json_schema", json.dumps(schema))),
                  tok)
    assert ch.token_ids == want and ch.message.content == tok.decode(want)
