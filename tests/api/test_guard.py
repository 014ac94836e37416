"""The connection guard through `GuardedSite`, in-process, on asyncio's loop and uvloop, plain and TLS.

The guard hears of connections from the protocols it wraps around the runner's
`web.Server` and of requests from its middleware, which finds a request's
connection by `request.transport`.  Were aiohttp to hand the middleware another
transport than the one its protocol was connected with, the middleware would
silently do nothing: `each_request_is_seen` says so.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry

from pddgw.api.guard import GUARD, ConnectionGuard, GuardedSite
from pddgw.config import Config, ServerConfig, TlsConfig
from pddgw.deploy.keys import write_keys
from pddgw.metrics import FrontDoorMetrics
from pddgw.net.tls import front_door_context

TIMEOUT_S = 0.3
CAP = 3
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop,
                                                             "uvloop": uvloop.new_event_loop}


class Door:
    """A bare app behind the guard: GET /seen answers what the guard knows of the request's connection."""

    def __init__(self, server_ctx: ssl.SSLContext | None):
        self.metrics = FrontDoorMetrics(CollectorRegistry())
        self.guard = ConnectionGuard(ServerConfig(header_read_timeout_s=TIMEOUT_S, keepalive_timeout_s=TIMEOUT_S,
                                                  max_connections_per_client=CAP), self.metrics)
        app = web.Application(middlewares=[self.guard.middleware], handler_args=self.guard.handler_args())
        app[GUARD] = self.guard
        app.router.add_get("/seen", self.seen)
        self.app = app
        self.server_ctx = server_ctx

    async def seen(self, request: web.Request) -> web.Response:
        conn = self.guard.conns.get(request.transport) if request.transport is not None else None
        return web.json_response(None if conn is None else {"inflight": conn.inflight,
                                                            "connections": len(self.guard.conns)})

    async def __aenter__(self) -> Door:
        self.runner = web.AppRunner(self.app, access_log=None, shutdown_timeout=1.0)
        await self.runner.setup()
        self.site = GuardedSite(self.runner, "127.0.0.1", 0, ssl_context=self.server_ctx)
        await self.site.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()

    def counts(self) -> dict[str, float]:
        return {f"{fam}:{s.labels['reason']}": s.value
                for fam, m in (("refused", self.metrics.refused), ("closed", self.metrics.closed))
                for metric in m.collect() for s in metric.samples
                if s.name.endswith("_total") and s.value}


@pytest.fixture(params=["plain", "tls"])
def tls(request, tmp_path: Path) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """-> (server context, client context), both None for plain HTTP."""
    if request.param == "plain":
        return None, None
    write_keys(tmp_path, Config())
    server = front_door_context(TlsConfig(front_door=True, cert_file=f"{tmp_path}/router.crt",
                                          key_file=f"{tmp_path}/router.key"))
    return server, ssl.create_default_context(cafile=f"{tmp_path}/ca.crt")


async def read_to_eof(port: int, client_ctx: ssl.SSLContext | None, send: bytes = b"") -> tuple[float, bytes]:
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_ctx,
                                                   server_hostname="127.0.0.1" if client_ctx else None)
    try:
        writer.write(send)
        async with asyncio.timeout(10):
            got = await reader.read()
        return time.monotonic() - t0, got
    finally:
        writer.close()


async def until(cond: Callable[[], bool], what: str) -> None:
    end = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < end, what
        await asyncio.sleep(0.01)


async def each_request_is_seen(server_ctx, client_ctx) -> None:
    async with Door(server_ctx) as door:
        scheme = "https" if client_ctx else "http"
        async with aiohttp.ClientSession() as s:
            for _ in range(2):                         # one kept-alive connection, two requests
                async with s.get(f"{scheme}://127.0.0.1:{door.site.port}/seen", ssl=client_ctx or True) as r:
                    assert r.status == 200
                    seen = await r.json()
                    assert seen is not None, (
                        "the middleware found no guarded connection for request.transport: aiohttp's "
                        "request.transport is not the transport its protocol was connected with, so the guard's "
                        "keep-alive timer would never run")
                    assert seen == {"inflight": 1, "connections": 1}
            # The idle connection closes at the keep-alive timeout; the guard forgets it.
            await until(lambda: not door.guard.conns, "the kept-alive connection closes")
        assert door.counts() == {"closed:keepalive_timeout": 1.0}
        assert not door.guard.per_address


async def silent_and_partial_heads_close(server_ctx, client_ctx) -> None:
    async with Door(server_ctx) as door:
        results = await asyncio.gather(read_to_eof(door.site.port, client_ctx),
                                       read_to_eof(door.site.port, client_ctx, b"GET /seen HTTP/1.1\r\nHost: x\r\n"))
        for elapsed, got in results:
            assert got == b"" and TIMEOUT_S - 0.01 <= elapsed < 5, (elapsed, got)
        await until(lambda: not door.guard.conns, "the guard forgets closed connections")
        assert door.counts() == {"closed:header_read_timeout": 2.0}


async def the_cap_answers_429(server_ctx, client_ctx) -> None:
    async with Door(server_ctx) as door:
        held = [await asyncio.open_connection("127.0.0.1", door.site.port, ssl=client_ctx,
                                              server_hostname="127.0.0.1" if client_ctx else None)
                for _ in range(CAP)]
        await until(lambda: len(door.guard.conns) == CAP, "the held connections are admitted")
        _, got = await read_to_eof(door.site.port, client_ctx)
        assert got.startswith(b"HTTP/1.1 429 Too Many Requests\r\n"), got
        assert b"max_connections_per_client = 3" in got
        assert len(door.guard.conns) == CAP and door.guard.per_address == {"127.0.0.1": CAP}
        for _, w in held:
            w.close()
        await until(lambda: not door.guard.conns and not door.guard.per_address, "the held ones are forgotten")
        assert door.counts() == {"refused:max_connections_per_client": 1.0}


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("case", [each_request_is_seen, silent_and_partial_heads_close, the_cap_answers_429],
                         ids=lambda f: f.__name__)
def test_the_guard_on_both_loops(loop, case, tls):
    with asyncio.Runner(loop_factory=LOOPS[loop]) as runner:
        runner.run(case(*tls))


def test_a_plain_tcp_site_leaves_requests_unguarded():
    """Served by `web.TCPSite` (or aiohttp's test server), the middleware finds no connection and passes."""
    async def main() -> None:
        door = Door(None)
        runner = web.AppRunner(door.app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{site.port}/seen") as r:
                assert r.status == 200 and await r.json() is None
        finally:
            await runner.cleanup()
        assert not door.guard.conns and door.counts() == {}

    asyncio.run(main())
