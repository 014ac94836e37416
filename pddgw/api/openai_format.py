"""How the chat completions and completions routes spell their answers (SSE chunks, the final object).

A `Format` spells one choice (its `index`): `head` before its first delta,
`delta` per token run, `tail` at its end, `close` after every choice's tail
(usage, `data: [DONE]`), `body` for a non-streamed answer, `error` for an
error after the first event.  A `Result` is what a choice's end gives it.
The Responses API's format is responses_format.py's `ResponsesFormat`.

Invariants: a chunk's `pddgw` is O(1) (`delta_extension`: position and role;
token ids only with `return_token_ids`); with tools that may be called the
text is held back and parsed once at the end (`Format.calls`), so the streamed
calls and the object carry the same call ids; `stop_reason` is in every choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pddgw.api import logprobs as lpfmt
from pddgw.api.openai_errors import error_body
from pddgw.api.sse import SSE_DONE, sse_data
from pddgw.api.toolcalls import ToolCall, ToolFormat, parse_calls
from pddgw.core.tokens import TokenRun
from pddgw.pipeline.router import Outcome
from pddgw.pipeline.state import RequestRecord

if TYPE_CHECKING:
    from pddgw.api.openai_parse import GenRequest

ARGUMENT_FRAGMENT_CHARS = 16   # a streamed tool call's arguments go out in fragments of this many characters


def delta_extension(position: int, role: str, token_ids: Sequence[int] | None) -> dict[str, Any]:
    """A streamed delta's `pddgw` (every route's): where its tokens sit and which role made them;
    their ids only when asked for (`return_token_ids`; None: not asked)."""
    ext: dict[str, Any] = {"position": position, "role": role}
    if token_ids is not None:
        ext["token_ids"] = list(token_ids)
    return ext


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
class Result:
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


class Format:
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

    def body_pddgw(self, res: Result) -> dict[str, Any]:
        """The non-streamed object's `pddgw`: the summary and the output's role spans."""
        return {**res.timeline, "spans": spans(res.runs)}

    @property
    def parses_calls(self) -> bool:
        """Tools given and they may be called (`ToolRequest.may_call`; `tool_format` of OpenAIRoutes)."""
        return self.req.tools is not None and self.req.tools.may_call

    def calls(self, res: Result) -> tuple[str | None, list[ToolCall]]:
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

    def tail(self, res: Result, rest: str) -> list[bytes]:
        """The end of this choice: its last text and its finish."""
        raise NotImplementedError

    def close(self, usage: dict[str, Any]) -> list[bytes]:
        """After every choice's tail: what ends the stream (usage: summed over the choices)."""
        return []

    def body(self, res: Result) -> dict[str, Any]:
        raise NotImplementedError

    def error(self, message: str, code: str, param: str | None = None) -> list[bytes]:
        return [sse_data(error_body(message, code, param))]



class ChatFormat(Format):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"    # a streamed chunk's `object`

    @property
    def id(self) -> str:
        return "chatcmpl-" + self.rid.removeprefix("resp_")

    def usage(self, res: Result) -> dict[str, Any]:
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
        obj = {"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
               "choices": choices, **extra}
        if self.req.include_usage:
            obj.setdefault("usage", None)
        return sse_data(obj)

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

    def tail(self, res: Result, rest: str) -> list[bytes]:
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
        return [*([self.chunk([], usage=usage)] if self.req.include_usage else []), SSE_DONE]

    def body(self, res: Result) -> dict[str, Any]:
        content, calls = self.calls(res)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        finish = res.out.finish_reason
        if calls:
            message["tool_calls"] = [c.as_openai() for c in calls]
            finish = "tool_calls" if finish == "stop" else finish
        choice = {"index": self.index, "message": message, "logprobs": self.logprobs(res.runs),
                  "finish_reason": finish, "stop_reason": res.stop_reason}
        obj = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
               "choices": [choice], "usage": self.usage(res), "pddgw": self.body_pddgw(res)}
        if self.req.return_token_ids:
            choice["token_ids"] = list(res.out.output_ids)
            obj["prompt_token_ids"] = list(res.prompt_ids)
        return obj


class CompletionFormat(ChatFormat):
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self, req: GenRequest, rid: str, model: str, created: int, pieces: lpfmt.TokenPieces,
                 index: int = 0, tool_format: ToolFormat = "json", prompt_ids: tuple[int, ...] = ()):
        super().__init__(req, rid, model, created, pieces, index, tool_format, prompt_ids)
        self.text_offset = 0        # of the next token string (streamed chunks continue it)
        self.prompt_sent = False    # `return_token_ids`: the prompt's ids went out (in this choice's first chunk)

    @property
    def id(self) -> str:
        return "cmpl-" + self.rid.removeprefix("resp_")

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

    def body(self, res: Result) -> dict[str, Any]:
        text = res.text
        if self.req.echo:
            text = self.echo_text() + text
        if self.req.echo and self.req.logprobs is not None:
            # The prompt's entries first (the first token's null), the completion's continue them.
            lps, self.text_offset = lpfmt.prompt_completion(self.pieces, res.prompt_ids, res.out.prompt_logprobs)
            more = self.logprobs(res.runs)
            assert more is not None
            logprobs: dict[str, Any] | None = {key: lps[key] + more[key] for key in lps}
        else:
            logprobs = self.logprobs(res.runs)
        choice = {"index": self.index, "text": text, "logprobs": logprobs,
                  "finish_reason": res.out.finish_reason, "stop_reason": res.stop_reason}
        if self.req.vllm_prompt_logprobs:
            choice["prompt_logprobs"] = lpfmt.vllm_prompt(self.pieces, res.prompt_ids, res.out.prompt_logprobs)
        if self.req.return_token_ids:
            # vLLM's: the output's ids only, also with echo (the prompt's are `prompt_token_ids`).
            choice["prompt_token_ids"] = list(res.prompt_ids)
            choice["token_ids"] = list(res.out.output_ids)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage(res), "pddgw": self.body_pddgw(res)}
