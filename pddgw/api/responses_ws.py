"""The Responses API over WebSocket: GET /v1/responses upgraded, any number of responses per socket.

Each `response.create` runs as its own task; `stream_id` tells them apart on
the client's side.  Tools, `tool_choice`, `text.format` and function-call
input items are decoded as over HTTP (responses.py) and the prompt and grammar
prepared by the same code (`OpenAIRoutes.prepare_response`); with tools the
text deltas carry tokens but no text, and a call comes as its `function_call`
item's events before `response.completed`.  `response.cancel` or a closed
socket cancels a response, which frees it on every node.

Invariants: every event (a text or binary frame of UTF-8 JSON) is decoded and
validated at the edge; a bad one gets an `error` event (echoing its
`stream_id` when valid) and the socket keeps serving.  A `response.create`
takes its place under `[server] max_concurrent_requests` before the next event
is read and gives it back when its task ends (also when cancelled before it
ran); over the bound, or while the router drains, it gets an `error` event at
once.  No event within `[server] websocket_idle_timeout_s` of the upgrade:
close 1008.  A frame that breaks RFC 6455 fails only its connection, with its
close code (1002 protocol error, also an unmasked client frame: ws_masking.py;
1007 a text frame that is not UTF-8; 1009 a message over `max_message_bytes`,
refused from its header before the payload is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import WSCloseCode, WSMsgType, web

from pddgw.api import logprobs as lpfmt
from pddgw.api.door import Detokenizer, FrontDoor, Slot, key_protocol
from pddgw.api.errors import ApiError, brief
from pddgw.api.openai_format import summary
from pddgw.api.openai_parse import response_request
from pddgw.api.openai_routes import OpenAIRoutes
from pddgw.api.responses import CancelResponse, CreateResponse, parse_client_event
from pddgw.api.responses_format import (
    completed_event,
    created_event,
    delta_event,
    error_event,
    function_call_events,
    item_event,
    response_object,
)
from pddgw.api.toolcalls import parse_calls
from pddgw.api.ws_masking import MaskCheck
from pddgw.core.tokens import TokenRun
from pddgw.pipeline.router import Outcome, RouterError, new_request_id

log = structlog.get_logger(__name__)


class ResponsesSocket:
    """GET /v1/responses upgraded to a WebSocket: one `_Connection` per client socket."""

    def __init__(self, door: FrontDoor):
        self.door = door
        self.routes = OpenAIRoutes(door)     # the prompt (tools, templates) and grammar as over HTTP

    async def handle(self, request: web.Request) -> web.StreamResponse:
        door = self.door
        if not door.authorized(request, websocket=True):
            return web.json_response({"error": {"type": "invalid_api_key", "message":
                                                "invalid or missing API key (Authorization: Bearer KEY)"}},
                                     status=401)
        # aiohttp refuses a message of max_msg_size bytes itself; max_message_bytes is the largest accepted.
        proto = key_protocol(request)
        ws = web.WebSocketResponse(max_msg_size=door.cfg.server.max_message_bytes + 1, heartbeat=30.0,
                                   compress=False, protocols=(proto,) if proto else ())
        check = MaskCheck.install(request)        # before the 101: a client frame can only follow it
        if check is None:
            return web.Response(status=499)       # the client is gone
        try:
            await ws.prepare(request)
        except BaseException:
            check.remove()
            raise
        conn = _Connection(door, ws, door.may_steer(request, websocket=True), self.routes)
        # Until the first event: an absolute deadline (receive's own timeout restarts at every ping).
        first_by: float | None = asyncio.get_running_loop().time() + door.cfg.server.websocket_idle_timeout_s
        try:
            while not ws.closed:
                try:
                    msg = await check.receive(ws, first_by)
                except TimeoutError:
                    door.metrics.close("websocket_idle_timeout")
                    await ws.close(code=WSCloseCode.POLICY_VIOLATION,
                                   message=b"no event within [server] websocket_idle_timeout_s")
                    break
                if msg is None:
                    log.warning("client_ws_error", error=check.reason, code=int(WSCloseCode.PROTOCOL_ERROR))
                    await check.fail(ws)
                    break
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    first_by = None
                    await conn.on_event(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    # A protocol error (msg.data) has already closed the socket with its code.
                    log.warning("client_ws_error", error=str(msg.data), code=getattr(msg.data, "code", None))
                elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
                    break
        finally:
            await conn.close()
        return ws


class _Connection:
    """One client socket: its responses in flight and its event sequence."""

    def __init__(self, door: FrontDoor, ws: web.WebSocketResponse, may_steer: bool, routes: OpenAIRoutes):
        self.door = door
        self.routes = routes
        self.ws = ws
        self.may_steer = may_steer
        self.seq = 0
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def send(self, make: Callable[..., bytes], *args: Any, **kwargs: Any) -> None:
        """Send the event `make(sequence_number, *args, **kwargs)`; a closed socket drops it."""
        self.seq += 1
        if not self.ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(make(self.seq, *args, **kwargs).decode())

    async def on_event(self, raw: str | bytes) -> None:
        try:
            await self._on_event(raw)
        except Exception as e:   # a bug: the client hears of it and the socket keeps serving
            log.exception("client_event_failed")
            await self.send(error_event, None, f"internal error: {type(e).__name__}: {e}", "server_error")

    async def _on_event(self, raw: str | bytes) -> None:
        door = self.door
        try:
            ev = parse_client_event(raw, door.max_prompt)
        except ApiError as e:
            await self.send(error_event, e.stream_id, str(e), e.code, e.param)
            return
        if isinstance(ev, CancelResponse):
            task = self.tasks.get(ev.response_id)
            if task is None:
                await self.send(error_event, None, f"no response {brief(ev.response_id)} in flight on this "
                                "connection", param="response_id")
            else:
                task.cancel()
            return
        if (ev.pipeline is not None or ev.handoff_mode is not None) and not self.may_steer:
            name = "pddgw.pipeline" if ev.pipeline is not None else "pddgw.handoff_mode"
            await self.send(error_event, ev.stream_id, f"forcing {name} needs an admin key ([server] admin_keys) "
                            "or [server] allow_request_steering = true", "permission_denied", name)
            return
        if len(self.tasks) >= door.cfg.server.max_streams_per_connection:
            await self.send(error_event, ev.stream_id, "too many responses in flight on this connection",
                            "rate_limit_exceeded")
            return
        if door.drain.draining:
            await self.send(error_event, ev.stream_id, door.drain.MESSAGE, "unavailable")
            return
        slot = door.admission.try_acquire()       # before any await: the check and the count are one step
        if slot is None:
            await self.send(error_event, ev.stream_id, "server busy: too many responses in flight "
                            "([server] max_concurrent_requests)", "rate_limit_exceeded")
            return
        rid = new_request_id()
        task = self.tasks[rid] = asyncio.create_task(self._respond(rid, ev), name=f"respond-{rid}")
        task.add_done_callback(_releaser(slot))

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _respond(self, rid: str, req: CreateResponse) -> None:
        door = self.door
        sid = req.stream_id
        created = int(time.time())
        try:
            gen = response_request(req, True)
            heavy = door.heavy(req.messages) or req.sampling.grammar is not None or req.chat is not None
            prep = (await asyncio.to_thread(self.routes.prepare_response, gen) if heavy
                    else self.routes.prepare_response(gen))
            ids, sampling = prep.ids, prep.sampling
            detok = Detokenizer(door.tok)
            await self.send(created_event, sid, response_object(rid, "in_progress", created, door.model_name,
                                                                 req))
            # With logprobs asked for: each delta's, and all of them for the completed response.
            logprobs: list[dict[str, Any]] | None = None if req.logprobs is None else []
            # Tools (tool_choice not "none"): the text is held back (deltas carry their tokens, no
            # text) and parsed at the end into calls and content.
            holds = req.tools is not None and req.tools.may_call

            async def emit(run: TokenRun) -> None:
                text = detok.push(run.ids)
                lps = None
                if logprobs is not None:
                    lps = lpfmt.content(door.pieces, run.ids, run.logprobs)
                    logprobs.extend(lps)
                await self.send(delta_event, sid, rid, "" if holds else text, run.position,
                                run.ids if req.return_token_ids else None, run.role, lps)

            out: Outcome = await door.router.run(rid, ids, sampling, emit, req.pipeline, req.handoff_mode)
            usage = {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": out.cached_tokens},
                     "output_tokens": len(out.output_ids),
                     "total_tokens": len(ids) + len(out.output_ids)}
            timeline = summary(out.record, sampling.seed, out.finish_reason, out.output_ids,
                               token_ids=req.return_token_ids, states=req.states)
            status = "incomplete" if prep.clamped and out.finish_reason == "length" else "completed"
            content: str | None = door.tok.decode(list(out.output_ids))
            calls = []
            if holds:
                content, calls = parse_calls(content or "", self.routes.tool_format)
                if content:
                    await self.send(item_event, sid, "response.output_text.delta", response_id=rid,
                                    item_id=f"msg_{rid}", output_index=0, content_index=0, delta=content)
                first = 0 if content is None else 1
                for k, call in enumerate(calls, first):
                    for kind, fields in function_call_events(lambda kind, **f: (kind, f), k, call):
                        await self.send(item_event, sid, kind, response_id=rid, **fields)
            obj = response_object(rid, status, created, door.model_name, req, text=content, usage=usage,
                                  pddgw=timeline, logprobs=logprobs, calls=calls)
            await self.send(completed_event, sid, obj)
        except ApiError as e:
            await self.send(error_event, sid, str(e), e.code, e.param, response_id=rid)
        except asyncio.CancelledError:
            await self.send(error_event, sid, f"response {rid} was cancelled", "cancelled", response_id=rid)
        except RouterError as e:
            await self.send(error_event, sid, str(e), e.code, response_id=rid)
        except Exception as e:   # a bug: the client still hears why its response ended
            log.exception("respond_failed", request_id=rid)
            await self.send(error_event, sid, f"internal error: {type(e).__name__}: {e}", "server_error",
                            response_id=rid)
        finally:
            self.tasks.pop(rid, None)


def _releaser(slot: Slot) -> Callable[[asyncio.Task[None]], None]:
    return lambda _task: slot.release()
