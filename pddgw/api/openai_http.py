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
  2. Decode and validate the JSON body at the edge -> 400 naming the field in `param`; a field
     this server does not implement -> 400 `unsupported_parameter` naming it; a `model` other
     than the served one -> 404 `model_not_found`.
  3. Who may steer: a `pddgw` extension that forces a pipeline or handoff mode
     (`{"pddgw": {"pipeline": "P-MD", "handoff_mode": "catch-up"}}`) is an operator's tool: it
     needs an admin key (`[server] admin_keys`) or `[server] allow_request_steering = true`,
     else 403 `permission_denied` naming `pddgw.pipeline` / `pddgw.handoff_mode`.
  4. The front door's bound (`max_concurrent_requests`) -> 429 `rate_limit_exceeded`.
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
  * Sampling: `temperature` [0, 2] (0 = greedy), `top_p` (0, 1], `seed` [0, 2**63) (none: the
    router draws one; it is in the `pddgw` timeline), and vLLM's `top_k` (an integer in [-1, 2**31):
    keep the k most probable tokens; -1 or 0 = no filter) and `min_p` [0, 1] (keep tokens with
    p >= min_p * p_max; 0 = no filter), which the `openai` client sends in `extra_body`.  The
    response object echoes `temperature` and `top_p` only, as OpenAI's.  `n` must be 1 (else 400
    naming `n`); `stop` is not supported (400 `unsupported_parameter` naming `stop`; null or []
    are accepted); penalties other than 0, tools, `echo`, `suffix`, `best_of` > 1 likewise.
  * Log-probabilities (api/logprobs.py: the model's raw distribution, the shapes): chat
    `logprobs: true` with `top_logprobs` 0..20 (`top_logprobs` without `logprobs: true` -> 400
    naming it) -> `choices[].logprobs.content` in the object and in each chunk; completions
    `logprobs` 0..20 -> `choices[].logprobs` {tokens, token_logprobs, top_logprobs, text_offset};
    responses `include: ["message.output_text.logprobs"]` with `top_logprobs` 0..20 -> the
    output_text part's and each `response.output_text.delta`'s `logprobs`.  Out of range: 400
    naming the parameter.  Not asked for: `logprobs` is null (chat, completions) / [] (responses
    SSE events), as before.
  * The `pddgw` extension on every answer: each chunk / delta carries `"pddgw": {position,
    token_ids, role}`; the final chunk (the one with `finish_reason`) or event and the
    non-streamed object carry the timeline (pipeline, handoff, TTFT, WAN KV bytes, states, seed,
    finish_reason, output_token_ids; non-streamed also `runs`: the per-token provenance).
  * Usage: `prompt_tokens_details.cached_tokens` (chat, completions) and
    `input_tokens_details.cached_tokens` (responses) are MD's prefix hit for the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson
import structlog
from aiohttp import web

from pddgw.api import logprobs as lpfmt
from pddgw.api.responses import (ApiError, CreateResponse, SamplingFields, brief, output_message, output_text,
                                 parse_create_body, parse_extension, parse_sampling, response_object,
                                 top_logprobs_param)
from pddgw.pipeline.ordering import TokenRun
from pddgw.pipeline.router import Outcome, RouterError, new_request_id

if TYPE_CHECKING:
    from pddgw.api.door import FrontDoor, Prepared

log = structlog.get_logger(__name__)

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


def error_response(message: str, code: str, param: str | None = None) -> web.Response:
    status, _ = ERRORS.get(code, ERRORS["server_error"])
    return web.json_response(error_body(message, code, param), status=status, dumps=_dumps)


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
    sampling: SamplingFields
    stream: bool
    include_usage: bool
    model: str | None
    pipeline: str | None
    handoff_mode: str | None
    input_param: str                             # the field a too-long prompt is blamed on
    create: CreateResponse | None = None         # responses: the decoded request
    logprobs: int | None = None                  # None: none; k: each token's + k top alternatives


_CHAT_KEYS = {"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
              "seed", "stream", "stream_options", "n", "stop", "user", "store", "metadata", "logprobs",
              "top_logprobs", "presence_penalty", "frequency_penalty", "pddgw"}
_COMPLETION_KEYS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stream",
                    "stream_options", "n", "stop", "user", "logprobs", "echo", "suffix", "best_of",
                    "presence_penalty", "frequency_penalty", "pddgw"}
_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _unsupported(name: str, why: str = "is not supported by this server") -> ApiError:
    return ApiError(f"'{name}' {why}", name, "unsupported_parameter")


def _check_keys(d: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise _unsupported(unknown[0][:64], "is not a supported parameter")


def _pos_int(d: dict[str, Any], key: str) -> int | None:
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ApiError(f"'{key}' must be a positive integer", key)
    return v


def _common(d: dict[str, Any]) -> dict[str, Any]:
    """The sampling, streaming and extension fields chat and completions share."""
    n = d.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ApiError(f"'n' must be 1 (one choice per request), got {brief(n)}", "n")
    stop = d.get("stop")
    if stop not in (None, []):
        raise _unsupported("stop", "(stop sequences) is not supported: end on the model's own stop tokens "
                           "or max tokens")
    for key in ("presence_penalty", "frequency_penalty"):
        if d.get(key) not in (None, 0, 0.0):
            raise _unsupported(key, "other than 0 is not supported")
    sampling = parse_sampling(d)
    stream = d.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean", "stream")
    opts = d.get("stream_options")
    include_usage = False
    if opts is not None:
        if not stream:
            raise ApiError("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise ApiError("'stream_options' may only set 'include_usage'", "stream_options")
        include_usage = opts.get("include_usage")
        if include_usage is not None and not isinstance(include_usage, bool):
            raise ApiError("'stream_options.include_usage' must be a boolean", "stream_options.include_usage")
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", "model")
    pipeline, handoff_mode = parse_extension(d)
    return {"sampling": sampling, "stream": bool(stream), "include_usage": bool(include_usage), "model": model,
            "pipeline": pipeline, "handoff_mode": handoff_mode}


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


def parse_chat(d: Any) -> GenRequest:
    if not isinstance(d, dict):
        raise ApiError("the request body must be a JSON object")
    _check_keys(d, _CHAT_KEYS)
    msgs = d.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", "messages")
    out: list[tuple[str, str]] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(f"{where} must be an object", where)
        role = m.get("role")
        if role not in _CHAT_ROLES:
            raise ApiError(f"{where}.role must be one of {', '.join(_CHAT_ROLES)}", f"{where}.role")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise _unsupported(f"{where}.{extra[0][:64]}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        out.append((_CHAT_ROLES[role], _chat_content(content, f"{where}.content")))
    max_tokens = _pos_int(d, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _pos_int(d, "max_tokens")
    return GenRequest("chat", tuple(out), None, None, max_tokens, input_param="messages",
                      logprobs=_chat_logprobs(d), **_common(d))


def _chat_logprobs(d: dict[str, Any]) -> int | None:
    """Chat's `logprobs` (a boolean) and `top_logprobs` (0..20, only with logprobs: true)."""
    want = d.get("logprobs")
    if want is not None and not isinstance(want, bool):
        raise ApiError("'logprobs' must be a boolean", "logprobs")
    top = top_logprobs_param(d, "top_logprobs")
    if top is not None and not want:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if want else None


def parse_completion(d: Any, vocab_size: int) -> GenRequest:
    if not isinstance(d, dict):
        raise ApiError("the request body must be a JSON object")
    _check_keys(d, _COMPLETION_KEYS)
    if d.get("echo"):
        raise _unsupported("echo")
    if d.get("suffix") is not None:
        raise _unsupported("suffix")
    if d.get("best_of") not in (None, 1):
        raise _unsupported("best_of", "other than 1 is not supported")
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
    return GenRequest("completion", (), ids, text, _pos_int(d, "max_tokens"), input_param="prompt",
                      logprobs=top_logprobs_param(d, "logprobs"), **_common(d))


def parse_response(d: Any, max_prompt_tokens: int) -> GenRequest:
    req, stream = parse_create_body(d, max_prompt_tokens)
    return GenRequest("response", req.messages, req.prompt_token_ids, None, req.max_output_tokens, req.sampling,
                      stream, False, req.model, req.pipeline, req.handoff_mode,
                      "prompt_token_ids" if req.prompt_token_ids is not None else "input", req, req.logprobs)


# ---- answers --------------------------------------------------------------------------


def _provenance(run: TokenRun) -> dict[str, Any]:
    return {"position": run.position, "token_ids": list(run.token_ids), "role": run.role}


@dataclass(slots=True)
class _Result:
    """What the format needs at the end of a request."""

    out: Outcome
    text: str
    prompt_tokens: int
    timeline: dict[str, Any]
    incomplete: bool
    runs: list[TokenRun]


class _Format:
    """How one route spells its answer: SSE events on the way and the final object."""

    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces):
        self.req, self.rid, self.model, self.created = req, rid, model, created
        self.pieces = pieces

    def content(self, runs: list[TokenRun]) -> list[dict[str, Any]]:
        """The chat / responses logprobs of these runs' tokens."""
        return [c for r in runs for c in lpfmt.content(self.pieces, r.token_ids, r.logprobs)]

    def head(self) -> list[bytes]:
        return []

    def delta(self, run: TokenRun, text: str) -> list[bytes]:
        raise NotImplementedError

    def tail(self, res: _Result, rest: str) -> list[bytes]:
        raise NotImplementedError

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
               runs: list[TokenRun] | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": self.logprobs(runs), "finish_reason": finish}

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
        return [self.chunk([self.choice({"role": "assistant", "content": ""}, None)])]

    def delta(self, run: TokenRun, text: str) -> list[bytes]:
        return [self.chunk([self.choice({"content": text}, None, [run])], pddgw=_provenance(run))]

    def tail(self, res: _Result, rest: str) -> list[bytes]:
        out = []
        if rest:
            out.append(self.chunk([self.choice({"content": rest}, None)]))
        out.append(self.chunk([self.choice({}, res.out.finish_reason)], pddgw=res.timeline))
        if self.req.include_usage:
            out.append(self.chunk([], usage=self.usage(res)))
        return [*out, _DONE]

    def body(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": res.text, "refusal": None},
                             "logprobs": self.logprobs(runs), "finish_reason": res.out.finish_reason}],
                "usage": self.usage(res), "pddgw": {**res.timeline, "runs": [_provenance(r) for r in runs]}}


class _CompletionFormat(_ChatFormat):
    object = "text_completion"

    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces):
        super().__init__(req, rid, model, created, pieces)
        self.text_offset = 0        # of the next token string (streamed chunks continue it)

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
               runs: list[TokenRun] | None = None) -> dict[str, Any]:
        text = delta if isinstance(delta, str) else delta.get("content", "")
        return {"index": 0, "text": text, "logprobs": self.logprobs(runs), "finish_reason": finish}

    def logprobs(self, runs: list[TokenRun] | None) -> dict[str, Any] | None:
        if self.req.logprobs is None or runs is None:
            return None
        obj, self.text_offset = lpfmt.completion(self.pieces, [t for r in runs for t in r.token_ids],
                                                 [lp for r in runs for lp in r.logprobs], self.text_offset)
        return obj

    def head(self) -> list[bytes]:
        return []

    def body(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": res.text, "logprobs": self.logprobs(runs),
                             "finish_reason": res.out.finish_reason}],
                "usage": self.usage(res), "pddgw": {**res.timeline, "runs": [_provenance(r) for r in runs]}}


class _ResponsesFormat(_Format):
    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces):
        super().__init__(req, rid, model, created, pieces)
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
        return response_object(self.rid, status, self.created, self.model, self.create, text=res.text,
                               usage=usage, pddgw=res.timeline, logprobs=self.all_logprobs(res))

    def all_logprobs(self, res: _Result) -> list[dict[str, Any]] | None:
        """The output_text's logprobs: every token's, when asked for (else absent)."""
        return None if self.req.logprobs is None else self.content(res.runs)

    def head(self) -> list[bytes]:
        item = {**output_message(self.rid, "", "in_progress"), "content": []}
        part = {"type": "output_text", "text": "", "annotations": []}
        return [self.event("response.created", response=self.obj("in_progress")),
                self.event("response.in_progress", response=self.obj("in_progress")),
                self.event("response.output_item.added", output_index=0, item=item),
                self.event("response.content_part.added", item_id=f"msg_{self.rid}", output_index=0,
                           content_index=0, part=part)]

    def delta(self, run: TokenRun, text: str) -> list[bytes]:
        return [self.event("response.output_text.delta", item_id=f"msg_{self.rid}", output_index=0,
                           content_index=0, delta=text,
                           logprobs=self.content([run]) if self.req.logprobs is not None else [],
                           pddgw=_provenance(run))]

    def tail(self, res: _Result, rest: str) -> list[bytes]:
        out = []
        if rest:
            out.append(self.event("response.output_text.delta", item_id=f"msg_{self.rid}", output_index=0,
                                  content_index=0, delta=rest, logprobs=[]))
        status = "incomplete" if res.incomplete else "completed"
        where = {"item_id": f"msg_{self.rid}", "output_index": 0, "content_index": 0}
        lps = self.all_logprobs(res)
        return [*out,
                self.event("response.output_text.done", **where, text=res.text, logprobs=lps or []),
                self.event("response.content_part.done", **where, part=output_text(res.text, lps)),
                self.event("response.output_item.done", output_index=0,
                           item=output_message(self.rid, res.text, status, lps)),
                self.event(f"response.{status}", response=self.obj(status, res))]

    def body(self, res: _Result, runs: list[TokenRun]) -> dict[str, Any]:
        obj = self.obj("incomplete" if res.incomplete else "completed", res)
        obj["pddgw"] = {**res.timeline, "runs": [_provenance(r) for r in runs]}
        return obj

    def error(self, message: str, code: str, param: str | None = None) -> list[bytes]:
        return [self.event("error", code=code, message=message, param=param)]


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

    async def send(self, events: list[bytes]) -> None:
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
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return error_response(f"request body over {door.cfg.server.max_message_bytes} bytes "
                                  "([server] max_message_bytes)", "request_too_large")
        try:
            req = self._parse(raw, kind)
            if req.model is not None and req.model != door.model_name:
                raise ApiError(f"the model {brief(req.model)} does not exist (this server serves "
                               f"{door.model_name!r})", "model", "model_not_found")
            door.check_steering(request, req.pipeline, req.handoff_mode)
            if door.active >= door.cfg.server.max_concurrent_requests:
                raise ApiError("server busy: too many requests in flight ([server] max_concurrent_requests)",
                               None, "rate_limit_exceeded")
            prep = (await asyncio.to_thread(self._prepare, req) if door.heavy(req.messages, len(raw))
                    else self._prepare(req))
        except ApiError as e:
            return error_response(str(e), e.code, e.param)
        except Exception as e:   # a bug: the client still hears why
            log.exception("openai_prepare_failed", route=kind)
            return error_response(f"internal error: {type(e).__name__}: {e}", "server_error")
        door.active += 1
        try:
            return await self._run(request, req, prep)
        finally:
            door.active -= 1

    def _parse(self, raw: bytes, kind: str) -> GenRequest:
        try:
            d = orjson.loads(raw)
        except orjson.JSONDecodeError as e:
            raise ApiError(f"the request body is not valid JSON: {e}") from None
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
        return self.door.prepare(ids, req.messages, req.max_tokens, req.sampling, req.input_param, req.logprobs)

    async def _run(self, request: web.Request, req: GenRequest, prep: Prepared) -> web.StreamResponse:
        door = self.door
        rid = new_request_id()
        fmt = _FORMATS[req.kind](req, rid, door.model_name, int(time.time()), door.pieces)
        sse = _Sse(request) if req.stream else None
        gone = sse.gone if sse is not None else asyncio.Event()
        detok = door.detokenizer()
        runs: list[TokenRun] = []
        sent: list[str] = []

        async def emit(run: TokenRun) -> None:
            text = detok.push(run.token_ids)
            runs.append(run)
            if sse is None:
                return
            sent.append(text)
            await sse.send((fmt.head() if sse.resp is None else []) + fmt.delta(run, text))

        try:
            out = await _until_gone(request, gone, door.router.run(rid, prep.ids, prep.sampling, emit,
                                                                   req.pipeline, req.handoff_mode))
            text = door.tok.decode(list(out.output_ids))
            timeline = {**out.record.to_dict(), "seed": prep.sampling.seed, "finish_reason": out.finish_reason,
                        "output_token_ids": list(out.output_ids)}
            res = _Result(out, text, len(prep.ids), timeline,
                          incomplete=prep.clamped and out.finish_reason == "length", runs=runs)
            if sse is None:
                return web.json_response(fmt.body(res, runs), dumps=_dumps)
            streamed = "".join(sent)
            rest = text[len(streamed):] if text.startswith(streamed) else ""
            await sse.send((fmt.head() if sse.resp is None else []) + fmt.tail(res, rest))
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
    async def _fail(sse: _Sse | None, fmt: _Format, message: str, code: str) -> web.StreamResponse:
        if sse is None or sse.resp is None:
            return error_response(message, code)
        await sse.send(fmt.error(message, code))
        return await sse.end()


def _unauthorized() -> web.Response:
    return error_response("invalid or missing API key (Authorization: Bearer KEY)", "invalid_api_key")


@web.middleware
async def openai_not_found(request: web.Request, handler: Any) -> web.StreamResponse:
    """An unknown /v1/ path or method answers with an OpenAI-shaped error, not aiohttp's text page."""
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
