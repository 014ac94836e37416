"""A WebSocket client that sends frames exactly as given, broken ones included.

Client libraries mask every frame and refuse reserved bits, unknown opcodes
and lengths they would not send; the front-door tests need exactly those, so
frames are built here from RFC 6455 section 5.2.
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct

import orjson

TEXT, BINARY, CLOSE, PING = 0x1, 0x2, 0x8, 0x9


def frame(opcode: int, payload: bytes = b"", *, mask: bool = True, fin: bool = True, rsv: int = 0,
          length: int | None = None) -> bytes:
    """One client frame; `length` declares a payload length other than len(payload)."""
    n = len(payload) if length is None else length
    m = 0x80 if mask else 0
    head = bytes([(0x80 if fin else 0) | rsv << 4 | opcode])
    if n < 126:
        head += bytes([m | n])
    elif n < 1 << 16:
        head += struct.pack("!BH", m | 126, n)
    else:
        head += struct.pack("!BQ", m | 127, n)
    if not mask:
        return head + payload
    key = os.urandom(4)
    keystream = (key * (len(payload) // 4 + 1))[: len(payload)]
    masked = (int.from_bytes(payload, "big") ^ int.from_bytes(keystream, "big")).to_bytes(len(payload), "big")
    return head + key + masked


class RawWs:
    """An upgraded connection to /v1/responses: write raw bytes, read the server's frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer
        self.events: list[dict] = []        # the server's text frames, decoded, in order

    @classmethod
    async def connect(cls, host: str, port: int, path: str = "/v1/responses", early: bytes = b"") -> RawWs:
        """`early`: bytes sent right behind the upgrade request, before the 101 (RFC 6455 4.1 forbids it)."""
        reader, writer = await asyncio.open_connection(host, port)
        key = base64.b64encode(os.urandom(16)).decode()
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                     f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
                     .encode() + early)
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 "), head
        return cls(reader, writer)

    async def send(self, *frames: bytes) -> None:
        for f in frames:
            self.writer.write(f)
        await self.writer.drain()

    async def _frame(self) -> tuple[int, bytes]:
        b0, b1 = await self.reader.readexactly(2)
        assert not b1 & 0x80, "server frames are never masked"
        n = b1 & 0x7F
        if n == 126:
            (n,) = struct.unpack("!H", await self.reader.readexactly(2))
        elif n == 127:
            (n,) = struct.unpack("!Q", await self.reader.readexactly(8))
        return b0 & 0x0F, await self.reader.readexactly(n)

    async def close_code(self, timeout: float = 30.0) -> int:
        """Read up to the server's close frame (text frames go to `events`) -> its status code."""
        async with asyncio.timeout(timeout):
            while True:
                op, payload = await self._frame()
                if op == CLOSE:
                    return struct.unpack("!H", payload[:2])[0]
                assert op == TEXT, (op, payload)
                self.events.append(orjson.loads(payload))

    async def at_eof(self, timeout: float = 30.0) -> bool:
        """Whether the server then closes the TCP connection (nothing more arrives)."""
        async with asyncio.timeout(timeout):
            return await self.reader.read() == b""

    def abort(self) -> None:
        self.writer.transport.abort()
