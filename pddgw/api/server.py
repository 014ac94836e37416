"""The front door's routes: Responses API over WebSocket, the OpenAI HTTP API, health and debug state.

`build_app(door)` is the one place routes are registered; what every route
shares (API keys, steering, the prompt and sampling) is `FrontDoor`
(door.py), the OpenAI HTTP routes live in openai_routes.py (its docstring:
behaviours and errors), the WebSocket Responses door here.

One aiohttp app on the router.  A WebSocket at /v1/responses carries any
number of responses at once (each `response.create` runs as its own task;
`stream_id` tells them apart on the client side); tools, `tool_choice`, `text.format` and
function-call input items are decoded as over HTTP (responses.py) and the prompt and grammar
prepared by the same code (`OpenAIRoutes.prepare_response`); with tools the text deltas carry
tokens but no text, and a call comes as its `function_call` item's events before
`response.completed`; `response.cancel` or a
closed socket cancels them, which frees them on every node.  Every event
(a text or binary frame holding UTF-8 JSON) is decoded and validated at the
edge; a bad one gets an `error` event naming the problem (and echoing its
`stream_id` when it had a valid one) and the socket keeps serving.  Each
`response.create` takes its place under `[server] max_concurrent_requests`
(`door.admission`) before the event loop moves on to the next event, and gives
it back when its task ends (a done-callback: also for a task cancelled before
it ran); one over the bound gets an `error` event `rate_limit_exceeded` at
once.  While the router drains (SIGTERM: `door.drain`), a new request
(a generating POST, a WebSocket upgrade, a `response.create` on an open
socket) is refused with 503 / an error event `unavailable` saying so, and
GET /health answers 503 `{"status": "draining"}`; what was admitted runs
to its end.  A socket that sends no event within `[server] websocket_idle_timeout_s`
of its upgrade is closed with 1008 (counted, `websocket_idle_timeout`).

The connection guard (guard.py: read timeouts, the per-address cap) is the
app's first middleware and its `handler_args`; deploy/serve.py serves the app
with guard.py's `FrontDoorRunner`.

A frame that breaks the WebSocket protocol itself is not an event: the
connection fails with the RFC 6455 close code (1002 protocol error, 1007 a
text frame that is not UTF-8, 1009 a message over `max_message_bytes`,
refused from its header before the payload is read), and only that
connection ends.

Unmasked client frames.  RFC 6455 section 5.1: "The server MUST close the
connection upon receiving a frame that is not masked."  aiohttp's reader is
direction-agnostic (its THREAT_MODEL.md lists this as item 3.1) and has no
hook for it; the compiled reader keeps the frame's mask bit in a C field
that a subclass cannot read.  So `_StrictWebSocketResponse` installs
aiohttp's pure-Python reader with one override, `_MaskedFrameReader`, which
fails any unmasked frame with 1002.  Client frames here are small JSON
events, so the Python reader costs nothing that matters; the unmasking
itself stays in aiohttp's compiled `websocket_mask`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import WebSocketError, WSCloseCode, WSMsgType, web
from aiohttp._websocket import reader_py
from aiohttp.helpers import DEFAULT_CHUNK_SIZE

from pddgw.api import logprobs as lpfmt
from pddgw.api.door import Detokenizer, FrontDoor, Slot, key_protocol
from pddgw.api.errors import ApiError, brief
from pddgw.api.guard import GUARD, ConnectionGuard
from pddgw.api.openai_errors import error_response, openai_not_found
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
from pddgw.api.tokenize import add_tokenize_routes
from pddgw.api.toolcalls import parse_calls
from pddgw.api.webchat import add_webchat_routes
from pddgw.core.tokens import TokenRun
from pddgw.metrics import metrics_route
from pddgw.pipeline.router import Outcome, RouterError, new_request_id

log = structlog.get_logger(__name__)


def build_app(door: FrontDoor) -> web.Application:
    """The front door's aiohttp app: every route is registered here."""
    openai = OpenAIRoutes(door)
    guard = ConnectionGuard(door.cfg.server, door.metrics)
    app = web.Application(client_max_size=door.cfg.server.max_message_bytes,
                          middlewares=[guard.middleware, openai_not_found, _draining(door)],
                          handler_args=guard.handler_args())
    app[GUARD] = guard
    r = app.router
    # Responses API, WebSocket mode (GET upgrade) and HTTP (POST, optionally SSE).
    r.add_get("/v1/responses", ResponsesSocket(door).handle)
    r.add_post("/v1/responses", openai.responses)
    # OpenAI HTTP API (openai_routes.py).
    r.add_post("/v1/chat/completions", openai.chat_completions)
    r.add_post("/v1/completions", openai.completions)
    r.add_get("/v1/models", openai.models)
    r.add_get("/v1/models/{model}", openai.model)
    # Operations.
    r.add_get("/health", _health(door))
    r.add_get("/debug/state", door.debug_state)
    # ---- further routes (metrics, web page, ...) are registered below this line ----
    add_webchat_routes(app)
    add_tokenize_routes(app, door)                     # POST /tokenize, /detokenize (vLLM's; api/tokenize.py)
    metrics_route(app, door.router.metrics.scrape)     # GET /metrics (counts only: no key, like vLLM)
    return app


# Routes that start a request (generation): refused while the router drains.
_REQUEST_ROUTES = frozenset({("POST", "/v1/responses"), ("GET", "/v1/responses"), ("POST", "/v1/chat/completions"),
                             ("POST", "/v1/completions")})


def _draining(door: FrontDoor) -> Callable[..., Any]:
    @web.middleware
    async def draining(request: web.Request, handler: Any) -> web.StreamResponse:
        if door.drain.draining and (request.method, request.path) in _REQUEST_ROUTES:
            return error_response(door.drain.MESSAGE, "unavailable")
        return await handler(request)

    return draining


def _health(door: FrontDoor) -> Callable[[web.Request], Any]:
    async def health(request: web.Request) -> web.StreamResponse:
        if door.drain.draining:
            return web.json_response({"status": "draining", "role": "router",
                                      "active_requests": door.admission.active}, status=503)
        return await door.health(request)

    return health


class _MaskedFrameReader(reader_py.WebSocketReader):
    """aiohttp's Python WebSocket reader; an unmasked client frame fails the connection with 1002.

    `_handle_frame` runs once per frame, when its payload is complete and
    while `_has_mask` still describes that frame.  The payload was already
    bounded by max_msg_size from the header, as for a masked frame.
    """

    def _handle_frame(self, fin: bool, opcode: int, payload: bytes | bytearray, compressed: int) -> None:
        if not self._has_mask:
            raise WebSocketError(WSCloseCode.PROTOCOL_ERROR, "client frame not masked (RFC 6455 section 5.1)")
        super()._handle_frame(fin, opcode, payload, compressed)


class _StrictWebSocketResponse(web.WebSocketResponse):
    """A WebSocketResponse that reads client frames with `_MaskedFrameReader`."""

    def _post_start(self, request: web.BaseRequest, protocol: str | None, writer: Any) -> None:
        # aiohttp 3.14's _post_start with the Python queue and reader in place of the compiled
        # ones (the Python reader needs the Python queue).  The reader must be in place before
        # set_parser, which feeds it any frames that arrived with the upgrade request.
        self._ws_protocol = protocol
        self._writer = writer
        self._reset_heartbeat()
        assert self._loop is not None
        queue = reader_py.WebSocketDataQueue(request._protocol, DEFAULT_CHUNK_SIZE, loop=self._loop)
        self._reader = queue
        self._parser = _MaskedFrameReader(queue, self._max_msg_size, compress=bool(self._compress),
                                          decode_text=self._decode_text)
        cb = None if self._heartbeat is None else self._on_data_received
        request.protocol.set_parser(self._parser, data_received_cb=cb)
        request.protocol.keep_alive(False)


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
        ws = _StrictWebSocketResponse(max_msg_size=door.cfg.server.max_message_bytes + 1, heartbeat=30.0,
                                      compress=False, protocols=(proto,) if proto else ())
        await ws.prepare(request)
        conn = _Connection(door, ws, door.may_steer(request, websocket=True), self.routes)
        # Until the first event: an absolute deadline (receive's own timeout restarts at every ping).
        first_by: float | None = asyncio.get_running_loop().time() + door.cfg.server.websocket_idle_timeout_s
        try:
            while not ws.closed:
                try:
                    async with asyncio.timeout_at(first_by):
                        msg = await ws.receive()
                except TimeoutError:
                    door.metrics.close("websocket_idle_timeout")
                    await ws.close(code=WSCloseCode.POLICY_VIOLATION,
                                   message=b"no event within [server] websocket_idle_timeout_s")
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
