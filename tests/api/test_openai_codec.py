"""OpenAI HTTP request bodies, decoded at the edge: what is accepted, what is refused and which field it names."""

from __future__ import annotations

import orjson
import pytest

from pddgw.api.openai_http import ERRORS, error_body, parse_chat, parse_completion, parse_response
from pddgw.api.responses import ApiError, SamplingFields

USER = [{"role": "user", "content": "hi"}]


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
        7, SamplingFields(temperature=0.0, top_p=0.5, seed=3), True, True, "m")
    assert (r.pipeline, r.handoff_mode, r.input_param) == ("P-MD", None, "messages")
    d = parse_chat({"messages": USER})
    assert (d.max_tokens, d.sampling, d.stream, d.include_usage) == (None, SamplingFields(1.0, 1.0, 0, 0.0, None),
                                                                      False, False)


@pytest.mark.parametrize("body,param,code", [
    ([], None, "invalid_request_error"),
    ({"messages": []}, "messages", "invalid_request_error"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", "invalid_request_error"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     "unsupported_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content",
     "invalid_request_error"),
    ({"messages": USER, "n": 2}, "n", "invalid_request_error"),
    ({"messages": USER, "n": True}, "n", "invalid_request_error"),
    ({"messages": USER, "stop": "x"}, "stop", "unsupported_parameter"),
    ({"messages": USER, "logprobs": 1}, "logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": True, "top_logprobs": True}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "top_logprobs": 2}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "logprobs": False, "top_logprobs": 2}, "top_logprobs", "invalid_request_error"),
    ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty", "unsupported_parameter"),
    ({"messages": USER, "tools": []}, "tools", "unsupported_parameter"),
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
    ({}, SamplingFields(1.0, 1.0, 0, 0.0, None)),
    ({"top_k": None, "min_p": None}, SamplingFields(1.0, 1.0, 0, 0.0, None)),
    ({"top_k": 40, "min_p": 0.05}, SamplingFields(1.0, 1.0, 40, 0.05, None)),
    ({"top_k": -1}, SamplingFields(1.0, 1.0, 0, 0.0, None)),              # vLLM's "no filter"
    ({"top_k": 0, "min_p": 0}, SamplingFields(1.0, 1.0, 0, 0.0, None)),
    ({"top_k": 1, "min_p": 1, "temperature": 0.7, "top_p": 0.9, "seed": 5}, SamplingFields(0.7, 0.9, 1, 1.0, 5)),
    ({"top_k": 2**31 - 1}, SamplingFields(1.0, 1.0, 2**31 - 1, 0.0, None)),
])
def test_top_k_and_min_p_accepted(route, fields, want):
    assert ROUTES[route](**fields).sampling == want


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("fields,message", [
    ({"top_k": -2}, "'top_k' must be an integer in [-1, 2**31) (-1 or 0: no filter), got -2"),
    ({"top_k": 1.5}, "'top_k' must be an integer in [-1, 2**31) (-1 or 0: no filter), got 1.5"),
    ({"top_k": 40.0}, "'top_k' must be an integer in [-1, 2**31) (-1 or 0: no filter), got 40.0"),
    ({"top_k": True}, "'top_k' must be an integer in [-1, 2**31) (-1 or 0: no filter), got True"),
    ({"top_k": "3"}, "'top_k' must be an integer in [-1, 2**31) (-1 or 0: no filter), got '3'"),
    ({"top_k": 2**31}, "'top_k' must be an integer in [-1, 2**31) (-1 or 0: no filter), got 2147483648"),
    ({"min_p": -0.1}, "'min_p' must be a number in [0.0, 1.0], got -0.1"),
    ({"min_p": 1.5}, "'min_p' must be a number in [0.0, 1.0], got 1.5"),
    ({"min_p": "x"}, "'min_p' must be a number in [0.0, 1.0], got 'x'"),
    ({"min_p": True}, "'min_p' must be a number in [0.0, 1.0], got True"),
])
def test_top_k_and_min_p_refused_naming_the_field(route, fields, message):
    with pytest.raises(ApiError) as ei:
        ROUTES[route](**fields)
    assert (str(ei.value), ei.value.param, ei.value.code) == (message, next(iter(fields)), "invalid_request_error")


def test_completion_body():
    assert parse_completion({"prompt": "abc"}, 384).prompt_text == "abc"
    assert parse_completion({"prompt": [1, 2, 383]}, 384).prompt_token_ids == (1, 2, 383)
    assert parse_completion({"prompt": [[5, 6]]}, 384).prompt_token_ids == (5, 6)       # a batch of one
    assert parse_completion({"prompt": ["x"], "best_of": 1, "echo": False}, 384).prompt_text == "x"
    for body, param in [({"prompt": ""}, "prompt"), ({"prompt": [1, 384]}, "prompt"), ({"prompt": [1, -1]}, "prompt"),
                        ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [True]}, "prompt"), ({}, "prompt"),
                        ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "suffix": "y"}, "suffix"),
                        ({"prompt": "x", "best_of": 2}, "best_of"), ({"prompt": "x", "messages": USER}, "messages")]:
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
                        ({"input": "x", "tools": []}, "tools")]:
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
