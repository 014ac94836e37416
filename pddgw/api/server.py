"""The front door's routes: Responses API over WebSocket, the OpenAI HTTP API, health and debug state.

`build_app(door)` is the one place routes are registered; what every route
shares (API keys, steering, the prompt and sampling) is `FrontDoor`
(door.py), the OpenAI HTTP routes live in openai_http.py (its docstring:
behaviours and errors), the WebSocket Responses door here.

One aiohttp app on the router.  A WebSocket at /v1/responses carries any
number of responses at once (each `response.create` runs as its own task;
`stream_id` tells them apart on the client side); `response.cancel` or a
closed socket cancels them, which frees them on every node.  Every event
(a text or binary frame holding UTF-8 JSON) is decoded and validated at the
edge; a bad one gets an `error` event naming the problem (and echoing its
`stream_id` when it had a valid one) and the socket keeps serving.

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
from pddgw.api.door import Detokenizer, FrontDoor, key_protocol
from pddgw.api.openai_http import OpenAIRoutes, openai_not_found
from pddgw.api.responses import (ApiError, CancelResponse, CreateResponse, brief, completed_event,
                                 created_event, delta_event, error_event, parse_client_event, response_object)
from pddgw.api.webchat import add_webchat_routes
from pddgw.metrics import metrics_route
from pddgw.pipeline.ordering import TokenRun
from pddgw.pipeline.router import Outcome, RouterError, new_request_id

log = structlog.get_logger(__name__)


def build_app(door: FrontDoor) -> web.Application:
    """The front door's aiohttp app: every route is registered here."""
    openai = OpenAIRoutes(door)
    app = web.Application(client_max_size=door.cfg.server.max_message_bytes, middlewares=[openai_not_found])
    r = app.router
    # Responses API, WebSocket mode (GET upgrade) and HTTP (POST, optionally SSE).
    r.add_get("/v1/responses", ResponsesSocket(door).handle)
    r.add_post("/v1/responses", openai.responses)
    # OpenAI HTTP API (openai_http.py).
    r.add_post("/v1/chat/completions", openai.chat_completions)
    r.add_post("/v1/completions", openai.completions)
    r.add_get("/v1/models", openai.models)
    r.add_get("/v1/models/{model}", openai.model)
    # Operations.
    r.add_get("/health", door.health)
    r.add_get("/debug/state", door.debug_state)
    # ---- further routes (metrics, web page, ...) are registered below this line ----
    add_webchat_routes(app)
    metrics_route(app, door.router.metrics.scrape)     # GET /metrics (counts only: no key, like vLLM)
    return app


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

    async def handle(self, request: web.Request) -> web.StreamResponse:
        door = self.door
        if not door.authorized(request):
            return web.json_response({"error": {"type": "invalid_api_key", "message":
                                                "invalid or missing API key (Authorization: Bearer KEY)"}},
                                     status=401)
        # aiohttp refuses a message of max_msg_size bytes itself; max_message_bytes is the largest accepted.
        proto = key_protocol(request)
        ws = _StrictWebSocketResponse(max_msg_size=door.cfg.server.max_message_bytes + 1, heartbeat=30.0,
                                      compress=False, protocols=(proto,) if proto else ())
        await ws.prepare(request)
        conn = _Connection(door, ws, door.may_steer(request))
        try:
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await conn.on_event(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    # A protocol error (msg.data) has already closed the socket with its code.
                    log.warning("client_ws_error", error=str(msg.data), code=getattr(msg.data, "code", None))
        finally:
            await conn.close()
        return ws


class _Connection:
    """One client socket: its responses in flight and its event sequence."""

    def __init__(self, door: FrontDoor, ws: web.WebSocketResponse, may_steer: bool):
        self.door = door
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
        if door.active >= door.cfg.server.max_concurrent_requests:
            await self.send(error_event, ev.stream_id, "server busy: too many responses in flight",
                            "rate_limit_exceeded")
            return
        rid = new_request_id()
        self.tasks[rid] = asyncio.create_task(self._respond(rid, ev), name=f"respond-{rid}")

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
        counted = False
        try:
            args = (req.prompt_token_ids, req.messages, req.max_output_tokens, req.sampling,
                    "input" if req.prompt_token_ids is None else "prompt_token_ids", req.logprobs)
            prep = (await asyncio.to_thread(door.prepare, *args) if door.heavy(req.messages)
                    else door.prepare(*args))
            ids, sampling = prep.ids, prep.sampling
            door.active += 1
            counted = True
            detok = Detokenizer(door.tok)
            await self.send(created_event, sid, response_object(rid, "in_progress", created, door.model_name,
                                                                 req))
            # With logprobs asked for: each delta's, and all of them for the completed response.
            logprobs: list[dict[str, Any]] | None = None if req.logprobs is None else []

            async def emit(run: TokenRun) -> None:
                text = detok.push(run.token_ids)
                lps = None
                if logprobs is not None:
                    lps = lpfmt.content(door.pieces, run.token_ids, run.logprobs)
                    logprobs.extend(lps)
                await self.send(delta_event, sid, rid, text, run.position, list(run.token_ids), run.role, lps)

            out: Outcome = await door.router.run(rid, ids, sampling, emit, req.pipeline, req.handoff_mode)
            usage = {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": out.cached_tokens},
                     "output_tokens": len(out.output_ids),
                     "total_tokens": len(ids) + len(out.output_ids)}
            timeline = {**out.record.to_dict(), "seed": sampling.seed, "finish_reason": out.finish_reason,
                        "output_token_ids": list(out.output_ids)}
            status = "incomplete" if prep.clamped and out.finish_reason == "length" else "completed"
            obj = response_object(rid, status, created, door.model_name, req,
                                  text=door.tok.decode(list(out.output_ids)), usage=usage, pddgw=timeline,
                                  logprobs=logprobs)
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
            if counted:
                door.active -= 1
            self.tasks.pop(rid, None)
