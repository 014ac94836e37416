"""OpenAI HTTP API on the router's front door: chat completions, completions, responses, models.

Routes (registered in server.py's `build_app`):

  POST /v1/chat/completions   `chat.completion`, or with `"stream": true` SSE `chat.completion.chunk`s
                              ending with `data: [DONE]` (`stream_options.include_usage`: one more
                              chunk with `usage` and no choices before it)
  POST /v1/completions        `text_completion` (`prompt`: a string, or a list of token IDs), SSE likewise
  POST /v1/responses          a `response` object, or SSE typed events (`event: response.created`,
                              `response.in_progress`, `response.output_item.added`,
                              `response.content_part.added`, `response.output_text.delta` ...,
                              `response.output_text.done`, `response.content_part.done`,
                              `response.output_item.done`, `response.completed`), each with its
                              `sequence_number`
  GET  /v1/models, /v1/models/{id}

One request's lifecycle:

  1. Authorize: `Authorization: Bearer KEY` with `[server] api_keys` (an admin key is an API key
     too) -> 401 `invalid_api_key`.
  2. The front door's bound (`max_concurrent_requests`, `door.admission`: taken before the
     body is read, released when the request ends) -> 429 `rate_limit_exceeded` at once.  The
     body is read at a minimum rate (`door.read_body`: too slow -> the connection is closed).
  3. Decode and validate the JSON body at the edge -> 400 naming the field in `param`; a field
     this server does not implement -> 400 `unsupported_parameter` naming it; a `model` other
     than the served one -> 404 `model_not_found`.
  4. Who may steer: a `pddgw` extension that forces a pipeline or handoff mode
     (`{"pddgw": {"pipeline": "P-MD", "handoff_mode": "catch-up"}}`) is an operator's tool: it
     needs an admin key (`[server] admin_keys`) or `[server] allow_request_steering = true`,
     else 403 `permission_denied` naming `pddgw.pipeline` / `pddgw.handoff_mode`.
  5. Tokenize (chat: the same chat template as the WebSocket route; a completions text prompt:
     its plain tokens, nothing added) and bound the output by the context (below).
  6. Run on the router while watching the client's connection: a client that goes away
     (closed socket, or a write that fails) cancels the router task, which frees the request
     on every node.
  7. SSE headers go out with the first token, so an error before it (the router's `overloaded`
     -> 429, `unavailable` -> 503, `timeout` -> 504, a bug -> 500 `server_error`) is still a plain
     HTTP error with its status; after it, the error is the stream's last event (chat and
     completions: `data: {"error": {...}}`; responses: `event: error`).

Behaviours chosen:

  * Output past the context: prompt + max tokens (`max_tokens` / `max_completion_tokens` /
    `max_output_tokens`, default 256) beyond the context length is clamped to the room left,
    never cut silently: an output that ends there has `finish_reason: "length"` (chat,
    completions; as any output that reached its max tokens) and, for responses,
    `status: "incomplete"` with `incomplete_details: {"reason": "max_output_tokens"}` (SSE: the
    last event is `response.incomplete`; over the WebSocket it stays `response.completed`).  A
    response that ends at the client's own, unclamped `max_output_tokens` is `completed` (the
    WebSocket route's contract); `pddgw.finish_reason` says `length` either way.  A prompt that
    leaves no room at all -> 400 `context_length_exceeded`.
  * Sampling: every route decodes the same fields (`responses.SAMPLING_KEYS`) into one
    `pddgw.core.sampling.SamplingParams`, whose constructor holds every bound and names the
    field of a refusal: `temperature` [0, 2] (0 = greedy), `top_p` (0, 1], `seed` [0, 2**63)
    (none: one is drawn; it is in the `pddgw` timeline), and vLLM's sampling parameters with
    vLLM's meaning and defaults, which the `openai` client sends in `extra_body`: `top_k`
    (-1 or 0 = no filter), `min_p`, `repetition_penalty`, `presence_penalty`,
    `frequency_penalty`, `logit_bias` (token id -> [-100, 100]), `min_tokens`, `ignore_eos`,
    `stop_token_ids`, `skip_special_tokens` (the text always drops special tokens: pddgw's
    tokenizers have no other mode), `include_stop_str_in_output` (stop strings, below).  vLLM's
    `request_id` is logged beside the router's own id.  vLLM's `return_token_ids` (chat, completions):
    `prompt_token_ids` (chat: top level, completions: per choice; streamed: each choice's first chunk),
    `choices[].token_ids` (streamed: the chunk's).  The object echoes `temperature` and `top_p` only
    (OpenAI's).  `max_tokens` and `max_completion_tokens` are both checked; the latter wins.
  * Stop strings (chat, completions; the Responses API has none): `stop`, a string or at most
    `stops.MAX_STOPS` (16) strings of at most 256 characters, matched on the detokenized text at
    the router (api/stops.py, door.OutputText): the text ends right before the first complete
    stop string (through it with `include_stop_str_in_output`), wherever the token boundaries
    fall; streamed text that could start a stop string is held back until it cannot.  The
    request is then stopped on every node at once (router.StopRequest), `finish_reason` is
    "stop" and `stop_reason` (vLLM's, in every choice: null unless set) the string; a stop token
    id (`stop_token_ids`) that ended the output is its `stop_reason`.  Usage and the output's
    token ids count the tokens up to the one the stop string completed at.
  * Choices: `n` in [1, `MAX_CHOICES`] (16) and vLLM's `best_of` in [n, 16] (null: n; out of
    range: 400 naming it).  best_of sequences are generated, each a choice as below, and the n
    with the highest cumulative logprob (the sum of the kept sampled tokens' logprobs, of the
    model's raw distribution) are returned, most likely first, re-indexed 0..n-1; ties go to the
    lower generation index; greedy: all are the same sequence, the first n.  The ranking asks
    the engines for each sampled token's logprob (k = 0) whether or not the client asked for
    logprobs; they are returned only if it did.  best_of > n with `stream: true`: 400 naming
    `best_of` (as vLLM: the ranking needs every end).  Usage counts every generated sequence's
    completion tokens (vLLM's).  Choice (generation) i is a router request of its own with the
    same prompt and seed `choice_seed(seed, i)` = seed + i (mod 2**63): exactly a single request
    with that seed.  Choices 1..best_of-1 start when choice 0 has its first token (P has
    prefilled the prompt), so they find its full blocks in P's and MD's prefix caches: what
    they prefill and move is the prompt's last partial block.  Streamed, each choice's chunks
    carry its `index` (chat: each opens with its role chunk, each ends with its finish chunk);
    usage (object, or the one usage chunk) counts the prompt once and the completion tokens of
    every choice.  With best_of > 1 each choice of the object carries its own `pddgw` (its `seed`).
  * Refusals: every 4xx answer is logged once, `request_refused` with route, field (the error's
    `param`), reason (its message) and status (`openai_not_found`, the routes' middleware).
  * Tools and structured output (chat): `tools`, `tool_choice`, `parallel_tool_calls`, `response_format`
    (api/toolcalls.py, engines/grammar.py); a forced call or a response format is a grammar on every
    node (400 when the model states no EOS: it could never end); with tools the streamed text is
    held back and parsed at the end (tool-call deltas).
  * Tools and structured output (responses): `tools` (flat), `tool_choice`, `parallel_tool_calls`,
    `text.format`, `function_call` / `function_call_output` input items (api/responses.py); calls
    come back as `function_call` output items, streamed as `response.output_item.added`,
    `response.function_call_arguments.delta` / `.done`, `response.output_item.done`.
  * Not supported: `suffix`.
  * Log-probabilities (api/logprobs.py: the model's raw distribution, the shapes): chat
    `logprobs: true` with `top_logprobs` 0..20 (`top_logprobs` without `logprobs: true` -> 400
    naming it) -> `choices[].logprobs.content` in the object and in each chunk; completions
    `logprobs` 0..20 -> `choices[].logprobs` {tokens, token_logprobs, top_logprobs, text_offset};
    responses `include: ["message.output_text.logprobs"]` with `top_logprobs` 0..20 -> the
    output_text part's and each `response.output_text.delta`'s `logprobs`.  Out of range: 400
    naming the parameter.  Not asked for: null (chat, completions) / [] (responses SSE events).
  * The `pddgw` extension, O(1) unless asked: each delta `{position, role}`; the final chunk /
    event and the object the summary (`summary`), the object also the role `spans`.  Asked for:
    `return_token_ids` (Responses API too: the deltas' `token_ids`, the summary's
    `output_token_ids`) and `"pddgw": {"states": true}` (the state timeline; any key).
  * Usage: `prompt_tokens_details.cached_tokens` (chat, completions) and
    `input_tokens_details.cached_tokens` (responses) are MD's prefix hit for the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import time
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

import orjson
import structlog
from aiohttp import web

from pddgw.api import logprobs as lpfmt
from pddgw.api.errors import ApiError, brief, optional
from pddgw.api.responses import (SAMPLING_KEYS, CreateResponse, delta_extension, function_call_item, output_message,
                                 output_text, parse_create_body, parse_extension, parse_sampling,
                                 response_format_grammar, response_object, return_token_ids, top_logprobs_param)
from pddgw.core.sampling import SEED_LIMIT, SamplingParams
from pddgw.core.tokens import TokenRun
from pddgw.pipeline.router import Outcome, RouterError, StopRequest, new_request_id
from pddgw.pipeline.state import RequestRecord

from pddgw.api.door import ClientTooSlow
from pddgw.api.toolcalls import ToolCall, ToolFormat, ToolRequest, format_for, grammar_for, parse_calls, parse_tools
from pddgw.core.errors import FieldError
from pddgw.engines.grammar import NO_EOS_REASON, check_spec, grammar_stops
from pddgw.engines.types import RequestError
from pddgw.api.stops import parse_stop

if TYPE_CHECKING:
    from pddgw.api.door import FrontDoor, OutputText, Prepared

log = structlog.get_logger(__name__)

MAX_CLIENT_ID_LEN = 256    # a client's `request_id`, at most (it is logged)
MAX_CHOICES = 16           # `n`, at most: each choice is a request of its own on the router
ARGUMENT_FRAGMENT_CHARS = 16   # a streamed tool call's arguments go out in fragments of this many characters

# How often a request waiting on the router (queued, or between tokens) looks at its client's socket.
DISCONNECT_POLL_S = 0.25

# Error code -> (HTTP status, OpenAI error type).
ERRORS: dict[str, tuple[int, str]] = {
    "invalid_request_error": (400, "invalid_request_error"),
    "context_length_exceeded": (400, "invalid_request_error"),
    "unsupported_parameter": (400, "invalid_request_error"),
    "invalid_api_key": (401, "invalid_request_error"),
    "permission_denied": (403, "permission_error"),
    "not_found": (404, "invalid_request_error"),
    "model_not_found": (404, "invalid_request_error"),
    "method_not_allowed": (405, "invalid_request_error"),
    "request_too_large": (413, "invalid_request_error"),
    "rate_limit_exceeded": (429, "rate_limit_exceeded"),
    "overloaded": (429, "rate_limit_exceeded"),
    "unavailable": (503, "server_error"),
    "timeout": (504, "server_error"),
    "server_error": (500, "server_error"),
}


def error_body(message: str, code: str, param: str | None = None) -> dict[str, Any]:
    _, kind = ERRORS.get(code, ERRORS["server_error"])
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# An error answer's (param, message), kept on the response for the middleware's one log line.
REFUSAL = web.ResponseKey("pddgw_refusal", tuple)


def error_response(message: str, code: str, param: str | None = None) -> web.Response:
    status, _ = ERRORS.get(code, ERRORS["server_error"])
    resp = web.json_response(error_body(message, code, param), status=status, dumps=_dumps)
    resp[REFUSAL] = (param, message)
    return resp


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


# ---- request bodies ---------------------------------------------------------------------


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
        common["sampling"] = _with_grammar(common["sampling"], grammar, "response_format")
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


def _with_grammar(sp: SamplingParams, grammar: tuple[str, str], param: str) -> SamplingParams:
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


# ---- answers --------------------------------------------------------------------------


def summary(record: RequestRecord, seed: int, finish_reason: str, output_ids: tuple[int, ...], *,
            token_ids: bool, states: bool) -> dict[str, Any]:
    """An answer's `pddgw` summary (the final chunk / event, the object): the record's O(1) fields,
    the seed and finish reason; the output ids only with `return_token_ids`, the state timeline
    only with `pddgw.states`."""
    d = {**record.to_dict(states=states), "seed": seed, "finish_reason": finish_reason}
    if token_ids:
        d["output_token_ids"] = list(output_ids)
    return d


def spans(runs: list[TokenRun]) -> list[dict[str, Any]]:
    """The output's role spans: consecutive emitted runs of one role merged, in order,
    `{"start", "count", "role"}` (a P-RLD-MD output: its RLD span, then its MD span)."""
    out: list[dict[str, Any]] = []
    for r in runs:
        if not r.ids:
            continue
        last = out[-1] if out else None
        if last is not None and last["role"] == r.role and last["start"] + last["count"] == r.position:
            last["count"] += len(r.ids)
        else:
            out.append({"start": r.position, "count": len(r.ids), "role": r.role})
    return out


@dataclass(slots=True)
class _Result:
    """What the format needs at the end of a request."""

    out: Outcome
    text: str
    prompt_tokens: int
    timeline: dict[str, Any]
    incomplete: bool
    runs: list[TokenRun]
    stop_reason: int | str | None = None     # vLLM's: the stop string matched, or the stop token id
    rest: str = ""                           # the end of `text` not streamed with a token
    prompt_ids: tuple[int, ...] = ()         # the prompt (completions' echo, `return_token_ids`)


class _Format:
    """How one route spells its answer, per choice (`index`): SSE events on the way, the final object."""

    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces,
                 index: int = 0, tool_format: ToolFormat = "json", prompt_ids: tuple[int, ...] = ()):
        self.req, self.rid, self.model, self.created = req, rid, model, created
        self.tool_format = tool_format
        self.pieces = pieces
        self.index = index
        self.prompt_ids = prompt_ids
        self.parsed: tuple[str | None, list[ToolCall]] | None = None

    def provenance(self, run: TokenRun) -> dict[str, Any]:
        return delta_extension(run.position, run.role, run.ids if self.req.return_token_ids else None)

    def body_pddgw(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        """The non-streamed object's `pddgw`: the summary and the output's role spans."""
        return {**res.timeline, "spans": spans(runs)}

    @property
    def parses_calls(self) -> bool:
        """Tools given and they may be called (`ToolRequest.may_call`; `tool_format` of OpenAIRoutes)."""
        return self.req.tools is not None and self.req.tools.may_call

    def calls(self, res: _Result) -> tuple[str | None, list[ToolCall]]:
        """(the message's text or None, the calls); parsed once, so that the streamed items and the
        completed response carry the same call ids."""
        if not self.parses_calls:
            return res.text, []
        if self.parsed is None:
            self.parsed = parse_calls(res.text, self.tool_format)
        return self.parsed

    def content(self, runs: list[TokenRun]) -> list[dict[str, Any]]:
        """The chat / responses logprobs of these runs' tokens."""
        return [c for r in runs for c in lpfmt.content(self.pieces, r.ids, r.logprobs)]

    def head(self) -> list[bytes]:
        return []

    def delta(self, run: TokenRun, text: str) -> list[bytes]:
        raise NotImplementedError

    def tail(self, res: _Result, rest: str) -> list[bytes]:
        """The end of this choice: its last text and its finish."""
        raise NotImplementedError

    def close(self, usage: dict[str, Any]) -> list[bytes]:
        """After every choice's tail: what ends the stream (usage: summed over the choices)."""
        return []

    def body(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        raise NotImplementedError

    def error(self, message: str, code: str, param: str | None = None) -> list[bytes]:
        return [_data(error_body(message, code, param))]


def _data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _ChatFormat(_Format):
    object = "chat.completion"

    @property
    def id(self) -> str:
        return "chatcmpl-" + self.rid.removeprefix("resp_")

    def usage(self, res: _Result) -> dict[str, Any]:
        n = len(res.out.output_ids)
        return {"prompt_tokens": res.prompt_tokens, "completion_tokens": n, "total_tokens": res.prompt_tokens + n,
                "prompt_tokens_details": {"cached_tokens": res.out.cached_tokens}}

    def choice(self, delta: dict[str, Any] | str, finish: str | None,
               runs: list[TokenRun] | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
        c = {"index": self.index, "delta": delta, "logprobs": self.logprobs(runs), "finish_reason": finish,
             "stop_reason": stop_reason}
        return self.token_ids(c, runs)

    def token_ids(self, choice: dict[str, Any], runs: list[TokenRun] | None) -> dict[str, Any]:
        """vLLM's `return_token_ids` on a streamed choice: this chunk's output tokens ([] for a chunk
        without any)."""
        if self.req.return_token_ids:
            choice["token_ids"] = [t for r in runs or () for t in r.ids]
        return choice

    def logprobs(self, runs: list[TokenRun] | None) -> dict[str, Any] | None:
        """`choices[].logprobs` of these runs' tokens (None: not asked for, or a chunk without tokens)."""
        if self.req.logprobs is None or runs is None:
            return None
        return {"content": self.content(runs), "refusal": None}

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = {"id": self.id, "object": self.object + ".chunk", "created": self.created, "model": self.model,
               "choices": choices, **extra}
        if self.req.include_usage:
            obj.setdefault("usage", None)
        return _data(obj)

    def head(self) -> list[bytes]:
        role = self.choice({"role": "assistant", "content": ""}, None)
        if not self.req.return_token_ids:
            return [self.chunk([role])]
        # vLLM's role chunk: the prompt's ids, and no output ids yet (not even an empty list).
        del role["token_ids"]
        return [self.chunk([role], prompt_token_ids=list(self.prompt_ids))]

    def delta(self, run: TokenRun, text: str) -> list[bytes]:
        if self.parses_calls:
            # Held back: whether this is a call or content is known at the end.
            return [self.chunk([self.choice({}, None, [run])], pddgw=self.provenance(run))]
        return [self.chunk([self.choice({"content": text}, None, [run])], pddgw=self.provenance(run))]

    def tail(self, res: _Result, rest: str) -> list[bytes]:
        out = []
        content, calls = self.calls(res)
        finish = res.out.finish_reason
        if calls:
            # OpenAI's deltas: per call its index, id, type and name with empty arguments, then
            # the arguments in fragments.
            for k, c in enumerate(calls):
                out.append(self.chunk([self.choice({"tool_calls": [{"index": k, "id": c.id, "type": "function",
                                                                    "function": {"name": c.name, "arguments": ""}}]},
                                                   None)]))
                for j in range(0, len(c.arguments), ARGUMENT_FRAGMENT_CHARS):
                    frag = c.arguments[j : j + ARGUMENT_FRAGMENT_CHARS]
                    out.append(self.chunk([self.choice({"tool_calls": [{"index": k, "function": {"arguments": frag}}]},
                                                       None)]))
            finish = "tool_calls" if finish == "stop" else finish
        elif self.parses_calls and content:
            out.append(self.chunk([self.choice({"content": content}, None)]))
        elif rest:
            out.append(self.chunk([self.choice({"content": rest}, None)]))
        out.append(self.chunk([self.choice({}, finish, stop_reason=res.stop_reason)],
                              pddgw={**res.timeline, "finish_reason": finish} if calls else res.timeline))
        return out

    def close(self, usage: dict[str, Any]) -> list[bytes]:
        return [*([self.chunk([], usage=usage)] if self.req.include_usage else []), _DONE]

    def body(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        content, calls = self.calls(res)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        finish = res.out.finish_reason
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": self.index, "message": message, "logprobs": self.logprobs(runs), "finish_reason": finish,
                  "stop_reason": res.stop_reason}
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": [choice], "usage": self.usage(res), "pddgw": self.body_pddgw(res, runs)}
        if self.req.return_token_ids:
            choice["token_ids"] = list(res.out.output_ids)
            obj["prompt_token_ids"] = list(res.prompt_ids)
        return obj


class _CompletionFormat(_ChatFormat):
    object = "text_completion"

    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces,
                 index: int = 0, tool_format: ToolFormat = "json", prompt_ids: tuple[int, ...] = ()):
        super().__init__(req, rid, model, created, pieces, index, tool_format, prompt_ids)
        self.text_offset = 0        # of the next token string (streamed chunks continue it)
        self.prompt_sent = False    # `return_token_ids`: the prompt's ids went out (in this choice's first chunk)

    @property
    def id(self) -> str:
        return "cmpl-" + self.rid.removeprefix("resp_")

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": choices, **extra}
        if self.req.include_usage:
            obj.setdefault("usage", None)
        return _data(obj)

    def choice(self, delta: dict[str, Any] | str, finish: str | None,
               runs: list[TokenRun] | None = None, stop_reason: int | str | None = None) -> dict[str, Any]:
        text = delta if isinstance(delta, str) else delta.get("content", "")
        c = {"index": self.index, "text": text, "logprobs": self.logprobs(runs), "finish_reason": finish,
             "stop_reason": stop_reason}
        if self.req.return_token_ids and not self.prompt_sent:
            c["prompt_token_ids"] = list(self.prompt_ids)
            self.prompt_sent = True
        return self.token_ids(c, runs)

    def logprobs(self, runs: list[TokenRun] | None) -> dict[str, Any] | None:
        if self.req.logprobs is None or runs is None:
            return None
        obj, self.text_offset = lpfmt.completion(self.pieces, [t for r in runs for t in r.ids],
                                                 [lp for r in runs for lp in r.logprobs], self.text_offset)
        return obj

    def echo_text(self) -> str:
        """The prompt as echoed: the client's string, or its token IDs decoded."""
        if self.req.prompt_text is not None:
            return self.req.prompt_text
        return self.pieces.tok.decode(list(self.req.prompt_token_ids or ()))

    def head(self) -> list[bytes]:
        # Streamed echo (without logprobs: refused at parse): the prompt is the first text.
        return [self.chunk([self.choice(self.echo_text(), None)])] if self.req.echo else []

    def body(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        text = res.text
        if self.req.echo:
            text = self.echo_text() + text
        if self.req.echo and self.req.logprobs is not None:
            # The prompt's entries first (the first token's null), the completion's continue them.
            lps, self.text_offset = lpfmt.prompt_completion(self.pieces, res.prompt_ids, res.out.prompt_logprobs)
            more = self.logprobs(runs)
            assert more is not None
            logprobs: dict[str, Any] | None = {key: lps[key] + more[key] for key in lps}
        else:
            logprobs = self.logprobs(runs)
        choice = {"index": self.index, "text": text, "logprobs": logprobs,
                  "finish_reason": res.out.finish_reason, "stop_reason": res.stop_reason}
        if self.req.vllm_prompt_logprobs:
            choice["prompt_logprobs"] = lpfmt.vllm_prompt(self.pieces, res.prompt_ids, res.out.prompt_logprobs)
        if self.req.return_token_ids:
            # vLLM's: the output's ids only, also with echo (the prompt's are `prompt_token_ids`).
            choice["prompt_token_ids"] = list(res.prompt_ids)
            choice["token_ids"] = list(res.out.output_ids)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(res), "pddgw": self.body_pddgw(res, runs)}


class _ResponsesFormat(_Format):
    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces,
                 index: int = 0, tool_format: ToolFormat = "json", prompt_ids: tuple[int, ...] = ()):
        super().__init__(req, rid, model, created, pieces, index, tool_format, prompt_ids)
        assert req.create is not None
        self.create = req.create
        self.seq = 0

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return (b"event: " + kind.encode() + b"\n"
                + _data({"type": kind, "sequence_number": self.seq, **fields}))

    def obj(self, status: str, res: _Result | None = None) -> dict[str, Any]:
        if res is None:
            return response_object(self.rid, status, self.created, self.model, self.create)
        usage = {"input_tokens": res.prompt_tokens, "input_tokens_details": {"cached_tokens": res.out.cached_tokens},
                 "output_tokens": len(res.out.output_ids),
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": res.prompt_tokens + len(res.out.output_ids)}
        content, calls = self.calls(res)
        return response_object(self.rid, status, self.created, self.model, self.create, text=content,
                               usage=usage, pddgw=res.timeline, logprobs=self.all_logprobs(res), calls=calls)

    def all_logprobs(self, res: _Result) -> list[dict[str, Any]] | None:
        """The output_text's logprobs: every token's, when asked for (else absent)."""
        return None if self.req.logprobs is None else self.content(res.runs)

    def message_head(self) -> list[bytes]:
        item = {**output_message(self.rid, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", item_id=f"msg_{self.rid}", output_index=0,
                           content_index=0, part=part)]

    def head(self) -> list[bytes]:
        # With tools the message's events wait for the end: the output may be calls only.
        return [self.event("response.created", response=self.obj("in_progress")),
                self.event("response.in_progress", response=self.obj("in_progress")),
                *([] if self.parses_calls else self.message_head())]

    def delta(self, run: TokenRun, text: str) -> list[bytes]:
        if self.parses_calls:
            return []
        return [self.event("response.output_text.delta", item_id=f"msg_{self.rid}", output_index=0,
                           content_index=0, delta=text,
                           logprobs=self.content([run]) if self.req.logprobs is not None else [],
                           pddgw=self.provenance(run))]

    def tail(self, res: _Result, rest: str) -> list[bytes]:
        out = []
        content, calls = self.calls(res)
        if self.parses_calls:
            rest = content or ""
            if content is not None:
                out += self.message_head()
        if rest:
            out.append(self.event("response.output_text.delta", item_id=f"msg_{self.rid}", output_index=0,
                                  content_index=0, delta=rest, logprobs=[]))
        status = "incomplete" if res.incomplete else "completed"
        if content is not None:
            where = {"item_id": f"msg_{self.rid}", "output_index": 0, "content_index": 0}
            lps = self.all_logprobs(res)
            out += [self.event("response.output_text.done", **where, text=content, logprobs=lps or []),
                    self.event("response.content_part.done", **where, part=output_text(content, lps)),
                    self.event("response.output_item.done", output_index=0,
                               item=output_message(self.rid, content, status, lps))]
        first = 0 if content is None else 1
        for k, c in enumerate(calls, first):
            out += function_call_events(self.event, k, c)
        return [*out, self.event(f"response.{status}", response=self.obj(status, res))]

    def body(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        obj = self.obj("incomplete" if res.incomplete else "completed", res)
        obj["pddgw"] = self.body_pddgw(res, runs)
        return obj

    def error(self, message: str, code: str, param: str | None = None) -> list[bytes]:
        return [self.event("error", code=code, message=message, param=param)]


def function_call_events(event: Any, index: int, call: ToolCall) -> list[Any]:
    """A function_call output item's stream (HTTP and WebSocket): added (no arguments yet), its
    arguments in fragments, their end, done.  `event(kind, **fields)` spells one event."""
    item_id = "fc_" + call.id.removeprefix("call_")
    out = [event("response.output_item.added", output_index=index,
                 item=function_call_item(call, "in_progress", ""))]
    for j in range(0, len(call.arguments), ARGUMENT_FRAGMENT_CHARS):
        out.append(event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                         delta=call.arguments[j : j + ARGUMENT_FRAGMENT_CHARS]))
    out += [event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                  name=call.name, arguments=call.arguments),
            event("response.output_item.done", output_index=index, item=function_call_item(call))]
    return out


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed: the request's seed + index (mod 2**63).  So choice i of a request
    with seed s samples exactly as a single request with seed s + i."""
    return (seed + index) % SEED_LIMIT


@dataclass(slots=True)
class _Choice:
    """One of a request's best_of generated choices: its router request, its seed, its format, its text."""

    index: int
    rid: str
    sampling: SamplingParams
    fmt: _Format
    text: OutputText
    runs: list[TokenRun] = field(default_factory=list)
    started: bool = False

    def head(self) -> list[bytes]:
        """The format's head events, before this choice's first (chat: its role chunk)."""
        if self.started:
            return []
        self.started = True
        return self.fmt.head()


def _usage(fmt: _Format, results: list[_Result]) -> dict[str, Any]:
    """Chat / completions usage over every choice: the prompt once, the completions summed (OpenAI's
    and vLLM's count); the prompt's cache hit is choice 0's."""
    if not isinstance(fmt, _ChatFormat):
        return {}
    usage = fmt.usage(results[0])
    done = sum(len(r.out.output_ids) for r in results)
    usage.update(completion_tokens=done, total_tokens=usage["prompt_tokens"] + done)
    return usage


def _cumulative_logprob(res: _Result) -> float:
    """A choice's rank for `best_of`: its kept tokens' summed log-probabilities (vLLM's cumulative
    logprob, of the model's raw distribution)."""
    if any(len(r.logprobs) != len(r.ids) for r in res.runs):
        # Asked for at prepare: a run without them would rank on a partial sum.
        raise RuntimeError("best_of: a choice's tokens came without their logprobs")
    return math.fsum(lp.logprob for r in res.runs for lp in r.logprobs)


def _best(choices: list[_Choice], results: list[_Result], n: int) -> list[tuple[_Choice, _Result]]:
    """The n returned of the best_of generated: the most likely first, ties to the lower
    generation index; greedy ones are all the same sequence (their sums may differ in the last
    bits with the batches they ran in), so the first n."""
    pairs = list(zip(choices, results))
    if len(pairs) == n or choices[0].sampling.greedy:
        return pairs[:n]
    return sorted(pairs, key=lambda p: (-_cumulative_logprob(p[1]), p[0].index))[:n]


def _merged(bodies: list[dict[str, Any]], usage: dict[str, Any]) -> dict[str, Any]:
    """best_of > 1: the first returned choice's object with every returned choice's (each carrying
    its own `pddgw` timeline) and the usage summed over every generated one."""
    return {**bodies[0], "choices": [{**b["choices"][0], "pddgw": b["pddgw"]} for b in bodies], "usage": usage}


async def _all(coros: list[Coroutine[Any, Any, _Result]]) -> list[_Result]:
    """Every result, in order; one failing (or this being cancelled) cancels and awaits the others."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


_FORMATS: dict[str, type[_Format]] = {"chat": _ChatFormat, "completion": _CompletionFormat,
                                      "response": _ResponsesFormat}


# ---- the routes -----------------------------------------------------------------------


class _ClientGone(Exception):
    """The client closed its connection before its answer ended."""


class _Sse:
    """An SSE response whose headers go out with the first events; a failed write marks the client gone."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp: web.StreamResponse | None = None
        self.gone = asyncio.Event()
        # n > 1: the choices send concurrently; one write (and the headers) at a time.
        self._lock = asyncio.Lock()

    async def send(self, events: list[bytes]) -> None:
        async with self._lock:
            await self._send(events)

    async def _send(self, events: list[bytes]) -> None:
        if self.gone.is_set() or not events:
            return
        try:
            if self.resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Accel-Buffering": "no"})
                self.resp = resp
                await resp.prepare(self.request)
            await self.resp.write(b"".join(events))
        except (ConnectionError, RuntimeError):
            self.gone.set()

    async def end(self) -> web.StreamResponse:
        assert self.resp is not None
        if not self.gone.is_set():
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.resp.write_eof()
        return self.resp


async def _watch(request: web.Request, gone: asyncio.Event) -> None:
    """Returns when the client's connection is closed (or `gone` is set by a failed write)."""
    while not gone.is_set():
        t = request.transport
        if t is None or t.is_closing():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DISCONNECT_POLL_S):
                await gone.wait()


async def _until_gone(request: web.Request, gone: asyncio.Event, work: Awaitable[Outcome]) -> Outcome:
    """Await `work` as a task; the client going away first cancels it (-> _ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_watch(request, gone))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:      # this handler was cancelled (server shutdown): so is the request
        watcher.cancel()
        await _cancel(task)
        raise
    watcher.cancel()
    if not task.done():
        await _cancel(task)
        raise _ClientGone()
    return task.result()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class OpenAIRoutes:
    """The handlers; server.py's `build_app` registers them."""

    def __init__(self, door: FrontDoor):
        self.door = door
        self.started = int(time.time())

    # ---- models ----
    def _model(self) -> dict[str, Any]:
        return {"id": self.door.model_name, "object": "model", "created": self.started, "owned_by": "pddgw"}

    async def models(self, request: web.Request) -> web.Response:
        if not self.door.authorized(request):
            return _unauthorized()
        return web.json_response({"object": "list", "data": [self._model()]}, dumps=_dumps)

    async def model(self, request: web.Request) -> web.Response:
        if not self.door.authorized(request):
            return _unauthorized()
        name = request.match_info["model"]
        if name != self.door.model_name:
            return error_response(f"the model {brief(name)} does not exist (this server serves "
                                  f"{self.door.model_name!r})", "model_not_found", "model")
        return web.json_response(self._model(), dumps=_dumps)

    # ---- generation ----
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completion")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "response")

    async def _generate(self, request: web.Request, kind: str) -> web.StreamResponse:
        door = self.door
        if not door.authorized(request):
            return _unauthorized()
        # Admission before the first await (the body read): the check and the count are one step,
        # and the slot is released in this one place, whatever the request's end.
        slot = door.admission.try_acquire()
        if slot is None:
            return error_response("server busy: too many requests in flight ([server] max_concurrent_requests)",
                                  "rate_limit_exceeded")
        with slot:
            return await self._admitted(request, kind)

    async def _admitted(self, request: web.Request, kind: str) -> web.StreamResponse:
        door = self.door
        try:
            raw = await door.read_body(request)
        except ApiError as e:
            return error_response(str(e), e.code, e.param)
        except ClientTooSlow:
            return web.Response(status=408)      # already written: the connection is closed
        try:
            req = self._parse(raw, kind)
            if req.model is not None and req.model != door.model_name:
                raise ApiError(f"the model {brief(req.model)} does not exist (this server serves "
                               f"{door.model_name!r})", "model", "model_not_found")
            door.check_steering(request, req.pipeline, req.handoff_mode)
            # A grammar is checked (and a template with tools rendered) on a worker thread.
            prep = (await asyncio.to_thread(self._prepare, req)
                    if door.heavy(req.messages, len(raw)) or req.sampling.grammar is not None or req.chat is not None
                    else self._prepare(req))
        except ApiError as e:
            return error_response(str(e), e.code, e.param)
        except Exception as e:   # a bug: the client still hears why
            log.exception("openai_prepare_failed", route=kind)
            return error_response(f"internal error: {type(e).__name__}: {e}", "server_error")
        return await self._run(request, req, prep)

    def _parse(self, raw: bytes, kind: str) -> GenRequest:
        d = json_body(raw)
        if kind == "chat":
            return parse_chat(d)
        if kind == "completion":
            return parse_completion(d, self.door.router.spec.vocab_size)
        return parse_response(d, self.door.max_prompt)

    def _prepare(self, req: GenRequest) -> Prepared:
        ids = req.prompt_token_ids
        if req.prompt_text is not None:
            ids = tuple(self.door.tok.encode(req.prompt_text))
            if not ids:
                raise ApiError("'prompt' encodes to no tokens", "prompt")
        sampling = req.sampling
        if req.chat is not None and ids is None:
            # Tools and tool messages: the template gets them as transformers passes them.
            try:
                ids = tuple(self.door.tok.apply_chat_template(
                    list(req.chat), tools=req.tools.templated() if req.tools is not None else None))
            except RequestError as e:
                raise ApiError(str(e), req.input_param) from None
        if req.tools is not None:
            forced = grammar_for(req.tools, self.tool_format)
            if forced is not None:
                sampling = _with_grammar(sampling, forced, "tool_choice")
        if sampling.grammar is not None:
            param = "tool_choice" if req.tools is not None and req.tools.forced else (
                "text.format" if req.kind == "response" else "response_format")
            # Refused here as the engines would: a grammar's output ends only by sampling EOS.
            if not grammar_stops(self.door.tok.eos_token_ids, self.door.router.spec.vocab_size):
                raise ApiError(f"'{param}' cannot be enforced: {NO_EOS_REASON}", param)
            try:
                check_spec(*sampling.grammar)
            except ValueError as e:
                raise ApiError(f"'{param}': the schema cannot be enforced: {e}", param) from None
        # best_of > n ranks by the sampled tokens' logprobs: asked for (k = 0: the sampled token's
        # own) whether or not the client wants them; the formats return them only if it does.
        logprobs = 0 if req.logprobs is None and req.best_of > req.n else req.logprobs
        return self.door.prepare(ids, req.messages, req.max_tokens, sampling, req.input_param, logprobs)

    def prepare_response(self, req: GenRequest) -> Prepared:
        """A Responses API request's prompt and sampling (the WebSocket door's; blocking: a
        template with tools, a grammar's check)."""
        return self._prepare(req)

    @functools.cached_property
    def tool_format(self) -> ToolFormat:
        """The call format the served model's chat template teaches (api/toolcalls.py)."""
        tpl = getattr(self.door.tok, "chat_template", None)
        return format_for(None if tpl is None else "\n".join(tpl.sources.values()))

    async def _run(self, request: web.Request, req: GenRequest, prep: Prepared) -> web.StreamResponse:
        """Generate the request's choices on the router and answer (streamed or not).

        Choice i is a router request of its own, with seed `choice_seed(seed, i)` and the
        same prompt; choices 1..best_of-1 start once choice 0 has its first token (P has then
        prefilled the prompt, so their prefills find it in P's prefix cache).  A stop
        string ends a choice's text at the door and stops its router request at once
        (StopRequest: cancelled on every node); its usage counts the tokens kept."""
        door = self.door
        rid = new_request_id()
        if req.client_request_id is not None:
            # Logged, not used: the router's ids must be unique across every client's requests.
            log.info("client_request_id", request_id=rid, client_request_id=req.client_request_id)
        created = int(time.time())
        choices = [_Choice(i, rid if i == 0 else f"{rid}_{i}",
                           replace(prep.sampling, seed=choice_seed(prep.sampling.seed, i)),
                           _FORMATS[req.kind](req, rid, door.model_name, created, door.pieces, i,
                                              self.tool_format, tuple(prep.ids)),
                           door.output_text(prep.sampling, req.stop))
                   for i in range(req.best_of)]
        fmt = choices[0].fmt
        sse = _Sse(request) if req.stream else None
        gone = sse.gone if sse is not None else asyncio.Event()
        first = asyncio.Event()         # choice 0 has a token (or ended): the others may start

        async def one(c: _Choice) -> _Result:
            async def emit(run: TokenRun) -> None:
                text, kept = c.text.push(run.ids)
                if kept < len(run.ids):      # a stop string ended the text inside this run
                    run = dataclasses.replace(run, ids=run.ids[:kept], logprobs=run.logprobs[:kept])
                c.runs.append(run)
                first.set()
                if sse is not None:
                    await sse.send(c.head() + c.fmt.delta(run, text))
                if c.text.stop is not None:
                    raise StopRequest()

            if c.index > 0:
                await first.wait()
            try:
                out = await door.router.run(c.rid, prep.ids, c.sampling, emit, req.pipeline, req.handoff_mode)
            finally:
                first.set()
            res = self._result(c, out, prep)
            if sse is not None:
                await sse.send(c.head() + c.fmt.tail(res, res.rest))
            return res

        try:
            results = await _until_gone(request, gone, _all([one(c) for c in choices]))
            usage = _usage(fmt, results)
            if sse is None:
                kept = _best(choices, results, req.n)
                for rank, (c, _) in enumerate(kept):
                    c.fmt.index = rank
                bodies = [c.fmt.body(res, res.runs) for c, res in kept]
                return web.json_response(_merged(bodies, usage) if req.best_of > 1 else bodies[0], dumps=_dumps)
            await sse.send(fmt.close(usage))
            return await sse.end()
        except _ClientGone:
            log.info("client_gone", request_id=rid)
            return sse.resp if sse is not None and sse.resp is not None else web.Response(status=499)
        except RouterError as e:
            return await self._fail(sse, fmt, str(e), e.code)
        except Exception as e:   # a bug: the client still hears why its answer ended
            log.exception("openai_respond_failed", request_id=rid)
            return await self._fail(sse, fmt, f"internal error: {type(e).__name__}: {e}", "server_error")

    @staticmethod
    def _result(c: _Choice, out: Outcome, prep: Prepared) -> _Result:
        """One choice's end: the router's outcome, cut where its text ended (a stop string)."""
        rest = c.text.end()
        ids = tuple(c.text.ids)
        reason = "stop" if c.text.stop is not None else out.finish_reason
        stop_reason: int | str | None = c.text.stop
        if stop_reason is None and reason == "stop" and ids and ids[-1] in c.sampling.stop_token_ids:
            stop_reason = ids[-1]
        out = dataclasses.replace(out, output_ids=ids, finish_reason=reason)
        text, runs = c.text.text, c.runs
        if c.fmt.req.score_only:
            # Echo with max_tokens 0: the prompt only; the one token generated is not the client's.
            out = dataclasses.replace(out, output_ids=())
            text, runs, rest = "", [], ""
        req = c.fmt.req
        timeline = summary(out.record, c.sampling.seed, reason, out.output_ids, token_ids=req.return_token_ids,
                           states=req.states)
        return _Result(out, text, len(prep.ids), timeline,
                       incomplete=prep.clamped and reason == "length", runs=runs, stop_reason=stop_reason,
                       rest=rest, prompt_ids=tuple(prep.ids))

    @staticmethod
    async def _fail(sse: _Sse | None, fmt: _Format, message: str, code: str) -> web.StreamResponse:
        if sse is None or sse.resp is None:
            return error_response(message, code)
        await sse.send(fmt.error(message, code))
        return await sse.end()


def _unauthorized() -> web.Response:
    return error_response("invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")


@web.middleware
async def openai_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown /v1/ path or method answers with an OpenAI-shaped error, not aiohttp's text page;
    and every request refused with a 4xx, whatever its route, is logged here, once: `request_refused`
    with the route, the field (the error's `param`), the reason (its message) and the status."""
    try:
        resp = await _not_found(request, handler)
    except web.HTTPException as e:
        if 400 <= e.status < 500:
            _refused(request, e.status, None, e.reason)
        raise
    # 499: the client went away mid-answer (logged as client_gone), nothing was refused.
    if 400 <= resp.status < 500 and resp.status != 499:
        field_name, reason = resp.get(REFUSAL, (None, resp.reason))
        _refused(request, resp.status, field_name, reason)
    return resp


def _refused(request: web.Request, status: int, field_name: str | None, reason: str) -> None:
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else request.path[:200]
    log.info("request_refused", route=f"{request.method} {route}", field=field_name, reason=reason,
             status=status)


async def _not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        if not request.path.startswith("/v1/"):
            raise
        return error_response(f"unknown route {request.method} {brief(request.path)}", "not_found")
    except web.HTTPMethodNotAllowed as e:
        if not request.path.startswith("/v1/"):
            raise
        return error_response(f"{request.method} is not allowed on {brief(request.path)} (allowed: "
                              f"{', '.join(sorted(e.allowed_methods))})", "method_not_allowed")
