"""OpenAI HTTP request bodies, decoded at the edge: what is accepted, what is refused and which field it names."""

from __future__ import annotations

from dataclasses import replace

import orjson
import pytest

from pddgw.api.errors import ApiError
from pddgw.api.openai_errors import ERRORS, error_body
from pddgw.api.openai_parse import parse_chat, parse_completion, parse_response
from pddgw.core.sampling import COUNT_LIMIT, SEED_LIMIT, SamplingParams

USER = [{"role": "user", "content": "hi"}]
UNSET = COUNT_LIMIT - 1      # max_tokens before the door sets the room left


def want(**kw) -> SamplingParams:
    """What a body decodes to: OpenAI's temperature 1 unless given, seed 0 standing for a drawn one."""
    return SamplingParams(**{"max_tokens": UNSET, "temperature": 1.0, "seed": 0, **kw})


def drawn(sp: SamplingParams) -> SamplingParams:
    """sp with its drawn seed (checked in range) replaced by 0, to compare with `want`."""
    assert 0 <= sp.seed < SEED_LIMIT
    return replace(sp, seed=0)


def test_chat_body():
    r = parse_chat({"model": "m", "messages": [{"role": "developer", "content": "be brief"},
                                               {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                            {"type": "text", "text": "b"}]},
                                               {"role": "assistant", "content": None, "name": "x"}],
                    "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0, "top_p": 0.5, "seed": 3,
                    "stream": True, "stream_options": {"include_usage": True}, "n": 1, "stop": None,
                    "pddgw": {"pipeline": "P-MD"}})
    assert r.messages == (("system", "be brief"), ("user", "ab"), ("assistant", ""))
    assert (r.max_tokens, r.sampling, r.stream, r.include_usage, r.model) == (
        7, want(max_tokens=7, temperature=0.0, top_p=0.5, seed=3), True, True, "m")
    assert (r.pipeline, r.handoff_mode, r.input_param) == ("P-MD", None, "messages")
    d = parse_chat({"messages": USER})
    assert (d.max_tokens, drawn(d.sampling), d.stream, d.include_usage) == (None, want(), False, False)


@pytest.mark.parametrize("body,param,code", [
    ([], None, "invalid_request_error"),
    ({"messages": []}, "messages", "invalid_request_error"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "invalid_request_error"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "invalid_request_error"),
    ({"messages": USER, "n": 17}, "n", "invalid_request_error"),
    ({"messages": USER, "n": 0}, "n", "invalid_request_error"),
    ({"messages": USER, "n": True}, "n", "invalid_request_error"),
    ({"messages": USER, "n": 2, "best_of": 1}, "best_of", "invalid_request_error"),
    ({"messages": USER, "n": 2, "best_of": 17}, "best_of", "invalid_request_error"),
    ({"messages": USER, "best_of": True}, "best_of", "invalid_request_error"),
    ({"messages": USER, "n": 2, "best_of": 3, "stream": True}, "best_of", "unsupported_parameter"),
    ({"messages": USER, "stop": ["x"] * 17}, "stop", "invalid_request_error"),
    ({"messages": USER, "stop": [""]}, "stop", "invalid_request_error"),
    ({"messages": USER, "stop": 3}, "stop", "invalid_request_error"),
    ({"messages": USER, "logprobs": 1}, "logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": True}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "presence_penalty": 2.5}, "presence_penalty", "invalid_request_error"),
    ({"messages": USER, "max_tokens": "x", "max_completion_tokens": 5}, "max_tokens", "invalid_request_error"),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": "x"}, "max_completion_tokens",
     "invalid_request_error"),
    ({"messages": USER, "request_id": 5}, "request_id", "invalid_request_error"),
    ({"messages": USER, "bad_words": ["x"]}, "bad_words", "unsupported_parameter"),
    ({"messages": USER, "tools": "x"}, "tools", "invalid_request_error"),
    ({"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "invalid_request_error"),
    ({"messages": USER, "top_p": 0}, "top_p", "invalid_request_error"),
    ({"messages": USER, "seed": 2**63}, "seed", "invalid_request_error"),
    ({"messages": USER, "stream": "yes"}, "stream", "invalid_request_error"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options", "invalid_request_error"),
    ({"messages": USER, "stream": True, "stream_options": {"x": 1}}, "stream_options", "invalid_request_error"),
    ({"messages": USER, "model": 3}, "model", "invalid_request_error"),
    ({"messages": USER, "pddgw": {"pipeline": "P-X"}}, "pddgw.pipeline", "invalid_request_error"),
])
def test_chat_body_refused(body, param, code):
    with pytest.raises(ApiError) as ei:
        parse_chat(body)
    assert (ei.value.param, ei.value.code) == (param, code)


def test_logprobs_parameters():
    """vLLM's convention inside: None = none, k = the sampled token's plus k alternatives."""
    assert parse_chat({"messages": USER}).logprobs is None
    assert parse_chat({"messages": USER, "logprobs": False}).logprobs is None
    assert parse_chat({"messages": USER, "logprobs": True}).logprobs == 0
    assert parse_chat({"messages": USER, "logprobs": True, "top_logprobs": 20}).logprobs == 20
    assert parse_chat({"messages": USER, "logprobs": True, "top_logprobs": None}).logprobs == 0
    assert parse_completion({"prompt": "x"}, 384).logprobs is None
    assert parse_completion({"prompt": "x", "logprobs": 0}, 384).logprobs == 0
    assert parse_completion({"prompt": "x", "logprobs": 5}, 384).logprobs == 5
    for bad in (21, -1, True, 1.5, "2"):
        with pytest.raises(ApiError) as ei:
            parse_completion({"prompt": "x", "logprobs": bad}, 384)
        assert (ei.value.param, ei.value.code) == ("logprobs", "invalid_request_error")
    inc = ["message.output_text.logprobs"]
    assert parse_response({"input": "x"}, 100).logprobs is None
    assert parse_response({"input": "x", "include": inc}, 100).logprobs == 0
    assert parse_response({"input": "x", "include": inc, "top_logprobs": 3}, 100).logprobs == 3
    assert parse_response({"input": "x", "top_logprobs": 3}, 100).logprobs is None       # as vLLM: include decides
    for body, param, code in [({"input": "x", "include": inc, "top_logprobs": 21}, "top_logprobs",
                               "invalid_request_error"),
                              ({"input": "x", "include": "message.output_text.logprobs"}, "include",
                               "invalid_request_error"),
                              ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include",
                               "unsupported_parameter")]:
        with pytest.raises(ApiError) as ei:
            parse_response(body, 100)
        assert (ei.value.param, ei.value.code) == (param, code), body


# Each route's body with the given fields added (responses: the HTTP body; the WebSocket event shares its decoder).
ROUTES = {"chat": lambda **f: parse_chat({"messages": USER, **f}),
          "completion": lambda **f: parse_completion({"prompt": "x", **f}, 384),
          "response": lambda **f: parse_response({"input": "x", **f}, 100)}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields,want", [
    ({}, want()),
    ({"top_k": None, "min_p": None}, want()),
    ({"top_k": 40, "min_p": 0.05}, want(top_k=40, min_p=0.05)),
    ({"top_k": -1}, want()),              # vLLM's "no filter"
    ({"top_k": 0, "min_p": 0}, want()),
    ({"top_k": 1, "min_p": 1, "temperature": 0.7, "top_p": 0.9, "seed": 5}, want(top_k=1, min_p=1.0, temperature=0.7,
                                                                                 top_p=0.9, seed=5)),
    ({"top_k": 2**31 - 1}, want(top_k=2**31 - 1)),
])
def test_top_k_and_min_p_accepted(route, fields, want):
    got = ROUTES[route](**fields).sampling
    assert (got if "seed" in fields else drawn(got)) == want


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields,message", [
    ({"top_k": -2}, "top_k must be an integer in [-1, 2147483648) (-1 or 0: no filter), got -2"),
    ({"top_k": 1.5}, "top_k must be an integer in [-1, 2147483648) (-1 or 0: no filter), got 1.5"),
    ({"top_k": 40.0}, "top_k must be an integer in [-1, 2147483648) (-1 or 0: no filter), got 40.0"),
    ({"top_k": True}, "top_k must be an integer in [-1, 2147483648) (-1 or 0: no filter), got True"),
    ({"top_k": "3"}, "top_k must be an integer in [-1, 2147483648) (-1 or 0: no filter), got '3'"),
    ({"top_k": 2**31}, "top_k must be an integer in [-1, 2147483648) (-1 or 0: no filter), got 2147483648"),
    ({"min_p": -0.1}, "min_p must be a number in [0, 1], got -0.1"),
    ({"min_p": 1.5}, "min_p must be a number in [0, 1], got 1.5"),
    ({"min_p": "x"}, "min_p must be a number in [0, 1], got 'x'"),
    ({"min_p": True}, "min_p must be a number in [0, 1], got True"),
    ({"temperature": 3}, "temperature must be a number in [0, 2], got 3"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a finite number > 0 (1: no penalty), got 0"),
    ({"presence_penalty": -2.5}, "presence_penalty must be a number in [-2, 2], got -2.5"),
    ({"frequency_penalty": "1"}, "frequency_penalty must be a number in [-2, 2], got '1'"),
    ({"logit_bias": {"7": 101}}, "logit_bias must be biases in [-100, 100], got 101"),
    ({"logit_bias": {"x": 1}}, "logit_bias must be keyed by token ids in [0, 2147483648), got 'x'"),
    ({"logit_bias": [1, 2]}, "logit_bias must be an object of token id -> bias (or [id, bias] pairs), got [1, 2]"),
    ({"min_tokens": -1}, "min_tokens must be an integer in [0, 2147483648), got -1"),
    ({"ignore_eos": 1}, "ignore_eos must be a boolean, got 1"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids must be token ids in [0, 2147483648), got -1"),
    ({"skip_special_tokens": "no"}, "skip_special_tokens must be a boolean, got 'no'"),
    ({"include_stop_str_in_output": None, "ignore_eos": "y"}, "ignore_eos must be a boolean, got 'y'"),
])
def test_top_k_and_min_p_refused_naming_the_field(route, fields, message):
    with pytest.raises(ApiError) as ei:
        ROUTES[route](**fields)
    param = next(k for k in fields if message.startswith(k))
    assert (str(ei.value), ei.value.param, ei.value.code) == (message, param, "invalid_request_error")


def test_completion_body():
    assert parse_completion({"prompt": "abc"}, 384).prompt_text == "abc"
    assert parse_completion({"prompt": [1, 2, 383]}, 384).prompt_token_ids == (1, 2, 383)
    assert parse_completion({"prompt": [[5, 6]]}, 384).prompt_token_ids == (5, 6)       # a batch of one
    assert parse_completion({"prompt": ["x"], "best_of": 1, "echo": False}, 384).prompt_text == "x"
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": [1, 384]}, "prompt"), ({"prompt": [1, -1]}, "prompt"),
                        ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [True]}, "prompt"), ({}, "prompt"),
                        ({"prompt": "x", "echo": 1}, "echo"), ({"prompt": "x", "suffix": "y"}, "suffix"),
                        ({"prompt": "x", "best_of": 17}, "best_of"), ({"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
                        ({"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
                        ({"prompt": "x", "stop": ["a", 1]}, "stop"), ({"prompt": "x", "messages": USER}, "messages")]:
        with pytest.raises(ApiError) as ei:
            parse_completion(body, 384)
        assert ei.value.param == param, body


def test_responses_body():
    r = parse_response({"model": "m", "input": "hi", "instructions": "sys", "max_output_tokens": 4,
                        "stream": True, "temperature": 0}, 100)
    assert (r.kind, r.messages, r.max_tokens, r.stream, r.input_param) == (
        "response", (("system", "sys"), ("user", "hi")), 4, True, "input")
    assert r.create is not None and r.create.metadata == {}
    r = parse_response({"prompt_token_ids": [1, 2]}, 100)
    assert (r.prompt_token_ids, r.stream, r.input_param) == ((1, 2), False, "prompt_token_ids")
    for body, param in [({"input": "x", "stream": 1}, "stream"), ({"input": "x", "type": "response.create"}, "type"),
                        ({"input": "x", "stream_id": "s"}, "stream_id"), ({"input": "x", "background": True},
                                                                          "background"),
                        ({"input": "x", "tools": "x"}, "tools")]:
        with pytest.raises(ApiError) as ei:
            parse_response(body, 100)
        assert ei.value.param == param, body


def test_error_body_and_statuses():
    assert error_body("m", "overloaded") == {"error": {"message": "m", "type": "rate_limit_exceeded", "param": None,
                                                       "code": "overloaded"}}
    assert error_body("m", "no_such_code", "p")["error"]["type"] == "server_error"
    assert {c: s for c, (s, _) in ERRORS.items()} == {
        "invalid_request_error": 400, "context_length_exceeded": 400, "unsupported_parameter": 400,
        "invalid_api_key": 401, "permission_denied": 403, "not_found": 404, "model_not_found": 404,
        "method_not_allowed": 405, "request_too_large": 413, "rate_limit_exceeded": 429, "overloaded": 429,
        "unavailable": 503, "timeout": 504, "server_error": 500}
    assert orjson.loads(orjson.dumps(error_body("m", "timeout")))["error"]["type"] == "server_error"


# What `vllm bench serve` sends (its OpenAI backends): completions always carry repetition_penalty 1.0, its
# random dataset ignore_eos; chat sends max_completion_tokens and text parts.
VLLM_COMPLETION = {"model": "m", "prompt": "hello", "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 16,
                   "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
VLLM_CHAT = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
             "temperature": 0.0, "max_completion_tokens": 16, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True}


def test_vllm_benchmark_bodies_decode_with_vllms_meaning():
    c = parse_completion({**VLLM_COMPLETION, "min_tokens": 16, "seed": 4, "request_id": "bench-7"}, 384)
    assert (c.max_tokens, c.stream, c.include_usage, c.logprobs, c.client_request_id) == (16, True, True, None,
                                                                                          "bench-7")
    assert c.sampling == want(max_tokens=16, temperature=0.0, seed=4, ignore_eos=True, min_tokens=16)
    assert not c.sampling.penalized and not c.sampling.logit_bias      # repetition 1.0 is "off"
    ch = parse_chat({**VLLM_CHAT, "presence_penalty": 0.5, "frequency_penalty": -0.25,
                     "logit_bias": {"7": 100, "12": -100.0}, "seed": 2, "stop_token_ids": [3],
                     "skip_special_tokens": True, "include_stop_str_in_output": False})
    assert ch.sampling == want(max_tokens=16, temperature=0.0, seed=2, ignore_eos=True, presence_penalty=0.5,
                               frequency_penalty=-0.25, logit_bias=((7, 100.0), (12, -100.0)), stop_token_ids=(3,))
    assert ch.sampling.penalized and not parse_completion(VLLM_COMPLETION, 384).sampling.penalized


def test_max_tokens_and_max_completion_tokens_are_both_validated():
    assert parse_chat({"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}).max_tokens == 7
    assert parse_chat({"messages": USER, "max_tokens": 5}).max_tokens == 5
    for body in ({"max_tokens": "x", "max_completion_tokens": 7}, {"max_tokens": 0, "max_completion_tokens": 7},
                 {"max_tokens": True}):
        with pytest.raises(ApiError) as ei:
            parse_chat({"messages": USER, **body})
        assert ei.value.param == "max_tokens"
    with pytest.raises(ApiError) as ei:
        parse_completion({"prompt": "x", "max_tokens": 8, "min_tokens": 9}, 384)
    assert (str(ei.value), ei.value.param) == ("min_tokens must be <= max_tokens (8), got 9", "min_tokens")


def test_stop_n_and_best_of_decoded():
    from pddgw.api.stops import MAX_STOP_CHARS, MAX_STOPS
    r = parse_chat({"messages": USER, "stop": "\n", "n": 3, "best_of": 3})
    assert (r.stop, r.n, r.best_of) == (("\n",), 3, 3)
    assert (parse_chat({"messages": USER, "n": 2}).best_of, parse_chat({"messages": USER}).best_of) == (2, 1)
    r = parse_completion({"prompt": "x", "n": 2, "best_of": 16, "stream": False}, 384)
    assert (r.n, r.best_of, r.logprobs) == (2, 16, None)     # not asked: the ranking's logprobs are internal
    assert parse_completion({"prompt": "x", "n": 2, "best_of": 2, "stream": True}, 384).best_of == 2
    with pytest.raises(ApiError) as ei:
        parse_completion({"prompt": "x", "n": 2, "best_of": 17}, 384)
    assert str(ei.value) == "'best_of' must be an integer in [n (2), 16], got 17"
    with pytest.raises(ApiError) as ei:
        parse_chat({"messages": USER, "n": 2, "best_of": 3, "stream": True})
    assert (str(ei.value), ei.value.code) == (
        "'best_of' greater than n (2) is not supported with 'stream': true", "unsupported_parameter")
    r = parse_completion({"prompt": "x", "stop": ["ab", "c", "ab"], "n": 2}, 384)
    assert (r.stop, r.n) == (("ab", "c"), 2)                   # duplicates dropped, order kept
    assert (parse_chat({"messages": USER, "stop": []}).stop, parse_chat({"messages": USER}).n) == ((), 1)
    assert parse_chat({"messages": USER, "stop": ["s"] * MAX_STOPS, "n": 16}).n == 16
    with pytest.raises(ApiError) as ei:
        parse_chat({"messages": USER, "stop": ["x" * (MAX_STOP_CHARS + 1)]})
    assert ei.value.param == "stop" and f"at most {MAX_STOP_CHARS} characters" in str(ei.value)
    with pytest.raises(ApiError) as ei:
        parse_chat({"messages": USER, "n": 17})
    assert str(ei.value) == "'n' must be an integer in [1, 16], got 17"
    with pytest.raises(ApiError) as ei:
        parse_chat({"messages": USER, "stop": ["x"] * 17})
    assert str(ei.value).startswith("'stop' must be a string or a list of at most 16 strings")


async def test_every_refused_request_is_one_log_line_naming_route_field_reason_and_status(aiohttp_client):
    """The router's front door logs each 4xx once (`request_refused`), whatever refused it."""
    from structlog.testing import capture_logs

    from pddgw.api.server import build_app
    from pddgw.deploy.serve import Embedded
    from tests.api.deployment import KEY, make_cfg

    emb = Embedded(make_cfg())
    side = await emb.start()
    try:
        client = await aiohttp_client(build_app(side.door))
        auth = {"Authorization": f"Bearer {KEY}"}
        user = [{"role": "user", "content": "x"}]
        cases = [
            ("post", "/v1/chat/completions", {"messages": user, "n": 17}, auth,
             ("POST /v1/chat/completions", "n", "'n' must be an integer in [1, 16], got 17", 400)),
            ("post", "/v1/completions", {"prompt": "x", "stop": [1]}, auth,
             ("POST /v1/completions", "stop",
              "'stop[0]' must be a non-empty string of at most 256 characters, got 1", 400)),
            ("post", "/v1/chat/completions", {"messages": user}, {"Authorization": "Bearer nope"},
             ("POST /v1/chat/completions", None, "invalid or missing API key (Authorization: Bearer KEY)", 401)),
            ("get", "/v1/models/other", None, auth,
             ("GET /v1/models/{model}", "model",
              f"the model 'other' does not exist (this server serves {side.door.model_name!r})", 404)),
            ("get", "/v1/nowhere", None, auth, ("GET /v1/nowhere", None, "unknown route GET '/v1/nowhere'", 404)),
        ]
        for method, path, body, headers, want in cases:
            with capture_logs() as logs:
                async with getattr(client, method)(path, json=body, headers=headers) as r:
                    assert r.status == want[3]
            refused = [e for e in logs if e["event"] == "request_refused"]
            assert [(e["route"], e["field"], e["reason"], e["status"]) for e in refused] == [want], path
        with capture_logs() as logs:          # an answer is not a refusal
            async with client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth) as r:
                assert r.status == 200 and isinstance(await r.json(), dict)
        assert not [e for e in logs if e["event"] == "request_refused"]
    finally:
        await emb.stop()
