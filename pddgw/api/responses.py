"""The Responses API's requests, decoded and validated at the edge (WebSocket events, POST bodies).

Client events over WebSocket: `response.create` (the POST /v1/responses body
fields at top level; `prompt_token_ids` may replace `input`; an optional
`stream_id` is echoed on every server event of that response, so several
responses can share one socket) and `response.cancel` (`response_id`).
`parse_create_body` decodes the same fields from a POST body (no `type`,
`stream` a boolean).

Every field is checked before anything is sized by it (metadata, `stream_id`,
a schema's size, the prompt's length), and a refusal is an `ApiError` naming
the field.  The sampling fields (`SAMPLING_KEYS`) decode into one
`SamplingParams` for every route (`parse_sampling`); logprobs are opt-in
(`include: ["message.output_text.logprobs"]` with `top_logprobs`).  Tools
(`tools` flat, `tool_choice`, `parallel_tool_calls`) decode into
`CreateResponse.tools`, `text.format` into `sampling.grammar`; input
`function_call` / `function_call_output` items make `CreateResponse.chat`, the
conversation as the chat template gets it.

The server's objects and events are responses_format.py's.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import orjson

from pddgw.api.errors import QUOTE_LEN, ApiError, brief, optional, text_content
from pddgw.api.toolcalls import parse_tools
from pddgw.core.errors import FieldError
from pddgw.core.roles import PIPELINES, Pipeline
from pddgw.core.sampling import COUNT_LIMIT, MAX_LOGPROBS, SamplingParams

MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_LEN = 64
MAX_METADATA_VALUE_LEN = 512
_ROLES = ("system", "developer", "user", "assistant")
MAX_STREAM_ID_LEN = 128

@dataclass(frozen=True, slots=True)
class CreateResponse:
    type: Literal["response.create"]
    messages: tuple[tuple[str, str], ...]        # (role, text); empty when prompt_token_ids
    prompt_token_ids: tuple[int, ...] | None
    max_output_tokens: int | None
    sampling: SamplingParams     # max_tokens: as asked (or the placeholder); the door sets the room left
    metadata: dict[str, str] = field(default_factory=dict)
    stream_id: str | None = None
    model: str | None = None
    # pddgw extension: force this request's pipeline / handoff mode (tests, benchmarks).
    pipeline: Pipeline | None = None
    handoff_mode: Literal["one-shot", "catch-up"] | None = None
    states: bool = False             # `pddgw.states`: the state timeline in the summary
    return_token_ids: bool = False   # token ids in each delta's `pddgw` and the summary's output_token_ids
    # None: no log-probabilities; k: each token's plus k top alternatives.
    logprobs: int | None = None
    tools: Any = None            # api/toolcalls.ToolRequest, or None (no tools)
    # The conversation as the chat template gets it (message dicts), when it holds tool calls or
    # results or the request has tools; None: `messages` is the whole of it.
    chat: tuple[dict[str, Any], ...] | None = None
    text_format: dict[str, Any] | None = None     # `text.format` as given (echoed in the response)


@dataclass(frozen=True, slots=True)
class CancelResponse:
    type: Literal["response.cancel"]
    response_id: str


ClientEvent = CreateResponse | CancelResponse

# The body fields every route decodes into `SamplingParams` under the same names (OpenAI's, and
# vLLM's extra sampling parameters with vLLM's meaning and defaults); the values are checked there.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "presence_penalty",
                 "frequency_penalty", "logit_bias", "min_tokens", "ignore_eos", "stop_token_ids",
                 "skip_special_tokens", "include_stop_str_in_output")
_CREATE_KEYS = {"type", "model", "input", "instructions", "prompt_token_ids", "max_output_tokens", "metadata",
                "stream_id", "store", "stream", "pddgw", "include", "top_logprobs", "tools", "tool_choice",
                "parallel_tool_calls", "text", "return_token_ids", *SAMPLING_KEYS}
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


@dataclass(frozen=True, slots=True)
class Extension:
    """A request's `pddgw` extension: the pipeline / handoff mode it forces (None: the policy's;
    forcing needs an admin key) and whether its summary carries the state timeline (anyone)."""

    pipeline: Pipeline | None = None
    handoff_mode: Literal["one-shot", "catch-up"] | None = None
    states: bool = False


def parse_extension(d: dict[str, Any]) -> Extension:
    """The `pddgw` extension of a request; ApiError naming the key."""
    ext = d.get("pddgw")
    if ext is None:
        return Extension()
    if not isinstance(ext, dict) or set(ext) - {"pipeline", "handoff_mode", "states"}:
        raise ApiError("'pddgw' may only set 'pipeline', 'handoff_mode' and 'states'", "pddgw")
    pipeline, mode = ext.get("pipeline"), ext.get("handoff_mode")
    if pipeline is not None and pipeline not in PIPELINES:
        raise ApiError("pddgw.pipeline must be 'P-MD', 'P-RLD-MD' or 'P-RLD'", "pddgw.pipeline")
    if mode not in (None, "one-shot", "catch-up"):
        raise ApiError("pddgw.handoff_mode must be 'one-shot' or 'catch-up'", "pddgw.handoff_mode")
    return Extension(None if pipeline is None else Pipeline(pipeline), mode,
                     bool(optional(ext, "states", bool, name="pddgw.states")))


def return_token_ids(d: dict[str, Any]) -> bool:
    """vLLM's `return_token_ids` (a boolean; null: false)."""
    return bool(optional(d, "return_token_ids", bool))


def parse_sampling(d: dict[str, Any], max_tokens: int | None, logprobs: int | None = None) -> SamplingParams:
    """The `SAMPLING_KEYS` of any route's request (null = not given) -> SamplingParams; ApiError
    naming the field.

    OpenAI's defaults where they differ from the engine's: temperature 1; no seed: one is
    drawn here (it is in the `pddgw` timeline), so every node samples with the same one.
    `max_tokens`: the client's (validated by the route), or, when not given, the largest
    count as a placeholder until the door sets the room left in the context.
    """
    kw: dict[str, Any] = {"temperature": 1.0, **{k: d[k] for k in SAMPLING_KEYS if d.get(k) is not None}}
    kw.setdefault("seed", secrets.randbits(63))
    try:
        return SamplingParams(max_tokens=max_tokens or COUNT_LIMIT - 1, logprobs=logprobs, **kw)
    except FieldError as e:
        raise ApiError(str(e), e.field) from None


MAX_SCHEMA_CHARS = 64 * 1024     # a response format's JSON schema, at most (as compact JSON)


def response_format_grammar(fmt: Any, param: str, flat: bool = False) -> tuple[str, str] | None:
    """Chat's `response_format` (`{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`)
    or, `flat`, the Responses API's `text.format` (`{"type": "json_schema", "name", "schema",
    "strict"}`) -> the grammar (SamplingParams.grammar) its output must match: None for "text",
    any JSON object for "json_object", the schema for "json_schema" (xgrammar's strict mode
    either way: properties the schema does not name are not generated).  ApiError names `param`."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind != "json_schema":
        raise ApiError(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'", f"{param}.type")
    body = fmt if flat else fmt.get("json_schema")
    at = param if flat else f"{param}.json_schema"
    if not isinstance(body, dict):
        raise ApiError(f"'{at}' must be an object", at)
    optional(body, "name", str, name=f"{at}.name")
    optional(body, "strict", bool, name=f"{at}.strict")
    schema = body.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError(f"'{at}.schema' must be a JSON schema object", f"{at}.schema")
    text = json.dumps(schema, sort_keys=True)
    if len(text) > MAX_SCHEMA_CHARS:
        raise ApiError(f"'{at}.schema' must be at most {MAX_SCHEMA_CHARS} characters as JSON", f"{at}.schema")
    return "json_schema", text


def _text_part(part: Any, at: str, where: str) -> str:
    """The text of one part of an input item's content (`text_content`)."""
    if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
        raise ApiError(f"{at} must be a text part (input_text or output_text)", where)
    text = part.get("text")
    if not isinstance(text, str):
        raise ApiError(f"{at}.text must be a string", where)
    return text


def _messages(d: dict[str, Any]) -> tuple[tuple[tuple[str, str], ...], tuple[dict[str, Any], ...] | None]:
    """`instructions` + `input` -> ((role, text) pairs, the message dicts when the input holds
    function calls or their outputs, else None)."""
    out: list[tuple[str, str]] = []
    chat: list[dict[str, Any]] = []
    rich = False
    instructions = d.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError("'instructions' must be a string", "instructions")
        out.append(("system", instructions))
        chat.append({"role": "system", "content": instructions})
    inp = d.get("input")
    if isinstance(inp, str):
        out.append(("user", inp))
        chat.append({"role": "user", "content": inp})
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            where = f"input[{i}]"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "function_call":
                rich = True
                call = _function_call(item, where)
                if chat and chat[-1]["role"] == "assistant":
                    # A turn's calls belong to the assistant message before them (one template turn).
                    chat[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append(("assistant", ""))
                    chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
                continue
            if kind == "function_call_output":
                rich = True
                cid, text = item.get("call_id"), item.get("output")
                if not isinstance(cid, str) or not cid:
                    raise ApiError(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
                text = text_content(text, f"{where}.output", _text_part)
                out.append(("tool", text))
                chat.append({"role": "tool", "content": text, "tool_call_id": cid})
                continue
            if kind != "message":
                raise ApiError(f"{where} must be a message, function_call or function_call_output item", where)
            role = item.get("role")
            if role not in _ROLES:
                raise ApiError(f"{where}.role must be one of {', '.join(_ROLES)}", where)
            pair = ("system" if role == "developer" else role,
                    text_content(item.get("content"), f"{where}.content", _text_part))
            out.append(pair)
            chat.append({"role": pair[0], "content": pair[1]})
    else:
        raise ApiError("'input' must be a string or a list of message items", "input")
    return tuple(out), (tuple(chat) if rich else None)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A `function_call` input item -> the tool call as the chat template gets it (arguments parsed:
    templates index them as a mapping, as transformers passes them)."""
    cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(cid, str) or not cid:
        raise ApiError(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
    if not isinstance(name, str) or not name:
        raise ApiError(f"{where}.name must be a non-empty string", f"{where}.name")
    if not isinstance(args, str):
        raise ApiError(f"{where}.arguments must be JSON text (a string)", f"{where}.arguments")
    try:
        parsed = json.loads(args or "{}")
    except ValueError:
        raise ApiError(f"{where}.arguments must be JSON text", f"{where}.arguments") from None
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": parsed}}


def _text_format(d: dict[str, Any]) -> dict[str, Any] | None:
    """`text` (only `format` is understood) -> the format object, or None."""
    text = d.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise ApiError("'text' may only set 'format'", "text")
    return optional(text, "format", dict, name="text.format")


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
    stream = optional(d, "stream", bool)
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
                       names[0][:QUOTE_LEN])
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
        chat: tuple[dict[str, Any], ...] | None = None
        ids = tuple(ids)
    else:
        messages, chat = _messages(d)
    max_out = d.get("max_output_tokens")
    if max_out is not None and (isinstance(max_out, bool) or not isinstance(max_out, int) or max_out < 1):
        raise ApiError("'max_output_tokens' must be a positive integer", "max_output_tokens")
    sampling = parse_sampling(d, max_out, _include_logprobs(d))
    stream_id = optional(d, "stream_id", str, max_len=MAX_STREAM_ID_LEN)
    model = optional(d, "model", str)
    optional(d, "store", bool)                  # checked only: the value is not kept
    ext = parse_extension(d)
    tools = parse_tools(d, flat=True)
    fmt = _text_format(d)
    grammar = response_format_grammar(fmt, "text.format", flat=True)
    if grammar is not None:
        if tools is not None and tools.forced:
            raise ApiError("'text.format' cannot be combined with a forced 'tool_choice'", "text.format")
        try:
            sampling = replace(sampling, grammar=grammar)
        except FieldError as e:
            raise ApiError(f"'text.format': {e}", "text.format") from None
    if tools is not None and ids is None and chat is None:
        chat = tuple({"role": r, "content": t} for r, t in messages)
    return CreateResponse(
        type="response.create", messages=messages, prompt_token_ids=ids,
        max_output_tokens=max_out, sampling=sampling, metadata=_metadata(d),
        stream_id=stream_id, model=model, pipeline=ext.pipeline, handoff_mode=ext.handoff_mode,
        states=ext.states, return_token_ids=return_token_ids(d),
        logprobs=sampling.logprobs, tools=tools, chat=chat, text_format=fmt)
