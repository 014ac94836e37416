"""RFC 6455 framing on a connection taken over from aiohttp, zero-copy both ways.

aiohttp performs the HTTP upgrade (and TLS); then the transport is handed to a
`WsConnection` (`transport.set_protocol`), because aiohttp copies every message
(join, unmask, new `bytes`).  Here the frame header and metadata are read
first, the KV sink supplies the destination and the payload is received
straight into it (`asyncio.BufferedProtocol`); sending writes header and
payload view with one `writelines` and, for caller-owned payloads, waits
until the kernel has taken every byte.

On the wire: unfragmented binary messages, masked client -> server only (so
bulk data should flow server -> client), close frames with a code, pings
answered.  Anything else closes the connection with a close code and a log
line; the process carries on.  Before READY a message has at most
`HANDSHAKE_MAX` bytes and only handshake kinds, checked before anything is
allocated.

States (`ConnState`): HANDSHAKE (frames queued for `next_handshake`), READY
(authenticated; frames held until the link has every stripe), OPEN (frames go
to `on_frame`), CLOSING (a close frame was sent; inbound frames are skipped
except the peer's close, which closes TCP at once; a silent peer is aborted
after `CLOSE_GRACE_S`), CLOSED (`on_lost` called once with the reason).
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections import deque
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import structlog

from pddgw.net import frames
from pddgw import messages as m
from pddgw.net.errors import AuthError, CloseCode, FrameError, FrameTooLarge, LinkClosed, LinkTimeout
from pddgw.net.link import KvSink
from pddgw.net.mux import sink_buffer
from pddgw.net.mask import masked_copy, unmask_inplace

log = structlog.get_logger("pddgw.net")

OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_SCRATCH_BYTES = 256 << 10
HANDSHAKE_MAX = 4096          # largest message accepted before authentication
_DIRECT_MIN = 16 << 10        # payload reads at least this large go straight to the destination
_COPY_BELOW = 16 << 10        # smaller payloads are joined with their header into one write
CLOSE_GRACE_S = 2.0
_SOFT_LIMIT = 1 << 20         # bytes a transport may buffer before senders wait
_MAX_EARLY = 4096             # frames held between authentication and link attach
_UNBOUNDED = 1 << 40          # parse_head's size limits off (the caller bounds the frame otherwise)

_PACK_LEN2 = struct.Struct("!BBH").pack
_PACK_LEN8 = struct.Struct("!BBQ").pack
_PACK_CLOSE = struct.Struct("!H").pack

# Reader states
_WS_HEAD, _FRAME_HEAD, _META, _PAYLOAD, _CONTROL, _DISCARD, _SKIP = range(7)


class ConnState(IntEnum):
    HANDSHAKE = 0
    READY = 1
    OPEN = 2
    CLOSING = 3
    CLOSED = 4


def ws_header(n: int, masked: bool, opcode: int = OP_BINARY) -> bytes:
    """FIN + opcode + length (the 4-byte mask key, if any, follows separately)."""
    b0 = 0x80 | opcode
    mbit = 0x80 if masked else 0
    if n < 126:
        return bytes((b0, mbit | n))
    if n < 1 << 16:
        return _PACK_LEN2(b0, mbit | 126, n)
    return _PACK_LEN8(b0, mbit | 127, n)


def ws_header_size(n: int, masked: bool) -> int:
    return (2 if n < 126 else 4 if n < 1 << 16 else 10) + (4 if masked else 0)


FrameCallback = Callable[["WsConnection", frames.FrameHead, m.Message, int, int], None]


class WsConnection(asyncio.BufferedProtocol):
    """One WebSocket connection carrying pddgw frames (after aiohttp's upgrade)."""

    def __init__(self, transport: asyncio.Transport, prev_protocol: Any, *, client: bool,
                 max_frame: int, max_control: int, peer: str) -> None:
        self.transport = transport
        self.client = client
        self.peer = peer
        self.state = ConnState.HANDSHAKE
        self.on_frame: FrameCallback | None = None
        self.on_lost: Callable[[WsConnection, LinkClosed], None] | None = None
        self.kv_sink: KvSink | None = None
        self._prev = prev_protocol
        self._max_frame = max_frame
        self._max_control = max_control
        self._loop = asyncio.get_running_loop()
        self.closed: asyncio.Future[LinkClosed] = self._loop.create_future()
        # Loop time of the last read that brought bytes: the link's liveness counts bytes, not
        # whole frames (a large frame crawling over a saturated WAN is a live peer).
        self.rx_at = self._loop.time()
        self._tls = transport.get_extra_info("ssl_object") is not None
        # reader
        self._scratch = memoryview(bytearray(HANDSHAKE_MAX))   # the full size once authenticated
        self._rstate = _WS_HEAD
        self._acc = bytearray()
        self._need = 2
        self._opcode = 0
        self._mask: bytes | None = None
        self._ws_len = 0
        self._ws_hdr_len = 0
        self._head: frames.FrameHead | None = None
        self._meta: dict = {}
        self._span: m.KVSpan | None = None
        self._dest: memoryview = memoryview(b"")
        self._owned = 0
        self._filled = 0
        self._direct = False
        self._skip = 0                 # bytes of a frame still to skip (_SKIP, while CLOSING)
        self._hs_frames: deque[m.Message] = deque()
        self._early: deque[tuple[frames.FrameHead, m.Message, int, int]] = deque()
        self._hs_waiter: asyncio.Future[None] | None = None
        # writer
        self._drain_waiters: list[asyncio.Future[None]] = []
        self._close_sent: tuple[int, str] | None = None
        self._close_received: tuple[int, str] | None = None
        self._grace: asyncio.TimerHandle | None = None

    # -- takeover --------------------------------------------------------------

    def attach(self) -> None:
        """Become the transport's protocol (call when no bytes for the old one can be in flight)."""
        t = self.transport
        t.set_protocol(self)
        if not self._tls:
            # Pause at any buffered byte and resume at zero: `drain(0)` then means
            # "the kernel holds every byte", so zero-copy payloads are safe to reuse.
            t.set_write_buffer_limits(high=0, low=0)
        # uvloop picks its read callbacks when reading starts: restart it so
        # they match the new (buffered) protocol.
        t.pause_reading()
        t.resume_reading()

    # -- reading ---------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._rstate == _PAYLOAD:
            left = len(self._dest) - self._filled
            if left >= _DIRECT_MIN:
                self._direct = True
                return self._dest[self._filled:]
        self._direct = False
        if len(self._scratch) < _SCRATCH_BYTES and ConnState.READY <= self.state <= ConnState.OPEN:
            self._scratch = memoryview(bytearray(_SCRATCH_BYTES))
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        self.rx_at = self._loop.time()
        try:
            if self._direct:
                self._filled += nbytes
                if self._filled == len(self._dest):
                    self._payload_done()
                return
            self._feed(self._scratch[:nbytes])
        except Exception as e:  # a bug of ours or of a callback: lose this connection, not the process
            log.error("link connection failed while reading", peer=self.peer, error=repr(e))
            self.close(CloseCode.INTERNAL_ERROR, "internal error")

    def _feed(self, data: memoryview) -> None:
        pos, end = 0, len(data)
        while pos < end:
            st = self._rstate
            if st == _DISCARD:
                return
            if st == _SKIP:
                k = min(self._skip, end - pos)
                self._skip -= k
                pos += k
                if not self._skip:
                    self._reset()
                continue
            if st == _PAYLOAD:
                k = min(len(self._dest) - self._filled, end - pos)
                self._dest[self._filled:self._filled + k] = data[pos:pos + k]
                self._filled += k
                pos += k
                if self._filled == len(self._dest):
                    self._payload_done()
                continue
            k = min(self._need - len(self._acc), end - pos)
            self._acc += data[pos:pos + k]
            pos += k
            if len(self._acc) == self._need:
                self._step()

    def _reset(self) -> None:
        self._rstate = _WS_HEAD
        self._acc.clear()
        self._need = 2
        self._dest = memoryview(b"")
        self._span = None

    def _step(self) -> None:
        """The accumulator holds `_need` bytes of the current state: parse them."""
        st = self._rstate
        if st == _WS_HEAD:
            self._ws_head()
        elif st == _FRAME_HEAD:
            self._unmask_acc(0)
            hs = self.state == ConnState.HANDSHAKE
            # Before authentication the WebSocket length (<= HANDSHAKE_MAX) already bounds the
            # frame, so the kind is judged first and a larger size claim is a mismatch with it.
            max_frame, max_control = (_UNBOUNDED, _UNBOUNDED) if hs else (self._max_frame, self._max_control)
            try:
                head = frames.parse_head(self._acc, max_frame=max_frame, max_control=max_control)
            except FrameTooLarge as e:
                return self._violation(CloseCode.TOO_BIG, str(e))
            except FrameError as e:
                return self._violation(CloseCode.BAD_FRAME, str(e))
            if hs and head.kind not in m.HANDSHAKE_KINDS:
                return self._violation(CloseCode.PROTOCOL_ERROR, f"{m.KINDS[head.kind].__name__} frame "
                                                                 f"before authentication")
            if head.size != self._ws_len:
                return self._violation(CloseCode.BAD_FRAME, f"frame header says {head.size} bytes, "
                                                            f"WebSocket message has {self._ws_len}")
            self._head = head
            self._rstate, self._need = _META, frames.HEADER_SIZE + head.meta_len
            if head.meta_len == 0:
                self._step()
        elif st == _META:
            assert self._head is not None
            head = self._head
            self._unmask_acc(frames.HEADER_SIZE)
            try:
                self._meta = frames.parse_meta(head, bytes(self._acc[frames.HEADER_SIZE:]))
                if head.kind == m.KV_KIND:
                    self._span = frames.kv_span(self._meta)
                    if head.payload_len != self._span.payload_nbytes:
                        raise FrameError(f"KVChunk header carries {head.payload_len} payload bytes, "
                                         f"its span needs {self._span.payload_nbytes}")
            except FrameError as e:
                return self._violation(CloseCode.BAD_FRAME, str(e))
            if self._span is not None:
                self._dest, self._owned = sink_buffer(self.kv_sink, self._span, self.peer)
            else:
                self._dest, self._owned = memoryview(bytearray(head.payload_len)), 0
            self._filled = 0
            self._rstate = _PAYLOAD
            if head.payload_len == 0:
                self._payload_done()
        elif st == _CONTROL:
            self._control()

    def _unmask_acc(self, start: int) -> None:
        if self._mask is not None:
            unmask_inplace(memoryview(self._acc)[start:], self._mask, start)

    def _ws_head(self) -> None:
        acc = self._acc
        b0, b1 = acc[0], acc[1]
        masked = bool(b1 & 0x80)
        ln = b1 & 0x7F
        want = 2 + (2 if ln == 126 else 8 if ln == 127 else 0) + (4 if masked else 0)
        if len(acc) < want:
            self._need = want
            return
        fin, rsv, opcode = b0 & 0x80, b0 & 0x70, b0 & 0x0F
        if rsv:
            return self._violation(CloseCode.PROTOCOL_ERROR, "reserved bits set (compression is not used)")
        if opcode == OP_TEXT:
            return self._violation(CloseCode.UNSUPPORTED_DATA, "text frames are not accepted")
        if opcode not in (OP_BINARY, OP_CLOSE, OP_PING, OP_PONG):
            return self._violation(CloseCode.PROTOCOL_ERROR, f"opcode {opcode} (fragmented or unknown)")
        if not fin:
            return self._violation(CloseCode.PROTOCOL_ERROR, "fragmented messages are not accepted")
        if masked == self.client:
            return self._violation(CloseCode.PROTOCOL_ERROR,
                                   "masked frame from the server" if self.client else "unmasked frame from a client")
        if ln == 126:
            ln = struct.unpack_from("!H", acc, 2)[0]
        elif ln == 127:
            ln = struct.unpack_from("!Q", acc, 2)[0]
        self._mask = bytes(acc[want - 4:want]) if masked else None
        self._ws_len = ln
        self._ws_hdr_len = want
        self._acc.clear()
        if self.state == ConnState.CLOSING and not (opcode == OP_CLOSE and ln <= 125):
            return self._skip_rest(ln)      # after our close frame only the peer's matters
        if opcode != OP_BINARY:
            if ln > 125:
                return self._violation(CloseCode.PROTOCOL_ERROR, "control frame longer than 125 bytes")
            self._opcode = opcode
            self._rstate, self._need = _CONTROL, ln
            if ln == 0:
                self._control()
            return
        if self.state == ConnState.HANDSHAKE and ln > HANDSHAKE_MAX:
            return self._violation(CloseCode.TOO_BIG, f"frame of {ln} bytes before authentication "
                                                      f"(limit {HANDSHAKE_MAX})")
        if ln > self._max_frame:
            return self._violation(CloseCode.TOO_BIG, f"frame of {ln} bytes exceeds the limit of {self._max_frame}")
        if ln < frames.HEADER_SIZE:
            return self._violation(CloseCode.BAD_FRAME, f"message of {ln} bytes is shorter than a frame header")
        self._rstate, self._need = _FRAME_HEAD, frames.HEADER_SIZE

    def _control(self) -> None:
        self._unmask_acc(0)
        payload = bytes(self._acc)
        op = self._opcode
        self._reset()
        if op == OP_PING:
            if self._close_sent is None:    # nothing may follow our close frame
                self._write_control(OP_PONG, payload)
        elif op == OP_CLOSE:
            code, reason = int(CloseCode.NORMAL), ""
            if len(payload) >= 2:
                code = struct.unpack_from("!H", payload)[0]
                reason = payload[2:].decode("utf-8", "replace")
            self._close_received = (code, reason)
            if self._close_sent is None:
                self._send_close(code if 1000 <= code < 5000 and code != CloseCode.ABNORMAL else CloseCode.NORMAL,
                                 "")
            self.state = ConnState.CLOSING
            self._rstate = _DISCARD
            self.transport.close()

    def _payload_done(self) -> None:
        head = self._head
        assert head is not None
        dest, owned = self._dest, self._owned
        if self._mask is not None and len(dest):
            unmask_inplace(dest, self._mask, frames.HEADER_SIZE + head.meta_len)
        try:
            msg = frames.build(head, self._meta, dest, self._span)
        except FrameError as e:
            return self._violation(CloseCode.BAD_FRAME, str(e))
        wire = self._ws_hdr_len + self._ws_len
        self._reset()
        if self.state == ConnState.OPEN and self.on_frame is not None:
            self.on_frame(self, head, msg, wire, owned)
        elif self.state == ConnState.READY:
            if len(self._early) >= _MAX_EARLY:
                return self._violation(CloseCode.PROTOCOL_ERROR, "too many frames before the link opened")
            self._early.append((head, msg, wire, owned))
        elif self.state == ConnState.HANDSHAKE:
            if len(self._hs_frames) > 4:
                return self._violation(CloseCode.PROTOCOL_ERROR, "frames before authentication")
            self._hs_frames.append(msg)
            if self.client and isinstance(msg, m.Welcome):
                self.state = ConnState.READY     # the server's link frames may follow in this same read
            if self._hs_waiter is not None and not self._hs_waiter.done():
                self._hs_waiter.set_result(None)

    def _violation(self, code: int, reason: str) -> None:
        """The peer broke the protocol: log, close with `code`, drop what follows."""
        log.warning("closing link connection: peer protocol violation", peer=self.peer, code=int(code),
                    reason=reason)
        self.close(code, reason)
        self._rstate = _DISCARD       # its byte stream is not to be trusted for a close frame

    def _skip_rest(self, n: int) -> None:
        """Skip the next `n` bytes (the rest of a frame nobody reads any more)."""
        self._acc.clear()
        self._dest = memoryview(b"")
        self._span = None
        if n:
            self._rstate, self._skip = _SKIP, n
        else:
            self._reset()

    # -- handshake -------------------------------------------------------------

    def open(self, on_frame: FrameCallback) -> None:
        """Hand frames to `on_frame` from now on, starting with those held since READY."""
        self.on_frame = on_frame
        if self.state != ConnState.READY:
            return
        self.state = ConnState.OPEN
        while self._early and self.state == ConnState.OPEN:
            head, msg, wire, owned = self._early.popleft()
            on_frame(self, head, msg, wire, owned)

    def send_message(self, msg: m.Message) -> None:
        """Write one small frame now (handshake messages)."""
        head, payload = frames.encode(msg)
        self.write(self.frame_buffers(head, payload, copy=True)[0])

    async def next_handshake(self, timeout: float) -> m.Message:
        """The next frame during the handshake; AuthError if the peer closes with AUTH_FAILED."""
        if not self._hs_frames:
            self._hs_waiter = self._loop.create_future()
            waits: list[asyncio.Future[Any]] = [self._hs_waiter, self.closed]
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            except TimeoutError:
                raise LinkTimeout(f"handshake with {self.peer}: nothing within {timeout}s") from None
            finally:
                self._hs_waiter = None
        if self._hs_frames:
            return self._hs_frames.popleft()
        err = self.closed.result()
        if err.code in (CloseCode.AUTH_FAILED, CloseCode.AUTH_TIMEOUT):
            raise AuthError(f"{self.peer} rejected the connection: {err.reason}")
        raise err

    # -- writing ---------------------------------------------------------------

    def frame_buffers(self, head: bytes, payload: memoryview, copy: bool) -> tuple[list, int]:
        """WebSocket message for one pddgw frame -> (buffers for writelines, wire bytes).

        Server side, the payload view is used as is unless `copy`; client side it
        is masked into a new buffer anyway.
        """
        n = len(head) + payload.nbytes
        if self.client:
            key = os.urandom(4)
            first = ws_header(n, True) + key + masked_copy(memoryview(head), key, 0)
            bufs = [first, masked_copy(payload, key, len(head))] if payload.nbytes else [first]
            return bufs, len(first) + payload.nbytes
        hdr = ws_header(n, False)
        if not payload.nbytes:
            return [hdr + head], len(hdr) + n
        if payload.nbytes < _COPY_BELOW or copy:
            return [b"".join((hdr, head, payload))], len(hdr) + n
        return [hdr + head, payload], len(hdr) + n

    def write(self, bufs: list) -> None:
        if self.state >= ConnState.CLOSING or self.transport.is_closing():
            raise self._lost_error()
        if len(bufs) == 1:
            self.transport.write(bufs[0])
        else:
            self.transport.writelines(bufs)

    async def drain(self, empty: bool) -> None:
        """Wait for the transport: until its buffer is empty (`empty`: a zero-copy
        payload is in the kernel and may be reused) or below a soft limit."""
        t = self.transport
        # TLS copies (encrypts) at write time, so only back-pressure matters there.
        limit = 0 if empty and not self._tls else _SOFT_LIMIT
        while t.get_write_buffer_size() > limit:
            if self.state == ConnState.CLOSED or t.is_closing():
                raise self._lost_error()
            fut = self._loop.create_future()
            self._drain_waiters.append(fut)
            # TLS transports do not call back at every level: poll as a fallback.
            await asyncio.wait([fut], timeout=0.002 if self._tls else 1.0)

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        self._wake_drainers()

    def _wake_drainers(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    def _write_control(self, opcode: int, payload: bytes) -> None:
        if self.transport.is_closing():
            return
        if self.client:
            key = os.urandom(4)
            self.transport.write(ws_header(len(payload), True, opcode) + key
                                 + masked_copy(memoryview(payload), key, 0))
        else:
            self.transport.write(ws_header(len(payload), False, opcode) + payload)

    def _send_close(self, code: int, reason: str) -> None:
        self._close_sent = (int(code), reason)
        self._write_control(OP_CLOSE, _PACK_CLOSE(int(code)) + reason.encode()[:120])

    # -- closing ---------------------------------------------------------------

    def close(self, code: int = CloseCode.NORMAL, reason: str = "") -> None:
        """Send a close frame (none for ABNORMAL: abort), then let the peer hang up."""
        if self.state >= ConnState.CLOSING:
            return
        self.state = ConnState.CLOSING
        # Read on, skipping, for the peer's close frame: it may be on its way already (both
        # sides closing at once), and waiting for the peer to hang up first would then stall
        # both until CLOSE_GRACE_S.  The frame being read is skipped to its end.
        st = self._rstate
        if st in (_FRAME_HEAD, _META):
            self._skip_rest(self._ws_len - len(self._acc))
        elif st == _PAYLOAD:
            self._skip_rest(len(self._dest) - self._filled)
        if code == CloseCode.ABNORMAL:
            self._rstate = _DISCARD
            self._close_sent = (int(code), reason)
            self.transport.abort()
            return
        self._send_close(code, reason)
        # Keep reading (and discarding) so the peer's unread data cannot turn our
        # close into a reset that would lose the close frame.
        self._grace = self._loop.call_later(CLOSE_GRACE_S, self.transport.abort)

    def abort(self) -> None:
        self.state = ConnState.CLOSING
        self._rstate = _DISCARD
        self.transport.abort()

    def eof_received(self) -> bool:
        return False  # close our side too

    def _lost_error(self) -> LinkClosed:
        if self._close_received is not None:
            code, reason = self._close_received
            return LinkClosed(f"{self.peer} closed the connection: {reason or 'no reason'}", code)
        if self._close_sent is not None:
            code, reason = self._close_sent
            return LinkClosed(f"connection to {self.peer} closed: {reason or 'no reason'}", code)
        return LinkClosed(f"connection to {self.peer} lost", CloseCode.ABNORMAL)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.state = ConnState.CLOSED
        self._rstate = _DISCARD
        if self._grace is not None:
            self._grace.cancel()
        err = self._lost_error()
        if exc is not None and err.code == CloseCode.ABNORMAL:
            err = LinkClosed(f"connection to {self.peer} lost: {exc!r}", CloseCode.ABNORMAL)
        if not self.closed.done():
            self.closed.set_result(err)
        self._wake_drainers()
        if self._hs_waiter is not None and not self._hs_waiter.done():
            self._hs_waiter.set_result(None)
        try:
            # Let aiohttp finish its bookkeeping of the connection it handed over.
            self._prev.connection_lost(exc)
        except Exception as e:
            log.debug("aiohttp protocol cleanup failed", error=repr(e))
        if self.on_lost is not None:
            self.on_lost(self, err)
