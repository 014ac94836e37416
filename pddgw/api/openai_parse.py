"""The OpenAI HTTP request bodies (chat completions, completions, responses), decoded at the edge.

Each parser takes the decoded JSON body and returns a `GenRequest`, or raises
`ApiError` naming the offending field in `param`:

* an unknown key is `unsupported_parameter` naming it; so is a known key this
  server does not implement (`suffix`), or a combination it refuses
  (`best_of` > n with `stream`, prompt logprobs with `stream`);
* every bound is checked before anything is sized by it (`n`, `best_of` <=
  `MAX_CHOICES`, a client `request_id` <= `MAX_CLIENT_ID_LEN` characters,
  completions token IDs inside the vocabulary);
* sampling fields are decoded by `responses.parse_sampling`, so every route
  has the same bounds and names.

A `GenRequest` is what the routes (openai_routes.py) and the WebSocket door
run: the prompt (messages, token IDs or text), the sampling, and what the
answer must carry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any, Literal

import orjson

from pddgw.api.errors import ApiError, brief, optional
from pddgw.api.responses import (
    SAMPLING_KEYS,
    CreateResponse,
    parse_create_body,
    parse_extension,
    parse_sampling,
    response_format_grammar,
    return_token_ids,
    top_logprobs_param,
)
from pddgw.api.stops import parse_stop
from pddgw.api.toolcalls import ToolRequest, parse_tools
from pddgw.core.errors import FieldError
from pddgw.core.sampling import SamplingParams

MAX_CLIENT_ID_LEN = 256    # a client's `request_id`, at most (it is logged)
MAX_CHOICES = 16           # `n`, at most: each choice is a request of its own on the router

@dataclass(frozen=True, slots=True)
class GenRequest:
    """One decoded chat / completions / responses request."""

    kind: Literal["chat", "completion", "response"]
    messages: tuple[tuple[str, str], ...]        # chat, responses with text input
    prompt_token_ids: tuple[int, ...] | None     # completions with token IDs, responses' extension
    prompt_text: str | None                      # completions with a string
    max_tokens: int | None
    sampling: SamplingParams                     # max_tokens: set by the door (the room left)
    stream: bool
    include_usage: bool
    model: str | None
    pipeline: str | None
    handoff_mode: str | None
    input_param: str                             # the field a too-long prompt is blamed on
    create: CreateResponse | None = None         # responses: the decoded request
    logprobs: int | None = None                  # None: none; k: each token's + k top alternatives
    client_request_id: str | None = None         # vLLM's `request_id`: logged with the router's id
    stop: tuple[str, ...] = ()                   # stop strings (api/stops.py), matched on the text
    n: int = 1                                   # choices returned (chat, completions)
    best_of: int = 1                             # sequences generated (>= n): the n most likely returned
    echo: bool = False                           # completions: the prompt comes back before the text
    score_only: bool = False                     # completions' echo with max_tokens 0: the prompt only
    vllm_prompt_logprobs: bool = False           # vLLM's `prompt_logprobs` asked: choices[].prompt_logprobs
    tools: ToolRequest | None = None             # chat / responses `tools` (api/toolcalls.py)
    chat: tuple[dict[str, Any], ...] | None = None   # message objects, when they carry tool calls / results
    return_token_ids: bool = False               # vLLM's: prompt and output token ids in the answer
    states: bool = False                         # `pddgw.states`: the state timeline in the summary


_CHAT_KEYS = {"model", "messages", "max_tokens", "max_completion_tokens", "stream", "stream_options", "n", "stop",
              "best_of", "user", "store", "metadata", "logprobs", "top_logprobs", "request_id", "pddgw",
              "tools", "tool_choice", "parallel_tool_calls", "response_format", "return_token_ids", *SAMPLING_KEYS}
_COMPLETION_KEYS = {"model", "prompt", "max_tokens", "stream", "stream_options", "n", "stop", "user", "logprobs",
                    "echo", "suffix", "best_of", "request_id", "pddgw", "prompt_logprobs", "return_token_ids",
                    *SAMPLING_KEYS}
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
               "tool": "tool"}


def _unsupported(name: str, why: str = "is not supported by this server") -> ApiError:
    return ApiError(f"'{name}' {why}", name, "unsupported_parameter")


def check_keys(d: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise _unsupported(unknown[0][:64], "is not a supported parameter")


def _pos_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ApiError(f"'{key}' must be a positive integer", key)
    return v


def _choices(d: dict[str, Any], stream: bool) -> tuple[int, int]:
    """(`n`, vLLM's `best_of`): n choices returned of best_of generated (null: 1, null: n)."""
    n = d.get("n")
    if n is None:
        n = 1
    elif isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CHOICES:
        raise ApiError(f"'n' must be an integer in [1, {MAX_CHOICES}], got {brief(n)}", "n")
    best_of = d.get("best_of")
    if best_of is None:
        return n, n
    if isinstance(best_of, bool) or not isinstance(best_of, int) or not n <= best_of <= MAX_CHOICES:
        raise ApiError(f"'best_of' must be an integer in [n ({n}), {MAX_CHOICES}], got {brief(best_of)}", "best_of")
    if best_of > n and stream:
        # The ranking needs every sequence's end (vLLM refuses it too).
        raise _unsupported("best_of", f"greater than n ({n}) is not supported with 'stream': true")
    return n, best_of


def _common(d: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    """The sampling, streaming, choices, stop and extension fields chat and completions share."""
    n, best_of = _choices(d, d.get("stream") is True)
    stop = parse_stop(d.get("stop"))
    sampling = parse_sampling(d, max_tokens, logprobs)
    client_id = optional(d, "request_id", str, max_len=MAX_CLIENT_ID_LEN)
    stream = optional(d, "stream", bool)
    opts = d.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ApiError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise ApiError("'stream_options' may only set 'include_usage'", "stream_options")
        include_usage = optional(opts, "include_usage", bool, name="stream_options.include_usage")
    model = optional(d, "model", str)
    ext = parse_extension(d)
    return {"sampling": sampling, "stream": bool(stream), "include_usage": bool(include_usage), "model": model,
            "pipeline": ext.pipeline, "handoff_mode": ext.handoff_mode, "logprobs": logprobs,
            "client_request_id": client_id, "stop": stop, "n": n, "best_of": best_of, "states": ext.states,
            "return_token_ids": return_token_ids(d)}


def _chat_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(f"{where}[{i}] must be a text part {{'type': 'text', 'text': ...}}", where)
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(f"{where} must be a string or a list of text parts", where)


def json_body(raw: bytes) -> Any:
    """A request body's JSON; ApiError when it is not JSON."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None


def parse_messages(msgs: Any) -> tuple[list[tuple[str, str]], bool]:
    """A chat's `messages` -> (role, text) pairs, and whether any carries tool calls / is a tool
    result (then the template needs the messages whole); ApiError names the message."""
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", "messages")
    out: list[tuple[str, str]] = []
    rich = False
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object", where)
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(_CHAT_ROLES)}", f"{where}.role")
        extra = sorted(set(m) - {"role", "content", "name"} - _TOOL_MESSAGE_KEYS.get(role, set()))
        if extra:
            raise _unsupported(f"{where}.{extra[0][:64]}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append((_CHAT_ROLES[role], _chat_content(content, f"{where}.content")))
        if set(m) & _TOOL_MESSAGE_KEYS.get(role, set()) or role == "tool":
            rich = True
    return out, rich


def parse_chat(d: Any) -> GenRequest:
    if not isinstance(d, dict):
        raise ApiError("the request body must be a JSON object")
    check_keys(d, _CHAT_KEYS)
    msgs = d.get("messages")
    out, rich = parse_messages(msgs)
    # Both validated; max_completion_tokens (OpenAI's newer name) wins when both are given.
    legacy, newer = _pos_int(d, "max_tokens"), _pos_int(d, "max_completion_tokens")
    max_tokens = newer if newer is not None else legacy
    common = _common(d, max_tokens, _chat_logprobs(d))
    tools = parse_tools(d)
    grammar = response_format_grammar(d.get("response_format"), "response_format")
    if grammar is not None:
        if tools is not None and tools.forced:
            raise ApiError("'response_format' cannot be combined with a forced 'tool_choice'", "response_format")
        common["sampling"] = with_grammar(common["sampling"], grammar, "response_format")
    chat = tuple(_tool_message(m, i, r) for i, (m, r) in enumerate(zip(msgs, out))) if rich or tools else None
    return GenRequest("chat", tuple(out), None, None, max_tokens, input_param="messages", tools=tools, chat=chat,
                      **common)


# Keys a chat message may carry besides role / content / name, by role.
_TOOL_MESSAGE_KEYS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}


def _tool_message(m: dict[str, Any], i: int, pair: tuple[str, str]) -> dict[str, Any]:
    """A message as the chat template gets it: role and text content, and its tool calls / call id."""
    where = f"messages[{i}]"
    msg: dict[str, Any] = {"role": pair[0], "content": pair[1]}
    calls = m.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise ApiError(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        norm = []
        for j, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments", ""), str)):
                raise ApiError(f"{where}.tool_calls[{j}] must be {{'id', 'type': 'function', 'function': "
                               "{'name', 'arguments'}}", f"{where}.tool_calls[{j}]")
            # Templates index arguments as a mapping (transformers parses the JSON the same way).
            try:
                args = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                raise ApiError(f"{where}.tool_calls[{j}].function.arguments must be JSON text",
                               f"{where}.tool_calls[{j}].function.arguments") from None
            norm.append({"id": str(c.get("id", "")), "type": "function",
                         "function": {"name": fn["name"], "arguments": args}})
        msg["tool_calls"] = norm
    if pair[0] == "tool":
        cid = m.get("tool_call_id")
        if not isinstance(cid, str):
            raise ApiError(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
        msg["tool_call_id"] = cid
    if isinstance(m.get("name"), str):
        msg["name"] = m["name"]
    return msg


def with_grammar(sp: SamplingParams, grammar: tuple[str, str], param: str) -> SamplingParams:
    try:
        return replace(sp, grammar=grammar)
    except FieldError as e:
        raise ApiError(f"'{param}': {e}", param) from None


def _chat_logprobs(d: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0..20, only with logprobs: true)."""
    want = optional(d, "logprobs", bool)
    top = top_logprobs_param(d, "top_logprobs")
    if top is not None and not want:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if want else None


def parse_completion(d: Any, vocab_size: int) -> GenRequest:
    if not isinstance(d, dict):
        raise ApiError("the request body must be a JSON object")
    check_keys(d, _COMPLETION_KEYS)
    echo = optional(d, "echo", bool)
    # max_tokens 0 with echo (vLLM's, OpenAI's): only the prompt is scored - one token is
    # generated (the engines' minimum) and dropped at the door.
    score_only = bool(echo) and d.get("max_tokens") == 0 and not isinstance(d.get("max_tokens"), bool)
    if score_only:
        d = {**d, "max_tokens": 1}
    if d.get("suffix") is not None:
        raise _unsupported("suffix")
    p = d.get("prompt")
    # A batch of one prompt is that prompt.
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    ids: tuple[int, ...] | None = None
    text: str | None = None
    if isinstance(p, str):
        if not p:
            raise ApiError("'prompt' must not be empty", "prompt")
        text = p
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if not all(0 <= t < vocab_size for t in p):
            raise ApiError(f"'prompt' token IDs must be in [0, {vocab_size})", "prompt")
        ids = tuple(p)
    else:
        raise ApiError("'prompt' must be a non-empty string or a non-empty list of token IDs (one prompt per "
                       "request)", "prompt")
    # Completions' `logprobs` is the number of top alternatives (0..20), not a boolean.
    max_tokens = _pos_int(d, "max_tokens")
    common = _common(d, max_tokens, top_logprobs_param(d, "logprobs"))
    # Prompt logprobs: echo's (the prompt's entries of `logprobs`, k alternatives) and vLLM's
    # `prompt_logprobs` (choices[].prompt_logprobs); computed once, with the larger k.
    vllm_k = top_logprobs_param(d, "prompt_logprobs")
    echo_k = common["logprobs"] if echo else None
    if echo_k is not None or vllm_k is not None:
        if common["stream"]:
            raise _unsupported("echo" if echo_k is not None else "prompt_logprobs",
                               "with prompt logprobs is not supported with 'stream': true")
        k = max(x for x in (echo_k, vllm_k) if x is not None)
        common["sampling"] = replace(common["sampling"], prompt_logprobs=k)
    if score_only and common["stream"]:
        raise _unsupported("max_tokens", "0 (echo only) is not supported with 'stream': true")
    return GenRequest("completion", (), ids, text, max_tokens, input_param="prompt", echo=bool(echo),
                      score_only=score_only, vllm_prompt_logprobs=vllm_k is not None, **common)


def parse_response(d: Any, max_prompt_tokens: int) -> GenRequest:
    req, stream = parse_create_body(d, max_prompt_tokens)
    return response_request(req, stream)


def response_request(req: CreateResponse, stream: bool) -> GenRequest:
    """A decoded Responses API request (HTTP or WebSocket) as the generation path takes it."""
    return GenRequest("response", req.messages, req.prompt_token_ids, None, req.max_output_tokens, req.sampling,
                      stream, False, req.model, req.pipeline, req.handoff_mode,
                      "prompt_token_ids" if req.prompt_token_ids is not None else "input", req, req.logprobs,
                      tools=req.tools, chat=req.chat, return_token_ids=req.return_token_ids, states=req.states)
