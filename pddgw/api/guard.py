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
`GuardedSite` (a `web.BaseSite`, used like `web.TCPSite`) listens with
`loop.create_server` and wraps each protocol of the runner's `web.Server` (aiohttp's
documented protocol factory) in a `_GuardedConnection`, which hears of the
connection's start and end and asks the guard first; the middleware hears of each
request's start and end, finding its connection by `request.transport`.  Only public
aiohttp names are used.  Under aiohttp's test server (or `web.TCPSite`) the middleware
finds no guarded connection and does nothing.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

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
    transport.write(head + body)       # type: ignore[attr-defined]  # a stream transport (uvloop's too)
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
    """The front door's open connections (by transport), their read timers and the per-address tally."""

    def __init__(self, srv: ServerConfig, metrics: FrontDoorMetrics):
        self.srv = srv
        self.metrics = metrics
        self.conns: dict[asyncio.BaseTransport, _Conn] = {}
        self.per_address: Counter[str] = Counter()
        metrics.watch(connections=lambda: len(self.conns))

    def handler_args(self) -> dict[str, Any]:
        """aiohttp RequestHandler arguments (`web.Application(handler_args=...)`)."""
        # aiohttp's idle timer, a backstop: it fires after ours (header and keep-alive) would have.
        return {"keepalive_timeout": self.srv.keepalive_timeout_s + self.srv.header_read_timeout_s,
                "logger": _ServerLog(self.metrics)}

    # ---- connections (via _GuardedConnection) ---------------------------------------------
    def admit(self, transport: asyncio.BaseTransport) -> bool:
        """A new connection: False (answered 429 and closed; aiohttp never sees it) when its
        address already has `max_connections_per_client` open; else tracked and timed."""
        addr = _address(transport)
        if self.per_address[addr] >= self.srv.max_connections_per_client:
            self.metrics.refuse("max_connections_per_client")
            close_with(transport, 429, f"too many connections from {addr} ([server] max_connections_per_client = "
                                       f"{self.srv.max_connections_per_client})")
            return False
        conn = self.conns[transport] = _Conn(addr)
        self.per_address[addr] += 1
        conn.timer = asyncio.get_running_loop().call_later(self.srv.header_read_timeout_s, self.expire, transport,
                                                           "header_read_timeout")
        return True

    def lost(self, transport: asyncio.BaseTransport) -> None:
        conn = self.conns.pop(transport, None)
        if conn is None:
            return
        conn.disarm()
        self.per_address[conn.address] -= 1
        if not self.per_address[conn.address]:
            del self.per_address[conn.address]

    def expire(self, transport: asyncio.BaseTransport, reason: str) -> None:
        """A read timer fired: close the connection unless a request is in flight on it.  aiohttp's
        protocol hears of it from `connection_lost`, as of a peer that hung up."""
        conn = self.conns.get(transport)
        if conn is None or conn.inflight:
            return
        conn.timer = None
        self.metrics.close(reason)
        transport.close()

    # ---- requests (the app's middleware) --------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request,
                         handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        transport = request.transport
        conn = self.conns.get(transport) if transport is not None else None
        if transport is None or conn is None:          # not served by GuardedSite (a test server), or gone
            return await handler(request)
        conn.disarm()
        conn.inflight += 1
        try:
            return await handler(request)
        finally:
            conn.inflight -= 1
            if not conn.inflight and transport in self.conns:
                conn.disarm()
                conn.timer = asyncio.get_running_loop().call_later(
                    self.srv.keepalive_timeout_s, self.expire, transport, "keepalive_timeout")


class _GuardedConnection(asyncio.Protocol):
    """One front-door connection: the guard admits it before aiohttp's protocol for it is made
    (from `server`, the runner's `web.Server`); every asyncio protocol event then passes through."""

    __slots__ = ("guard", "server", "inner", "transport")

    def __init__(self, guard: ConnectionGuard, server: web.Server):
        self.guard = guard
        self.server = server
        self.inner: asyncio.Protocol | None = None            # None: refused, or not yet connected
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.guard.admit(transport):
            self.transport = transport
            self.inner = self.server()
            self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is not None and self.transport is not None:
            self.guard.lost(self.transport)
            self.inner.connection_lost(exc)


class GuardedSite(web.BaseSite):
    """`web.TCPSite`'s counterpart for the front door: serves an `AppRunner` of `build_app`'s app
    on `host`:`port` (0: any free port, see `port`) with every connection through the app's
    `ConnectionGuard`.  Registered with the runner, so `runner.cleanup()` stops it; its address
    is `port` (`runner.addresses` lists only aiohttp's own sites).

    Public API only: `runner.server` (aiohttp's documented protocol factory for
    `create_server`), `BaseSite.start`/`stop`, asyncio's `Protocol` and `request.transport`.
    The wrapping costs one Python call (~25 ns) a protocol event.  Against the earlier
    `web.Server` subclass that a private AppRunner method override served (aiohttp 3.14.5,
    CPython 3.11, uvloop, client in the same process on 2 shared cores, medians of 5
    alternating runs): keep-alive GETs 31,160 vs 31,380 req/s, a new connection per GET
    9,364 vs 9,425 req/s, each inside its runs' spread."""

    def __init__(self, runner: web.AppRunner, host: str | None = None, port: int = 0, *,
                 ssl_context: ssl.SSLContext | None = None, backlog: int = 128):
        super().__init__(runner, ssl_context=ssl_context, backlog=backlog)
        self.runner = runner
        self.guard = runner.app[GUARD]
        self.host = host
        self.requested_port = port
        self.ssl_context = ssl_context
        self.backlog = backlog
        self.listener: asyncio.Server | None = None

    @property
    def port(self) -> int:
        """The bound port once started (the first socket's), else the one asked for."""
        if self.listener is not None and self.listener.sockets:
            return int(self.listener.sockets[0].getsockname()[1])
        return self.requested_port

    @property
    def name(self) -> str:
        host = self.host or "0.0.0.0"
        host = f"[{host}]" if ":" in host else host
        return f"{'https' if self.ssl_context is not None else 'http'}://{host}:{self.port}"

    async def start(self) -> None:
        await super().start()                          # registered: the runner's cleanup stops it
        server = self.runner.server
        if server is None:
            raise RuntimeError("GuardedSite: call runner.setup() before start()")
        guard = self.guard
        self.listener = await asyncio.get_running_loop().create_server(
            lambda: _GuardedConnection(guard, server), self.host, self.requested_port,
            ssl=self.ssl_context, backlog=self.backlog)

    async def stop(self) -> None:
        if self.listener is not None:                  # stops accepting; open connections stay to the runner
            self.listener.close()
        await super().stop()


class _ServerLog(logging.LoggerAdapter):
    """aiohttp's server logger for the front door: a malformed request head is a client's error,
    logged as one line (at aiohttp's level for it) and counted; anything else keeps its traceback."""

    def __init__(self, metrics: FrontDoorMetrics):
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.metrics = metrics

    def log(self, level: int, msg: object, *args: object, exc_info: Any = None, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.metrics.refuse("malformed_head")
            emit = log.warning if level >= logging.WARNING else log.debug
            emit("malformed_request_head", client=str(args[0]) if args else None, status=exc_info.code,
                 error=str(exc_info.message)[:200])
            return
        super().log(level, msg, *args, exc_info=exc_info, **kwargs)
