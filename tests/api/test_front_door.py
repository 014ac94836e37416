"""The front door over a real socket: bad events get error events, broken frames close with RFC codes.

An embedded deployment (tiny model) behind `aiohttp_client`, which serves on
a real TCP port, so `RawWs` can send frames no client library would.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest

from pddgw.api import responses_ws
from pddgw.api.server import build_app
from pddgw.config import Config, ServerConfig
from pddgw.deploy.serve import Embedded
from pddgw.harness.leaks import wait_quiescent

from .ws_raw import BINARY, PING, TEXT, RawWs, frame

MAX_MESSAGE = 4096


@pytest.fixture
async def door(aiohttp_client):
    """-> (RouterSide, test client); after the test nothing may be left in use."""
    emb = Embedded(Config(server=ServerConfig(max_message_bytes=MAX_MESSAGE, max_streams_per_connection=1)))
    side = await emb.start()
    client = await aiohttp_client(build_app(side.door))
    yield side, client
    await wait_quiescent(side.state)
    await emb.stop()


async def raw(client) -> RawWs:
    return await RawWs.connect(client.server.host, client.server.port)


def create(**fields) -> bytes:
    return orjson.dumps({"type": "response.create", **fields})


async def completes(client, **fields) -> dict:
    """A fresh client connection runs one small request to its end -> the final event."""
    ws = await client.ws_connect("/v1/responses")
    await ws.send_bytes(create(input="hi", max_output_tokens=2, temperature=0, **fields))
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed", "error"):
        pass
    await ws.close()
    assert ev["type"] == "response.completed", ev
    return ev


@pytest.mark.parametrize("opcode,payload", [(TEXT, create(input="hi", max_output_tokens=1)), (PING, b"ping")],
                         ids=["text", "ping"])
async def test_unmasked_client_frame_closes_with_1002_and_the_server_keeps_serving(door, opcode, payload):
    side, client = door
    ws = await raw(client)
    # A masked event first: it is answered; the unmasked frame after it fails the connection.
    await ws.send(frame(TEXT, b"[]"), frame(opcode, payload, mask=False))
    assert await ws.close_code() == 1002
    assert [(e["type"], e["error"]["message"]) for e in ws.events] == [("error", "event must be a JSON object")]
    assert await ws.at_eof()
    assert side.door.active == 0
    await completes(client)


async def test_an_unmasked_frame_is_refused_from_its_head_split_over_writes(door):
    side, client = door
    ws = await raw(client)
    await ws.send(frame(TEXT, b"[]"))
    for b in frame(TEXT, create(input="hi", max_output_tokens=1), mask=False)[:2]:   # its head; no payload
        await asyncio.sleep(0.05)
        await ws.send(bytes([b]))
    assert await ws.close_code() == 1002
    assert [e["type"] for e in ws.events] == ["error"]
    assert await ws.at_eof()
    await completes(client)


async def test_a_frame_sent_before_the_101_closes_with_1002(door):
    side, client = door
    ws = await RawWs.connect(client.server.host, client.server.port,
                             early=frame(TEXT, create(input="hi", max_output_tokens=1)))
    assert await ws.close_code() == 1002
    assert ws.events == []
    assert await ws.at_eof()
    assert side.door.active == 0
    await completes(client)


@pytest.mark.parametrize("frames,code", [
    ([frame(TEXT, b'{"type": "\xff"}')], 1007),                         # text frames must be UTF-8
    ([frame(TEXT, length=MAX_MESSAGE + 1)], 1009),                        # refused from the header alone
    ([frame(TEXT, b"{", fin=False), frame(BINARY, b"}")], 1002),          # a new message inside a fragmented one
    ([frame(TEXT, b"{}", rsv=2)], 1002),                                  # reserved bit, nothing negotiated
    ([frame(0x3, b"{}")], 1002),                                          # reserved opcode
], ids=["invalid-utf8-text", "oversized", "interleaved-fragments", "rsv2", "opcode-3"])
async def test_protocol_errors_close_with_their_rfc_code(door, frames, code):
    side, client = door
    ws = await raw(client)
    await ws.send(*frames)
    assert await ws.close_code() == code
    assert ws.events == []
    assert await ws.at_eof()
    await completes(client)


async def test_a_message_of_exactly_max_message_bytes_is_read(door):
    # Padding a metadata value past its own limit makes the message's answer name that field.
    def sized(n: int) -> bytes:
        base = create(input="x", metadata={"k": ""})
        return create(input="x", metadata={"k": "v" * (n - len(base))})

    assert len(sized(MAX_MESSAGE)) == MAX_MESSAGE
    ws = await raw(door[1])
    await ws.send(frame(TEXT, sized(MAX_MESSAGE)), frame(TEXT, sized(MAX_MESSAGE + 1)))
    assert await ws.close_code() == 1009
    assert [(e["type"], e["error"]["param"]) for e in ws.events] == [("error", "metadata")]


async def test_bad_create_gets_an_error_event_that_echoes_its_stream_id(door):
    _, client = door
    ws = await client.ws_connect("/v1/responses")
    await ws.send_bytes(create(input="x", seed=-1, stream_id="s1"))
    await ws.send_str('{"type": "response.cancel", "response_id": "resp_nope"}')
    assert orjson.loads((await ws.receive()).data) == {
        "type": "error", "sequence_number": 1, "stream_id": "s1",
        "error": {"type": "invalid_request_error", "code": "invalid_request_error",
                  "message": "seed must be an integer in [0, 9223372036854775808), got -1", "param": "seed"}}
    assert orjson.loads((await ws.receive()).data) == {
        "type": "error", "sequence_number": 2,
        "error": {"type": "invalid_request_error", "code": "invalid_request_error",
                  "message": "no response 'resp_nope' in flight on this connection", "param": "response_id"}}
    await ws.close()


async def test_a_bug_while_decoding_an_event_is_an_error_event_and_the_socket_keeps_serving(door, monkeypatch):
    _, client = door
    real = responses_ws.parse_client_event
    calls = []

    def breaks_once(raw, max_prompt):
        calls.append(raw)
        if len(calls) == 1:
            raise KeyError("boom")
        return real(raw, max_prompt)

    monkeypatch.setattr(responses_ws, "parse_client_event", breaks_once)
    ws = await client.ws_connect("/v1/responses")
    await ws.send_bytes(create(input="hi"))
    ev = orjson.loads((await ws.receive()).data)
    assert (ev["type"], ev["error"]["code"], ev["error"]["message"]) == (
        "error", "server_error", "internal error: KeyError: 'boom'")
    await ws.send_bytes(create(input="hi", max_output_tokens=2, temperature=0, stream_id="after"))
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed", "error"):
        pass
    assert (ev["type"], ev["stream_id"]) == ("response.completed", "after")
    await ws.close()


async def test_a_bug_while_preparing_a_response_ends_it_with_an_error_and_frees_its_slot(door, monkeypatch):
    side, client = door
    tok = side.door.tok
    real = tok.apply_chat_template
    calls = []

    def breaks_once(messages):
        calls.append(messages)
        if len(calls) == 1:
            raise UnicodeError("boom")
        return real(messages)

    monkeypatch.setattr(tok, "apply_chat_template", breaks_once)
    ws = await client.ws_connect("/v1/responses")
    await ws.send_bytes(create(input="hi", stream_id="first"))
    ev = orjson.loads((await ws.receive()).data)
    assert (ev["type"], ev["stream_id"], ev["error"]["code"], ev["error"]["message"]) == (
        "error", "first", "server_error", "internal error: UnicodeError: boom")
    assert ev["response_id"].startswith("resp")
    # max_streams_per_connection is 1: the failed response must have given its slot back.
    await ws.send_bytes(create(input="hi", max_output_tokens=2, temperature=0, stream_id="second"))
    while (ev := orjson.loads((await ws.receive(timeout=60)).data))["type"] not in ("response.completed", "error"):
        pass
    assert (ev["type"], ev["stream_id"]) == ("response.completed", "second")
    assert side.door.active == 0
    await ws.close()


async def test_a_browser_key_in_the_websocket_subprotocol_is_accepted_and_echoed(aiohttp_client):
    """Browsers cannot set Authorization on a WebSocket: `pddgw.key.<base64url(key)>` stands in."""
    import base64

    import aiohttp

    emb = Embedded(Config(server=ServerConfig(api_keys=("k\u00e9y-1",))))
    side = await emb.start()
    try:
        client = await aiohttp_client(build_app(side.door))
        good = "pddgw.key." + base64.urlsafe_b64encode("k\u00e9y-1".encode()).decode().rstrip("=")
        ws = await client.ws_connect("/v1/responses", protocols=("other", good))
        assert ws.protocol == good
        await ws.close()
        for offered in (("pddgw.key." + base64.urlsafe_b64encode(b"nope").decode(),), ("pddgw.key.%%%",), ()):
            with pytest.raises(aiohttp.WSServerHandshakeError) as e:
                await client.ws_connect("/v1/responses", protocols=offered)
            assert e.value.status == 401
    finally:
        await emb.stop()


async def test_a_template_refusal_is_a_400_naming_the_input_and_jinja_is_prepared_off_the_loop(tmp_path):
    from pddgw.api.errors import ApiError
    from pddgw.core.sampling import SamplingParams
    from pddgw.engines.tokenizer import HFTokenizer
    from tests.engines.test_chat_template import LLAMA2, _checkpoint

    emb = Embedded(Config())
    side = await emb.start()
    try:
        door = side.door
        assert not door.heavy((("user", "hi"),))                  # the tiny model's built-in template
        door.tok = HFTokenizer.from_dir(_checkpoint(tmp_path / "ckpt", LLAMA2))
        assert door.heavy((("user", "hi"),))                      # a checkpoint's Jinja template
        with pytest.raises(ApiError) as e:
            door.prepare(None, (("user", "a"), ("user", "b")), 8, SamplingParams(temperature=0.0, seed=0))
        assert (e.value.param, e.value.code) == ("input", "invalid_request_error")
        assert "Conversation roles must alternate" in str(e.value)
    finally:
        await emb.stop()
