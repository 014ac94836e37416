"""OpenAI Responses API (WebSocket mode) events, decoded and validated at the edge.

Client events: `response.create` (the POST /v1/responses body fields at top
level; `prompt_token_ids` may replace `input`; an optional `stream_id` is
echoed on every server event of that response so several responses can be
multiplexed on one socket) and `response.cancel` (`response_id`).

Server events: `response.created`, `response.output_text.delta` (with the
`pddgw` extension: position, token_ids, role), `response.completed` (with
`usage` and the `pddgw` timeline) and `error`.

Log-probabilities, opt-in as in the HTTP API: `include:
["message.output_text.logprobs"]` with `top_logprobs` 0..20 (alternatives per
token; without the include it asks for nothing, as in vLLM).  Each delta
event then carries `logprobs` for its tokens and the completed response's
output_text part all of them (shape: api/logprobs.py); absent otherwise.  The final event is
`response.completed` also when the response is `"status": "incomplete"`
(cut at the context length, see openai_http.py).

`parse_create_body` decodes the same fields from a POST /v1/responses body
(HTTP: no `type`, `stream` a boolean).
"""

from __future__ import annotations

import reprlib
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from pddgw.engines.types import MAX_LOGPROBS
from pddgw.pipeline.protocol import TOP_K_LIMIT

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512
_ROLES = ("system", "developer", "user", "assistant")
MAX_STREAM_ID_LEN = 128

# Error messages quote what the client sent; a bounded quote keeps a 1 MiB
# field from coming back as a larger error event.
_QUOTE_LEN = 64
_quote = reprlib.Repr()
_quote.maxstring = _quote.maxother = _quote.maxlong = _QUOTE_LEN
_quote.maxlist = _quote.maxdict = 4
_quote.maxlevel = 2


def brief(value: Any) -> str:
    """repr(value) cut to a few dozen characters, for quoting client input in error messages."""
    return _quote.repr(value)


class ApiError(ValueError):
    """A client event is invalid; `param` names the offending field.

    `stream_id` is the event's own, when it had a valid one, so that a
    client multiplexing responses knows which of its requests failed.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request_error"):
        super().__init__(message)
        self.param = param
        self.code = code
        self.stream_id: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """A request's sampling fields, decoded the same way on every route (`parse_sampling`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0: no top-k filter (a request's -1, vLLM's spelling of it, arrives as 0)
    min_p: float = 0.0          # 0: no min-p filter
    seed: int | None = None     # None: the router draws one


@dataclass(frozen=True, slots=True)
class CreateResponse:
    type: Literal["response.create"]
    messages: tuple[tuple[str, str], ...]        # (role, text); empty when prompt_token_ids
    prompt_token_ids: tuple[int, ...] | None
    max_output_tokens: int | None
    sampling: SamplingFields
    metadata: dict[str, str] = field(default_factory=dict)
    stream_id: str | None = None
    model: str | None = None
    # pddgw extension: force this request's pipeline / handoff mode (tests, benchmarks).
    pipeline: Literal["P-MD", "P-RLD-MD", "P-RLD"] | None = None
    handoff_mode: Literal["one-shot", "catch-up"] | None = None
    # None: no log-probabilities; k: each token's plus k top alternatives.
    logprobs: int | None = None


@dataclass(frozen=True, slots=True)
class CancelResponse:
    type: Literal["response.cancel"]
    response_id: str


ClientEvent = CreateResponse | CancelResponse

_CREATE_KEYS = {"type", "model", "input", "instructions", "prompt_token_ids", "max_output_tokens",
                "temperature", "top_p", "top_k", "min_p", "seed", "metadata", "stream_id", "store", "stream",
                "pddgw", "include", "top_logprobs"}
INCLUDE_LOGPROBS = "message.output_text.logprobs"


def top_logprobs_param(d: dict[str, Any], key: str) -> int | None:
    """An optional number of top alternatives, 0..MAX_LOGPROBS; ApiError naming `key`."""
    v = d.get(key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
        raise ApiError(f"'{key}' must be an integer in [0, {MAX_LOGPROBS}], got {brief(v)}", key)
    return v


def _include_logprobs(d: dict[str, Any]) -> int | None:
    """`include` + `top_logprobs` -> the logprobs asked for (None: none)."""
    inc = d.get("include")
    if inc is not None:
        if not isinstance(inc, list) or not all(isinstance(x, str) for x in inc):
            raise ApiError("'include' must be a list of strings", "include")
        other = [x for x in inc if x != INCLUDE_LOGPROBS]
        if other:
            raise ApiError(f"'include' value {brief(other[0])} is not supported (only "
                           f"{INCLUDE_LOGPROBS!r})", "include", "unsupported_parameter")
    top = top_logprobs_param(d, "top_logprobs")
    return (top or 0) if inc and INCLUDE_LOGPROBS in inc else None


def parse_extension(d: dict[str, Any]) -> tuple[Any, Any]:
    """The `pddgw` extension of a request -> (pipeline, handoff_mode), each None when not forced."""
    ext = d.get("pddgw")
    if ext is None:
        return None, None
    if not isinstance(ext, dict) or set(ext) - {"pipeline", "handoff_mode"}:
        raise ApiError("'pddgw' may only set 'pipeline' and 'handoff_mode'", "pddgw")
    pipeline, mode = ext.get("pipeline"), ext.get("handoff_mode")
    if pipeline not in (None, "P-MD", "P-RLD-MD", "P-RLD"):
        raise ApiError("pddgw.pipeline must be 'P-MD', 'P-RLD-MD' or 'P-RLD'", "pddgw.pipeline")
    if mode not in (None, "one-shot", "catch-up"):
        raise ApiError("pddgw.handoff_mode must be 'one-shot' or 'catch-up'", "pddgw.handoff_mode")
    return pipeline, mode


def _number(d: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = d.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise ApiError(f"'{key}' must be a number in [{lo}, {hi}], got {brief(v)}", key)
    return float(v)


def parse_sampling(d: dict[str, Any]) -> SamplingFields:
    """`temperature`, `top_p`, `top_k`, `min_p` and `seed` of any route's request; ApiError naming the field."""
    temperature = _number(d, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(d, "top_p", 1.0, 1e-9, 1.0)
    top_k = d.get("top_k")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or not -1 <= top_k < TOP_K_LIMIT):
        raise ApiError(f"'top_k' must be an integer in [-1, 2**31) (-1 or 0: no filter), got {brief(top_k)}",
                       "top_k")
    min_p = _number(d, "min_p", 0.0, 0.0, 1.0)
    seed = d.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise ApiError("'seed' must be an integer in [0, 2**63)", "seed")
    return SamplingFields(temperature, top_p, max(top_k or 0, 0), min_p, seed)


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
                raise ApiError(f"{where}[{i}] must be a text part (input_text or output_text)", where)
            text = part.get("text")
            if not isinstance(text, str):
                raise ApiError(f"{where}[{i}].text must be a string", where)
            parts.append(text)
        return "".join(parts)
    raise ApiError(f"{where} must be a string or a list of text parts", where)


def _messages(d: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    instructions = d.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError("'instructions' must be a string", "instructions")
        out.append(("system", instructions))
    inp = d.get("input")
    if isinstance(inp, str):
        out.append(("user", inp))
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise ApiError(f"{where} must be a message item", where)
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(f"{where}.role must be one of {', '.join(_ROLES)}", where)
            out.append(("system" if role == "developer" else role, _text_of(item.get("content"), f"{where}.content")))
    else:
        raise ApiError("'input' must be a string or a list of message items", "input")
    return tuple(out)


def _metadata(d: dict[str, Any]) -> dict[str, str]:
    md = d.get("metadata")
    if md is None:
        return {}
    if not isinstance(md, dict) or len(md) > MAX_METADATA_KEYS:
        raise ApiError(f"'metadata' must be an object of at most {MAX_METADATA_KEYS} string pairs", "metadata")
    for k, v in md.items():
        if not isinstance(v, str) or len(k) > MAX_METADATA_KEY_LEN or len(v) > MAX_METADATA_VALUE_LEN:
            raise ApiError(f"metadata[{brief(k)}]: keys up to {MAX_METADATA_KEY_LEN} chars, string values up "
                           f"to {MAX_METADATA_VALUE_LEN}", "metadata")
    return dict(md)


def parse_client_event(raw: str | bytes, max_prompt_tokens: int) -> ClientEvent:
    """Decode one client frame; ApiError names the problem (and the field)."""
    try:
        d = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(f"event is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ApiError("event must be a JSON object")
    try:
        return _event(d, max_prompt_tokens)
    except ApiError as e:
        sid = d.get("stream_id")
        if isinstance(sid, str) and len(sid) <= MAX_STREAM_ID_LEN:
            e.stream_id = sid
        raise


def parse_create_body(d: Any, max_prompt_tokens: int) -> tuple[CreateResponse, bool]:
    """A POST /v1/responses body -> (the request, whether to stream it as SSE)."""
    if not isinstance(d, dict):
        raise ApiError("the request body must be a JSON object")
    if "type" in d or "stream_id" in d:
        raise ApiError(f"unsupported field {'type' if 'type' in d else 'stream_id'!r} (WebSocket mode only)",
                       "type" if "type" in d else "stream_id")
    stream = d.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise ApiError("'stream' must be a boolean", "stream")
    if d.get("background"):
        raise ApiError("background responses are not supported", "background")
    body = {k: v for k, v in d.items() if k not in ("stream", "background")}
    ev = _event({**body, "type": "response.create"}, max_prompt_tokens)
    assert isinstance(ev, CreateResponse)
    return ev, bool(stream)


def _event(d: dict[str, Any], max_prompt_tokens: int) -> ClientEvent:
    kind = d.get("type")
    if kind == "response.cancel":
        rid = d.get("response_id")
        if not isinstance(rid, str) or not rid:
            raise ApiError("'response_id' must be a non-empty string", "response_id")
        return CancelResponse("response.cancel", rid)
    if kind != "response.create":
        raise ApiError(f"unknown event type {brief(kind)} (expected response.create or response.cancel)", "type")
    unknown = set(d) - _CREATE_KEYS
    if unknown:
        names = sorted(unknown)
        raise ApiError(f"unsupported field(s): {', '.join(map(brief, names[:4]))}{', ...' if names[4:] else ''}",
                       names[0][:_QUOTE_LEN])
    if d.get("stream") is not None or d.get("background"):
        raise ApiError("'stream' is implicit over WebSocket and must not be sent", "stream")
    ids = d.get("prompt_token_ids")
    if ids is not None:
        if "input" in d:
            raise ApiError("give either 'input' or 'prompt_token_ids', not both", "prompt_token_ids")
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise ApiError("'prompt_token_ids' must be a non-empty list of non-negative integers",
                           "prompt_token_ids")
        if len(ids) > max_prompt_tokens:
            raise ApiError(f"prompt is {len(ids)} tokens; the context length is {max_prompt_tokens}",
                           "prompt_token_ids", "context_length_exceeded")
        messages: tuple[tuple[str, str], ...] = ()
        ids = tuple(ids)
    else:
        messages = _messages(d)
    max_out = d.get("max_output_tokens")
    if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1):
        raise ApiError("'max_output_tokens' must be a positive integer", "max_output_tokens")
    sampling = parse_sampling(d)
    stream_id = d.get("stream_id")
    if stream_id is not None and (not isinstance(stream_id, str) or len(stream_id) > MAX_STREAM_ID_LEN):
        raise ApiError(f"'stream_id' must be a string of at most {MAX_STREAM_ID_LEN} characters", "stream_id")
    model = d.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError("'model' must be a string", "model")
    store = d.get("store")
    if store is not None and not isinstance(store, bool):
        raise ApiError("'store' must be a boolean", "store")
    pipeline, handoff_mode = parse_extension(d)
    return CreateResponse(
        type="response.create", messages=messages, prompt_token_ids=ids,
        max_output_tokens=max_out, sampling=sampling, metadata=_metadata(d),
        stream_id=stream_id, model=model, pipeline=pipeline, handoff_mode=handoff_mode,
        logprobs=_include_logprobs(d))


# ---- server events -------------------------------------------------------------


def _envelope(kind: str, seq: int, stream_id: str | None, **fields: Any) -> bytes:
    ev = {"type": kind, "sequence_number": seq, **fields}
    if stream_id is not None:
        ev["stream_id"] = stream_id
    return orjson.dumps(ev)


def output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An output_text part; `logprobs` (api/logprobs.py) only when the request asked for them."""
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def output_message(rid: str, text: str, status: str = "completed",
                   logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The response's one output item: an assistant message with one output_text part."""
    return {"type": "message", "id": f"msg_{rid}", "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)]}


def response_object(rid: str, status: str, created_at: int, model: str, req: CreateResponse,
                    text: str = "", usage: dict[str, Any] | None = None,
                    pddgw: dict[str, Any] | None = None,
                    logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """`status` "incomplete" (cut at the context length) adds incomplete_details: max_output_tokens."""
    obj: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": [], "metadata": req.metadata, "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p, "max_output_tokens": req.max_output_tokens, "error": None,
        "incomplete_details": None,
    }
    if status in ("completed", "incomplete"):
        obj["output"] = [output_message(rid, text, status, logprobs)]
    if status == "incomplete":
        obj["incomplete_details"] = {"reason": "max_output_tokens"}
    if usage is not None:
        obj["usage"] = usage
    if pddgw is not None:
        obj["pddgw"] = pddgw
    return obj


def created_event(seq: int, stream_id: str | None, response: dict[str, Any]) -> bytes:
    return _envelope("response.created", seq, stream_id, response=response)


def delta_event(seq: int, stream_id: str | None, rid: str, text: str, position: int,
                token_ids: list[int], role: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
    extra = {} if logprobs is None else {"logprobs": logprobs}
    return _envelope("response.output_text.delta", seq, stream_id, response_id=rid,
                     item_id=f"msg_{rid}", output_index=0, content_index=0, delta=text, **extra,
                     pddgw={"position": position, "token_ids": token_ids, "role": role})


def completed_event(seq: int, stream_id: str | None, response: dict[str, Any]) -> bytes:
    return _envelope("response.completed", seq, stream_id, response=response)


def error_event(seq: int, stream_id: str | None, message: str, code: str = "invalid_request_error",
                param: str | None = None, response_id: str | None = None) -> bytes:
    err: dict[str, Any] = {"type": code, "code": code, "message": message, "param": param}
    fields: dict[str, Any] = {"error": err}
    if response_id is not None:
        fields["response_id"] = response_id
    return _envelope("error", seq, stream_id, **fields)
