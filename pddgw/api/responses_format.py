"""The Responses API's answers: the `response` object, its output items, and its events.

Over WebSocket every server event is one JSON text frame,
`{"type", "sequence_number", ...}` with the request's `stream_id` when it had
one (`*_event`); over HTTP the same events are SSE (`ResponsesFormat`: an
`event:` line, then the data).  A response's output is at most one assistant
message (`output_message`, one `output_text` part) followed by its
`function_call` items (`function_call_item`); a call streams as
`function_call_events`.  `status` "incomplete" (cut at the context length)
adds `incomplete_details: {"reason": "max_output_tokens"}`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson

from pddgw.api import logprobs as lpfmt
from pddgw.api.openai_format import ARGUMENT_FRAGMENT_CHARS, Format, Result, delta_extension
from pddgw.api.openai_parse import GenRequest
from pddgw.api.responses import CreateResponse
from pddgw.api.sse import sse_data
from pddgw.api.toolcalls import ToolCall, ToolFormat
from pddgw.core.tokens import TokenRun


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


def _item_id(call: ToolCall) -> str:
    """A function_call item's id: its call's id with `fc_` for `call_`."""
    return "fc_" + call.id.removeprefix("call_")


def function_call_item(call: ToolCall, status: str = "completed", arguments: str | None = None) -> dict[str, Any]:
    """A `function_call` output item of a toolcalls.ToolCall (`arguments`: as far as streamed)."""
    return {"type": "function_call", "id": _item_id(call), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments, "status": status}


def _request_echo(req: CreateResponse) -> dict[str, Any]:
    """The request's tool and text settings, as a response object repeats them."""
    t = req.tools
    if t is None:
        tools: list[dict[str, Any]] = []
        choice: Any = "auto"
    else:
        tools = [{"type": "function", **x.as_template()["function"], "strict": None}
                 for x in t.tools]
        choice = t.choice if t.choice in ("none", "auto", "required") else {"type": "function", "name": t.choice}
    return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": True if t is None else t.parallel,
            "text": {"format": req.text_format or {"type": "text"}}}


def response_object(rid: str, status: str, created_at: int, model: str, req: CreateResponse,
                    text: str | None = "", usage: dict[str, Any] | None = None,
                    pddgw: dict[str, Any] | None = None,
                    logprobs: list[dict[str, Any]] | None = None,
                    calls: list[Any] = ()) -> dict[str, Any]:
    """`status` "incomplete" (cut at the context length) adds incomplete_details: max_output_tokens.
    `calls` (toolcalls.ToolCall): function_call items after the message; `text` None: no message
    (the output is only calls)."""
    obj: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": [], "metadata": req.metadata, "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p, "max_output_tokens": req.max_output_tokens, "error": None,
        "incomplete_details": None, **_request_echo(req),
    }
    if status in ("completed", "incomplete"):
        msg = [] if text is None else [output_message(rid, text, status, logprobs)]
        obj["output"] = msg + [function_call_item(c) for c in calls]
    if status == "incomplete":
        obj["incomplete_details"] = {"reason": "max_output_tokens"}
    if usage is not None:
        obj["usage"] = usage
    if pddgw is not None:
        obj["pddgw"] = pddgw
    return obj


def item_event(seq: int, stream_id: str | None, kind: str, **fields: Any) -> bytes:
    """Any other server event of a response (the output items of tool calls, held-back text)."""
    return _envelope(kind, seq, stream_id, **fields)


def created_event(seq: int, stream_id: str | None, response: dict[str, Any]) -> bytes:
    return _envelope("response.created", seq, stream_id, response=response)




def delta_event(seq: int, stream_id: str | None, rid: str, text: str, position: int,
                token_ids: Sequence[int] | None, role: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
    extra = {} if logprobs is None else {"logprobs": logprobs}
    return _envelope("response.output_text.delta", seq, stream_id, response_id=rid,
                     item_id=f"msg_{rid}", output_index=0, content_index=0, delta=text, **extra,
                     pddgw=delta_extension(position, role, token_ids))


def completed_event(seq: int, stream_id: str | None, response: dict[str, Any]) -> bytes:
    return _envelope("response.completed", seq, stream_id, response=response)


def error_event(seq: int, stream_id: str | None, message: str, code: str = "invalid_request_error",
                param: str | None = None, response_id: str | None = None) -> bytes:
    err: dict[str, Any] = {"type": code, "code": code, "message": message, "param": param}
    fields: dict[str, Any] = {"error": err}
    if response_id is not None:
        fields["response_id"] = response_id
    return _envelope("error", seq, stream_id, **fields)


class ResponsesFormat(Format):
    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces,
                 index: int = 0, tool_format: ToolFormat = "json", prompt_ids: tuple[int, ...] = ()):
        super().__init__(req, rid, model, created, pieces, index, tool_format, prompt_ids)
        assert req.create is not None
        self.create = req.create
        self.seq = 0
        self.output_logprobs: list[dict[str, Any]] | None = None    # all_logprobs's, built once

    def event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        return (b"event: " + kind.encode() + b"\n"
                + sse_data({"type": kind, "sequence_number": self.seq, **fields}))

    def obj(self, status: str, res: Result | None = None) -> dict[str, Any]:
        if res is None:
            return response_object(self.rid, status, self.created, self.model, self.create)
        usage = {"input_tokens": res.prompt_tokens, "input_tokens_details": {"cached_tokens": res.out.cached_tokens},
                 "output_tokens": len(res.out.output_ids),
                 "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": res.prompt_tokens + len(res.out.output_ids)}
        content, calls = self.calls(res)
        return response_object(self.rid, status, self.created, self.model, self.create, text=content,
                               usage=usage, pddgw=res.timeline, logprobs=self.all_logprobs(res), calls=calls)

    def all_logprobs(self, res: Result) -> list[dict[str, Any]] | None:
        """The output_text's logprobs: every token's, when asked for (else absent); built once (the
        done events and the response object carry the same)."""
        if self.req.logprobs is not None and self.output_logprobs is None:
            self.output_logprobs = self.content(res.runs)
        return self.output_logprobs

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

    def tail(self, res: Result, rest: str) -> list[bytes]:
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

    def body(self, res: Result) -> dict[str, Any]:
        obj = self.obj("incomplete" if res.incomplete else "completed", res)
        obj["pddgw"] = self.body_pddgw(res)
        return obj

    def error(self, message: str, code: str, param: str | None = None) -> list[bytes]:
        return [self.event("error", code=code, message=message, param=param)]


def function_call_events(event: Any, index: int, call: ToolCall) -> list[Any]:
    """A function_call output item's stream (HTTP and WebSocket): added (no arguments yet), its
    arguments in fragments, their end, done.  `event(kind, **fields)` spells one event."""
    item_id = _item_id(call)
    out = [event("response.output_item.added", output_index=index,
                 item=function_call_item(call, "in_progress", ""))]
    for j in range(0, len(call.arguments), ARGUMENT_FRAGMENT_CHARS):
        out.append(event("response.function_call_arguments.delta", item_id=item_id, output_index=index,
                         delta=call.arguments[j : j + ARGUMENT_FRAGMENT_CHARS]))
    out += [event("response.function_call_arguments.done", item_id=item_id, output_index=index,
                  name=call.name, arguments=call.arguments),
            event("response.output_item.done", output_index=index, item=function_call_item(call))]
    return out
