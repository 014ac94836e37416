"""The front door's connection guard: read timeouts, a per-address connection cap, one-line bad heads.

Contract (`[server]` settings; every close and refusal is counted in /metrics as
`pddgw:front_door_closed_total{reason}` / `pddgw:front_door_refused_total{reason}`):

* `header_read_timeout_s`: a new connection whose first request head is not
  complete by then is closed (`header_read_timeout`): silence, a partial head, a
  slowloris trickling header bytes.
* `keepalive_timeout_s`: a connection with no request in flight is closed this
  long after its last request ended (`keepalive_timeout`); this also bounds the
  head of a later request on a kept-alive connection.
* `max_connections_per_client`: a connection from an address that already has
  that many open is answered 429 and closed at once; it never reaches the app.
* A malformed request head: aiohttp answers 400 and closes; the server log gets
  one line, no traceback (`malformed_head`).

A body's minimum rate is read by its handler (`FrontDoor.read_body`), a
WebSocket's first event by its route (responses_ws.py); both reuse `close_with`.
`_GuardedServer` (a `web.Server`) hears of each connection from aiohttp's
`connection_made` / `connection_lost` callbacks, the middleware of each request's
start and end; `FrontDoorRunner` serves the app with it (deploy/serve.py).  Under
aiohttp's test server the middleware finds no guarded connection and does nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from pddgw.config import ServerConfig
from pddgw.metrics import FrontDoorMetrics

log = structlog.get_logger(__name__)

GUARD: web.AppKey[ConnectionGuard] = web.AppKey("guard")


def close_with(transport: asyncio.BaseTransport | None, status: int, message: str) -> None:
    """Write a minimal `status` response (Connection: close) and close the connection: for a
    connection no handler will answer (refused before its request, or cut in its body)."""
    if transport is None or transport.is_closing():
        return
    body = (message + "\n").encode()
    head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    transport.write(head + body)       # type: ignore[attr-defined]  (a stream transport; uvloop's too)
    transport.close()           # after what was written is flushed


def _address(transport: asyncio.BaseTransport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class _Conn:
    __slots__ = ("address", "inflight", "timer")

    def __init__(self, address: str):
        self.address = address
        self.inflight = 0
        self.timer: asyncio.TimerHandle | None = None

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class ConnectionGuard:
    """The front door's open connections, their read timers and the per-address tally."""

    def __init__(self, srv: ServerConfig, metrics: FrontDoorMetrics):
        self.srv = srv
        self.metrics = metrics
        self._conns: dict[RequestHandler, _Conn] = {}
        self.per_address: Counter[str] = Counter()
        metrics.watch(connections=lambda: len(self._conns))

    def handler_args(self) -> dict[str, Any]:
        """aiohttp RequestHandler arguments (`web.Application(handler_args=...)`)."""
        # aiohttp's idle timer, a backstop: it fires after ours (header and keep-alive) would have.
        return {"keepalive_timeout": self.srv.keepalive_timeout_s + self.srv.header_read_timeout_s,
                "logger": _ServerLog(self.metrics)}

    # ---- aiohttp's callbacks (via _GuardedServer) ----------------------------------------
    def opened(self, handler: RequestHandler, transport: asyncio.BaseTransport) -> None:
        addr = _address(transport)
        if self.per_address[addr] >= self.srv.max_connections_per_client:
            self.metrics.refuse("max_connections_per_client")
            transport.pause_reading()                  # type: ignore[attr-defined]
            msg = (f"too many connections from {addr} ([server] max_connections_per_client = "
                   f"{self.srv.max_connections_per_client})")
            # Not closed from inside connection_made: aiohttp's handler task for this connection
            # is created after it returns and asserts on a connection not yet lost.  Two loop
            # hops put the close after that task's first step (asyncio and uvloop alike).
            loop = asyncio.get_running_loop()
            loop.call_soon(loop.call_soon, close_with, transport, 429, msg)
            return
        conn = self._conns[handler] = _Conn(addr)
        self.per_address[addr] += 1
        conn.timer = asyncio.get_running_loop().call_later(self.srv.header_read_timeout_s, self._expire, handler,
                                                           "header_read_timeout")

    def lost(self, handler: RequestHandler) -> None:
        conn = self._conns.pop(handler, None)
        if conn is None:
            return
        conn.disarm()
        self.per_address[conn.address] -= 1
        if not self.per_address[conn.address]:
            del self.per_address[conn.address]

    def _expire(self, handler: RequestHandler, reason: str) -> None:
        conn = self._conns.get(handler)
        if conn is None or conn.inflight:
            return
        conn.timer = None
        self.metrics.close(reason)
        handler.force_close()

    # ---- requests (the app's middleware) --------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        conn = self._conns.get(request.protocol)       # type: ignore[arg-type]
        if conn is None:                               # not served by FrontDoorRunner (a test server)
            return await handler(request)
        conn.disarm()
        conn.inflight += 1
        try:
            return await handler(request)
        finally:
            conn.inflight -= 1
            if not conn.inflight and request.protocol in self._conns:
                conn.disarm()
                conn.timer = asyncio.get_running_loop().call_later(
                    self.srv.keepalive_timeout_s, self._expire, request.protocol, "keepalive_timeout")


class _GuardedServer(web.Server):
    """aiohttp's low-level server whose connection callbacks also go to the guard."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.guard = guard

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.guard.opened(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.guard.lost(handler)


class FrontDoorRunner(web.AppRunner):
    """An AppRunner serving `app` (server.py's `build_app`) through its `ConnectionGuard`."""

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()          # the app started; its handler arguments resolved
        return _GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                              handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop(),
                              guard=self.app[GUARD], **plain._kwargs)


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger for the front door: a malformed request head is a client's error,
    logged as one line (at aiohttp's level for it) and counted; anything else keeps its traceback."""

    def __init__(self, metrics: FrontDoorMetrics):
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self._metrics = metrics

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self._metrics.refuse("malformed_head")
            emit = log.warning if level >= logging.WARNING else log.debug
            emit("malformed_request_head", client=str(args[0]) if args else None, status=exc_info.code,
                 error=str(exc_info.message)[:200])
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)
