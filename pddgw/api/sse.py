"""Server-sent events for the HTTP routes, and watching a client that may go away.

`SseStream` sends its headers with the first events (so an error before any
token is still a plain HTTP error with its status); one write at a time
(choices stream concurrently); a failed write marks the client gone and every
later send is dropped.  `until_gone` runs a request's work as a task and
cancels it (awaiting the cancellation) when the client's connection closes
first, which frees the request on every node; the connection is looked at
every `DISCONNECT_POLL_S` while the work waits.

`sse_data` spells one `data:` event; `SSE_DONE` ends a chat / completions stream.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

import orjson
from aiohttp import web

T = TypeVar("T")

# How often a request waiting on the router (queued, or between tokens) looks at its client's socket.
DISCONNECT_POLL_S = 0.25


def sse_data(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client closed its connection before its answer ended."""


class SseStream:
    """An SSE response whose headers go out with the first events; a failed write marks the client gone."""

    def __init__(self, request: web.Request):
        self.request = request
        self.resp: web.StreamResponse | None = None
        self.gone = asyncio.Event()
        # n > 1: the choices send concurrently; one write (and the headers) at a time.
        self._lock = asyncio.Lock()

    async def send(self, events: list[bytes]) -> None:
        async with self._lock:
            await self._send(events)

    async def _send(self, events: list[bytes]) -> None:
        if self.gone.is_set() or not events:
            return
        try:
            if self.resp is None:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                                   "X-Accel-Buffering": "no"})
                self.resp = resp
                await resp.prepare(self.request)
            await self.resp.write(b"".join(events))
        except (ConnectionError, RuntimeError):
            self.gone.set()

    async def end(self) -> web.StreamResponse:
        assert self.resp is not None
        if not self.gone.is_set():
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.resp.write_eof()
        return self.resp


async def _watch(request: web.Request, gone: asyncio.Event) -> None:
    """Returns when the client's connection is closed (or `gone` is set by a failed write)."""
    while not gone.is_set():
        t = request.transport
        if t is None or t.is_closing():
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(DISCONNECT_POLL_S):
                await gone.wait()


async def until_gone(request: web.Request, gone: asyncio.Event, work: Awaitable[T]) -> T:
    """Await `work` as a task; the client going away first cancels it (-> ClientGone)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_watch(request, gone))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:      # this handler was cancelled (server shutdown): so is the request
        watcher.cancel()
        await _cancel(task)
        raise
    watcher.cancel()
    if not task.done():
        await _cancel(task)
        raise ClientGone()
    return task.result()


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
