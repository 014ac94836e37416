"""OpenAI HTTP API routes: chat completions, completions, responses, models (registered in server.py).

One generating request:

  1. Authorize (`Authorization: Bearer KEY`) -> 401 `invalid_api_key`.
  2. Take a place under `[server] max_concurrent_requests` before the body is read
     -> 429 `rate_limit_exceeded` at once; given back in one place whatever the end.
  3. Read the body at a minimum rate; decode and validate it (openai_parse.py) -> 400
     naming the field; another model -> 404 `model_not_found`; steering without an
     admin key -> 403 `permission_denied`.
  4. Tokenize and bound the output by the context (door.prepare): clamped, never cut
     silently; no room at all -> 400 `context_length_exceeded`.  Templates with tools
     and grammars are prepared off the event loop.
  5. Run each choice on the router (openai_choices.py) while watching the client: a
     client that goes away cancels the request on every node.
  6. Answer (openai_format.py, responses_format.py): an object, or SSE whose headers go
     out with the first event, so an error before it is a plain HTTP error with its
     status (openai_errors.py) and one after it the stream's last event.

A stop string ends a choice's text at the door and stops its router request at
once; usage counts the tokens kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiohttp import web

from pddgw.api.door import ClientTooSlow
from pddgw.api.errors import ApiError, brief
from pddgw.api.openai_choices import Choice, best_choices, choice_seed, choices_usage, merged_body, run_all
from pddgw.api.openai_errors import error_response, unauthorized
from pddgw.api.openai_format import ChatFormat, CompletionFormat, Format, Result, summary
from pddgw.api.openai_parse import GenRequest, json_body, parse_chat, parse_completion, parse_response, with_grammar
from pddgw.api.responses_format import ResponsesFormat
from pddgw.api.sse import ClientGone, SseStream, until_gone
from pddgw.api.toolcalls import ToolFormat, format_for, grammar_for
from pddgw.core.roles import Role
from pddgw.core.tokens import TokenRun
from pddgw.engines.grammar import NO_EOS_REASON, check_spec, grammar_stops
from pddgw.engines.types import RequestError
from pddgw.pipeline.router import Outcome, RouterError, StopRequest, new_request_id

if TYPE_CHECKING:
    from pddgw.api.door import FrontDoor, Prepared

log = structlog.get_logger(__name__)

_FORMATS: dict[str, type[Format]] = {"chat": ChatFormat, "completion": CompletionFormat,
                                     "response": ResponsesFormat}


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


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
            return unauthorized()
        return web.json_response({"object": "list", "data": [self._model()]}, dumps=_dumps)

    async def model(self, request: web.Request) -> web.Response:
        if not self.door.authorized(request):
            return unauthorized()
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
            return unauthorized()
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
                sampling = with_grammar(sampling, forced, "tool_choice")
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
        same prompt; choices 1..best_of-1 start once choice 0 has its first token from a
        decoder (P has then prefilled the prompt and the decoder holds it, so their prefills
        find it in P's prefix cache and MD's; P's own early first token is too soon for MD's).  A stop
        string ends a choice's text at the door and stops its router request at once
        (StopRequest: cancelled on every node); its usage counts the tokens kept."""
        door = self.door
        rid = new_request_id()
        if req.client_request_id is not None:
            # Logged, not used: the router's ids must be unique across every client's requests.
            log.info("client_request_id", request_id=rid, client_request_id=req.client_request_id)
        created = int(time.time())
        choices = [Choice(i, rid if i == 0 else f"{rid}_{i}",
                           replace(prep.sampling, seed=choice_seed(prep.sampling.seed, i)),
                           _FORMATS[req.kind](req, rid, door.model_name, created, door.pieces, i,
                                              self.tool_format, tuple(prep.ids)),
                           door.output_text(prep.sampling, req.stop))
                   for i in range(req.best_of)]
        fmt = choices[0].fmt
        sse = SseStream(request) if req.stream else None
        gone = sse.gone if sse is not None else asyncio.Event()
        first = asyncio.Event()         # choice 0 has a decoder's token (or ended): the others may start

        async def one(c: Choice) -> Result:
            async def emit(run: TokenRun) -> None:
                text, kept = c.text.push(run.ids)
                if kept < len(run.ids):      # a stop string ended the text inside this run
                    run = dataclasses.replace(run, ids=run.ids[:kept], logprobs=run.logprobs[:kept])
                c.runs.append(run)
                if run.role != Role.PREFILL:
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
            results = await until_gone(request, gone, run_all([one(c) for c in choices]))
            usage = choices_usage(fmt, results)
            if sse is None:
                kept = best_choices(choices, results, req.n)
                for rank, (c, _) in enumerate(kept):
                    c.fmt.index = rank
                bodies = [c.fmt.body(res) for c, res in kept]
                return web.json_response(merged_body(bodies, usage) if req.best_of > 1 else bodies[0], dumps=_dumps)
            await sse.send(fmt.close(usage))
            return await sse.end()
        except ClientGone:
            log.info("client_gone", request_id=rid)
            return sse.resp if sse is not None and sse.resp is not None else web.Response(status=499)
        except RouterError as e:
            return await self._fail(sse, fmt, str(e), e.code)
        except Exception as e:   # a bug: the client still hears why its answer ended
            log.exception("openai_respond_failed", request_id=rid)
            return await self._fail(sse, fmt, f"internal error: {type(e).__name__}: {e}", "server_error")

    @staticmethod
    def _result(c: Choice, out: Outcome, prep: Prepared) -> Result:
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
        return Result(out, text, len(prep.ids), timeline,
                       incomplete=prep.clamped and reason == "length", runs=runs, stop_reason=stop_reason,
                       rest=rest, prompt_ids=tuple(prep.ids))

    @staticmethod
    async def _fail(sse: SseStream | None, fmt: Format, message: str, code: str) -> web.StreamResponse:
        if sse is None or sse.resp is None:
            return error_response(message, code)
        await sse.send(fmt.error(message, code))
        return await sse.end()
