"""The front door: Responses API over WebSocket, health and debug state.

One aiohttp app on the router.  A WebSocket at /v1/responses carries any
number of responses at once (each `response.create` runs as its own task;
`stream_id` tells them apart on the client side); `response.cancel` or a
closed socket cancels them, which frees them on every node.  Every event is
decoded and validated at the edge; a bad one gets an `error` event naming
the field and the socket keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import WSMsgType, web

from pddgw.api.responses import (ApiError, CancelResponse, CreateResponse, completed_event, created_event,
                                 delta_event, error_event, parse_client_event, response_object)
from pddgw.config import Config
from pddgw.engines.tokenizer import Tokenizer
from pddgw.engines.types import RequestError, SamplingParams
from pddgw.pipeline.ordering import TokenRun
from pddgw.pipeline.router import Outcome, Router, RouterError, new_request_id

log = structlog.get_logger(__name__)

DEFAULT_MAX_OUTPUT_TOKENS = 256

StateFn = Callable[[], Awaitable[dict[str, Any]]]


class _Detok:
    """Incremental detokenizer: each push decodes only a short window of recent tokens.

    The text of ids[prefix:read] was already emitted; decoding ids[prefix:]
    and cutting that off yields the new text, held back while it ends in a
    partial character.  (Decoding the whole output per token would cost
    quadratic time on the event loop.)
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0
        self.read = 0

    def push(self, ids: tuple[int, ...]) -> str:
        self.ids += ids
        done = self.tok.decode(self.ids[self.prefix : self.read])
        text = self.tok.decode(self.ids[self.prefix :])
        if text.endswith("\ufffd") or not text.startswith(done):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(done):]


class FrontDoor:
    def __init__(self, cfg: Config, router: Router, tokenizer: Tokenizer, model_name: str, state: StateFn):
        self.cfg = cfg
        self.router = router
        self.tok = tokenizer
        self.model_name = model_name
        self._state = state
        self.active = 0
        self.max_prompt = router.spec.max_position_embeddings
        if cfg.model.max_model_len:
            self.max_prompt = min(self.max_prompt, cfg.model.max_model_len)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.server.max_message_bytes)
        app.router.add_get("/v1/responses", self.responses_ws)
        app.router.add_get("/health", self.health)
        app.router.add_get("/debug/state", self.debug_state)
        return app

    # ---- auth ------------------------------------------------------------------------
    def _authorized(self, request: web.Request) -> bool:
        keys = self.cfg.server.api_keys
        if not keys:
            return True
        auth = request.headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else ""
        return any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)

    # ---- plain HTTP ----------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "router", "active_requests": self.active})

    async def debug_state(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": "invalid or missing API key"}, status=401)
        return web.json_response(await self._state())

    # ---- WebSocket ---------------------------------------------------------------------
    async def responses_ws(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"type": "invalid_api_key", "message":
                                                "invalid or missing API key (Authorization: Bearer KEY)"}},
                                     status=401)
        ws = web.WebSocketResponse(max_msg_size=self.cfg.server.max_message_bytes, heartbeat=30.0,
                                   compress=False)
        await ws.prepare(request)
        conn = _Connection(self, ws)
        try:
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    await conn.on_event(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    log.warning("client_ws_error", error=str(ws.exception()))
        finally:
            await conn.close()
        return ws


class _Connection:
    """One client socket: its responses in flight and its event sequence."""

    def __init__(self, door: FrontDoor, ws: web.WebSocketResponse):
        self.door = door
        self.ws = ws
        self.seq = 0
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def send(self, make: Callable[..., bytes], *args: Any, **kwargs: Any) -> None:
        """Send the event `make(sequence_number, *args, **kwargs)`; a closed socket drops it."""
        self.seq += 1
        if not self.ws.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(make(self.seq, *args, **kwargs).decode())

    async def on_event(self, raw: str | bytes) -> None:
        door = self.door
        try:
            ev = parse_client_event(raw, door.max_prompt)
        except ApiError as e:
            await self.send(error_event, None, str(e), e.code, e.param)
            return
        if isinstance(ev, CancelResponse):
            task = self.tasks.get(ev.response_id)
            if task is None:
                await self.send(error_event, None, f"no response {ev.response_id!r} in flight on this "
                                "connection", param="response_id")
            else:
                task.cancel()
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

    def _prepare(self, req: CreateResponse) -> tuple[tuple[int, ...], SamplingParams]:
        door = self.door
        if req.prompt_token_ids is not None:
            ids = req.prompt_token_ids
            vocab = door.router.spec.vocab_size
            if any(t >= vocab for t in ids):
                raise ApiError(f"prompt_token_ids must be < vocab size {vocab}", "prompt_token_ids")
        else:
            ids = tuple(door.tok.apply_chat_template(list(req.messages)))
        room = door.max_prompt - len(ids)
        if room < 1:
            raise ApiError(f"prompt is {len(ids)} tokens; the context length is {door.max_prompt}",
                           "input", "context_length_exceeded")
        max_out = min(req.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS, room)
        seed = req.seed if req.seed is not None else secrets.randbits(63)
        try:
            return ids, SamplingParams(max_tokens=max_out, temperature=req.temperature, top_p=req.top_p,
                                       seed=seed)
        except RequestError as e:
            raise ApiError(str(e)) from None

    async def _respond(self, rid: str, req: CreateResponse) -> None:
        door = self.door
        sid = req.stream_id
        created = int(time.time())
        try:
            ids, sampling = self._prepare(req)
        except ApiError as e:
            await self.send(error_event, sid, str(e), e.code, e.param, response_id=rid)
            self.tasks.pop(rid, None)
            return
        door.active += 1
        detok = _Detok(door.tok)
        await self.send(created_event, sid, response_object(rid, "in_progress", created, door.model_name, req))

        async def emit(run: TokenRun) -> None:
            text = detok.push(run.token_ids)
            await self.send(delta_event, sid, rid, text, run.position, list(run.token_ids), run.role)

        try:
            out: Outcome = await door.router.run(rid, ids, sampling, emit, req.pipeline, req.handoff_mode)
            usage = {"input_tokens": len(ids), "input_tokens_details": {"cached_tokens": out.cached_tokens},
                     "output_tokens": len(out.output_ids),
                     "total_tokens": len(ids) + len(out.output_ids)}
            timeline = {**out.record.to_dict(), "seed": sampling.seed, "finish_reason": out.finish_reason,
                        "output_token_ids": list(out.output_ids)}
            obj = response_object(rid, "completed", created, door.model_name, req,
                                  text=door.tok.decode(list(out.output_ids)), usage=usage, pddgw=timeline)
            await self.send(completed_event, sid, obj)
        except asyncio.CancelledError:
            await self.send(error_event, sid, f"response {rid} was cancelled", "cancelled", response_id=rid)
        except RouterError as e:
            await self.send(error_event, sid, str(e), e.code, response_id=rid)
        except Exception as e:   # a bug: the client still hears why its response ended
            log.exception("respond_failed", request_id=rid)
            await self.send(error_event, sid, f"internal error: {type(e).__name__}: {e}", "server_error",
                            response_id=rid)
        finally:
            door.active -= 1
            self.tasks.pop(rid, None)
