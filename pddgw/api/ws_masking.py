"""RFC 6455 section 5.1 at the front door: a client frame that is not masked fails its connection with 1002.

aiohttp's WebSocket reader accepts unmasked client frames and has no public
way to refuse them, so `MaskCheck` stands between the connection's transport
and aiohttp's protocol (asyncio's `transport.set_protocol`, installed before
the 101 goes out) and reads each frame's head as the bytes pass.  Every byte
goes on to aiohttp unchanged and unbuffered up to an unmasked frame's head;
aiohttp never gets that frame nor anything after it.  At most one frame head
(14 bytes) is held here; a payload is counted past, whatever its declared
length (aiohttp refuses one over max_msg_size from its header, as before).

Order: the messages completed before the bad frame are still received and
answered.  `receive` returns None once the route has had each of them, and
`fail` then sends close 1002 and drops the connection without waiting for the
client's close frame.  A client must send nothing before the 101 (section
4.1); a message that reached aiohttp before this check was installed (more
messages received than counted here) fails the connection the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import WSCloseCode, WSMessage, WSMsgType, web

_UNMASKED = "client frame not masked (RFC 6455 section 5.1)"
_EARLY = "client frame sent before the handshake response (RFC 6455 section 4.1)"


class MaskCheck(asyncio.Protocol):
    """The transport's protocol in front of aiohttp's: passes bytes on, stops at an unmasked client frame."""

    def __init__(self, transport: asyncio.Transport, inner: Any):
        self.transport = transport
        self.inner = inner                  # aiohttp's protocol: it gets every byte this one passes
        self.reason: str | None = None      # why the connection fails (then nothing more is passed)
        self.complete = 0                   # data messages passed to aiohttp whole
        self.received = 0                   # data messages the route has received
        self._head = b""                    # a frame head split across reads (< 14 bytes)
        self._left = 0                      # payload bytes of the current frame still to pass
        self._ends_message = False          # the current frame is a data frame with FIN
        self._scope: asyncio.Timeout | None = None   # the route's receive, while it waits

    @classmethod
    def install(cls, request: web.Request) -> MaskCheck | None:
        """Take the request's connection's bytes first (None: the connection is gone)."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return None
        check = cls(transport, transport.get_protocol())
        transport.set_protocol(check)
        return check

    def remove(self) -> None:
        """Give the connection back to aiohttp's protocol (the upgrade was refused)."""
        self.transport.set_protocol(self.inner)

    # ---- asyncio.Protocol: aiohttp's protocol hears everything but the bytes held back ----

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def data_received(self, data: bytes) -> None:
        if self.reason is not None:
            return
        bad = self._scan(data)
        if bad < 0:
            self.inner.data_received(data)
            return
        if bad:
            self.inner.data_received(data[:bad])
        self._broken(_UNMASKED)

    def _scan(self, data: bytes) -> int:
        """Follow the frames in `data` -> the offset of an unmasked frame's head in it, or -1."""
        pos, end = 0, len(data)
        while pos < end:
            if self._left:
                k = min(self._left, end - pos)
                pos += k
                self._left -= k
                if not self._left and self._ends_message:
                    self.complete += 1
                continue
            held = len(self._head)
            head = self._head + data[pos:pos + 14 - held]
            if len(head) < 2:
                self._head = head
                return -1
            if not head[1] & 0x80:
                return max(pos - held, 0)
            n = head[1] & 0x7F
            size = 6 if n < 126 else 8 if n == 126 else 14       # with the 4-byte mask key
            if len(head) < size:
                self._head = head
                return -1
            self._head = b""
            pos += size - held
            self._left = n if n < 126 else int.from_bytes(head[2:size - 4], "big")
            self._ends_message = bool(head[0] & 0x80) and head[0] & 0x0F < 0x8
            if not self._left and self._ends_message:
                self.complete += 1
        return -1

    def _broken(self, reason: str) -> None:
        self.reason = reason
        if self._scope is not None and self.received >= self.complete:
            # The route waits for a message that can no longer come: wake it.
            self._scope.reschedule(asyncio.get_running_loop().time())

    # ---- the route's side ----

    async def receive(self, ws: web.WebSocketResponse, deadline: float | None) -> WSMessage | None:
        """`ws.receive()` (TimeoutError past `deadline`), or None once the connection has failed
        and every message completed before its bad frame has been received."""
        if self._failed():
            return None
        try:
            async with asyncio.timeout_at(deadline) as scope:
                self._scope = scope
                msg = await ws.receive()
        except TimeoutError:
            if self._failed():
                return None
            raise
        finally:
            self._scope = None
        if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
            self.received += 1
            if self.received > self.complete:
                self.reason = _EARLY
                return None
        return msg

    def _failed(self) -> bool:
        return self.reason is not None and self.received >= self.complete

    async def fail(self, ws: web.WebSocketResponse) -> None:
        """Close with 1002 and drop the connection: no close handshake with a client that broke the protocol."""
        assert self.reason is not None
        # ws.close writes the close frame, then waits for the client's; cut short, it closes the transport.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0):
                await ws.close(code=WSCloseCode.PROTOCOL_ERROR, message=self.reason.encode())
