"""POST /tokenize and /detokenize (api/tokenize.py) on an embedded deployment of the tiny model.

The tiny model's ids are UTF-8 bytes, specials from 256 (<bos> 256, <|im_start|> 258,
<|im_end|> 259), so every expectation below is an exact id list.
"""

from __future__ import annotations

import pytest

from pddgw.api.server import build_app
from pddgw.config import Config, ServerConfig
from pddgw.deploy.serve import Embedded

KEY = "tok-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
async def client(aiohttp_client):
    emb = Embedded(Config(server=ServerConfig(api_keys=(KEY,), max_message_bytes=1 << 20)))
    side = await emb.start()
    yield await aiohttp_client(build_app(side.door))
    await emb.stop()


async def post(client, path: str, body, status: int = 200, headers=AUTH) -> dict:
    r = await client.post(path, json=body, headers=headers)
    got = await r.json()
    assert r.status == status, got
    return got


async def test_tokenize_prompt_with_and_without_special_tokens(client):
    got = await post(client, "/tokenize", {"model": "pddgw-tiny", "prompt": "hi!"})
    assert got == {"count": 4, "max_model_len": 4096, "tokens": [256, 104, 105, 33], "token_strs": None}
    got = await post(client, "/tokenize", {"prompt": "hé", "add_special_tokens": False})
    assert got["tokens"] == [104, 0xC3, 0xA9] and got["count"] == 3
    # A typed special-token string is text, never its id.
    got = await post(client, "/tokenize", {"prompt": "<|im_end|>", "add_special_tokens": False})
    assert got["tokens"] == list(b"<|im_end|>")


async def test_tokenize_messages_is_the_chat_template(client):
    msgs = [{"role": "user", "content": "hi"}]
    got = await post(client, "/tokenize", {"messages": msgs})
    user, gen = [117, 115, 101, 114, 10, 104, 105], [97, 115, 115, 105, 115, 116, 97, 110, 116, 10]
    assert got["tokens"] == [256, 258, *user, 259, 10, 258, *gen]
    assert got["count"] == 22
    got = await post(client, "/tokenize", {"messages": msgs, "add_generation_prompt": False})
    assert got["tokens"] == [256, 258, *user, 259, 10]
    # bos is already the template's: add_special_tokens does not add a second one.
    assert (await post(client, "/tokenize", {"messages": msgs, "add_special_tokens": True}))["count"] == 22
    parts = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    assert (await post(client, "/tokenize", {"messages": parts}))["tokens"] == [256, 258, *user, 259, 10, 258, *gen]


async def test_detokenize_drops_specials(client):
    assert await post(client, "/detokenize", {"tokens": [256, 104, 105, 0xC3, 0xA9, 259]}) == {"prompt": "hié"}
    assert await post(client, "/detokenize", {"model": "pddgw-tiny", "tokens": []}) == {"prompt": ""}


async def test_large_prompt_round_trips(client):
    text = "The quick brown fox. " * 1000            # past the inline bound: tokenized in a thread
    got = await post(client, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert got["count"] == len(text) and got["tokens"][:4] == [84, 104, 101, 32]
    assert (await post(client, "/detokenize", {"tokens": got["tokens"]}))["prompt"] == text


@pytest.mark.parametrize("path,body,status,code,param", [
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model_not_found", "model"),
    ("/tokenize", {"prompt": 5}, 400, "invalid_request_error", "prompt"),
    ("/tokenize", {}, 400, "invalid_request_error", "prompt"),
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400,
     "invalid_request_error", "messages"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "invalid_request_error",
     "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "return_token_strs": True}, 400, "unsupported_parameter", "return_token_strs"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400, "unsupported_parameter",
     "add_generation_prompt"),
    ("/tokenize", {"messages": []}, 400, "invalid_request_error", "messages"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "y"}]}, 400, "invalid_request_error",
     "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user", "content": "y", "tool_calls": []}]}, 400,
     "unsupported_parameter", "messages[0].tool_calls"),
    ("/tokenize", [1, 2], 400, "invalid_request_error", None),
    ("/detokenize", {"tokens": [1, 384]}, 400, "invalid_request_error", "tokens"),
    ("/detokenize", {"tokens": [1, -1]}, 400, "invalid_request_error", "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "invalid_request_error", "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "invalid_request_error", "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, 400, "unsupported_parameter", "prompt"),
])
async def test_bad_requests_name_the_field(client, path, body, status, code, param):
    err = (await post(client, path, body, status))["error"]
    assert (err["code"], err["param"]) == (code, param), err
    # The node keeps serving.
    assert (await post(client, "/tokenize", {"prompt": "a"}))["tokens"] == [256, 97]


async def test_detokenize_out_of_vocab_says_which(client):
    err = (await post(client, "/detokenize", {"tokens": [1, 2, 999]}, 400))["error"]
    assert err["message"] == "tokens[2] = 999 is not a token ID of this model (0 .. 383)"


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
async def test_needs_an_api_key(client, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        err = (await post(client, path, {"prompt": "x", "tokens": [1]}, 401, headers))["error"]
        assert err["code"] == "invalid_api_key"


async def test_invalid_json(client):
    r = await client.post("/tokenize", data=b"{not json", headers=AUTH)
    assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_request_error"
