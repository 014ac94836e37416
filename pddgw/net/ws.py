"""WebSocket links: `WsServer` (aiohttp server) and `connect` (aiohttp client).

One link = `stripes` parallel WebSocket connections, each upgraded by aiohttp,
authenticated (`auth.py`) and carried by `wsproto.WsConnection`.  Bulk
(`send_all`) is striped and the receiver restores the per-link sequence order,
so striping is invisible to the link's user.  Frames held for reordering count
against `inbound_buffer_bytes`; over it, connections ahead of the missing frame
stop reading (each connection is in order, so an honest sender cannot
deadlock).  Control frames go on the first connection, and with several
connections background KV never does (a frame in a socket cannot be
preempted).  Liveness counts every read of any connection.

The dialing side owns reconnection (fail what was in flight, redial with
back-off up to `reconnect_max_s`); the accepting side sees each reconnection
as a new link (`on_link`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import aiohttp
import structlog
from aiohttp import WSMsgType, web

from pddgw.config import ConfigError, NetConfig, ShapingConfig
from pddgw.net import auth, frames
from pddgw import messages as m
from pddgw.net.errors import AuthError, CloseCode, FrameError, FrameTooLarge, LinkClosed, LinkError, LinkTimeout
from pddgw.net.link import Handler, KvSink, LinkState, Priority, PriorityLike
from pddgw.net.mux import LinkBase, ServiceMeter
from pddgw.net.shaping import ShapedPipe
from pddgw.net.tls import client_context, server_context
from pddgw.net.wsproto import HANDSHAKE_MAX, ConnState, WsConnection, ws_header_size

log = structlog.get_logger("pddgw.net")

LINK_PATH = "/pddgw/link"
_WS_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_SEQ_MASK = 0xFFFF_FFFF
_MAX_REORDER = 1 << 16


def _secret(cfg: NetConfig) -> str:
    secret = cfg.load_secret()
    if not secret:
        raise ConfigError("net.secret: WebSocket links need a shared secret (net.secret or net.secret_file)")
    return secret


def _check_size(msg: m.Message, size: int, cfg: NetConfig) -> None:
    limit = cfg.max_frame_bytes if isinstance(msg, m.KVChunk) else cfg.max_control_bytes
    if size > limit:
        raise FrameTooLarge(f"{type(msg).__name__} frame of {size} bytes exceeds the limit of {limit}")


class WsLink(LinkBase):
    """A link over `stripes` WebSocket connections (see module docstring)."""

    def __init__(self, local: str, peer: str, cfg: NetConfig, shaping: ShapingConfig | None) -> None:
        super().__init__(local, peer, cfg)
        self._shaping = shaping if shaping is not None and shaping.enabled else None
        self._conns: list[WsConnection] = []
        self._pipe: ShapedPipe | None = None
        self._tx_seq = 0
        self._rx_seq = 0
        # seq -> (head, message, owned bytes, connection it came on, wire bytes)
        self._reorder: dict[int, tuple[frames.FrameHead, m.Message, int, WsConnection, int]] = {}
        self._held_bytes = 0                          # wire bytes of the frames in _reorder
        self._held_by: dict[WsConnection, int] = {}   # frames in _reorder per connection
        self._ahead_paused: set[WsConnection] = set()
        self._rr = 0
        self.on_closed: Callable[[WsLink], None] | None = None

    @property
    def stripes(self) -> int:
        return len(self._conns)

    # -- epochs ----------------------------------------------------------------

    def _attach(self, conns: list[WsConnection]) -> None:
        """Start a connection epoch on `conns` (authenticated, READY)."""
        self._conns = conns
        self._tx_seq = self._rx_seq = 0
        self._reorder.clear()
        self._held_bytes = 0
        self._held_by.clear()
        self._ahead_paused.clear()
        if self._shaping is not None:
            self._pipe = ShapedPipe(self._shaping, self._deliver)
        for c in conns:
            c.kv_sink = self._sink_for_conn
            c.on_lost = self._on_conn_lost
        self._set_open()
        for c in conns:
            c.open(self._on_conn_frame)

    def _sink_for_conn(self, span: m.KVSpan) -> memoryview | None:
        return self._kv_sink(span) if self._kv_sink is not None else None

    def _detach(self, code: int, reason: str) -> list[WsConnection]:
        conns, self._conns = self._conns, []
        if self._pipe is not None:
            self._pipe.close()
            self._pipe = None
        for c in conns:
            c.on_lost = None
            c.on_frame = None
            c.close(code, reason)
        return conns

    def _on_conn_lost(self, conn: WsConnection, err: LinkClosed) -> None:
        if conn in self._conns:
            self._lost(err)

    async def _shutdown_transport(self, code: int, reason: str) -> None:
        conns = self._detach(code, reason)
        if conns:
            await asyncio.wait([c.closed for c in conns])
        if self.on_closed is not None:
            self.on_closed(self)

    # -- outbound --------------------------------------------------------------

    def _pick(self, msg: m.Message, stripe: int | None = None,
              priority: Priority = Priority.FOREGROUND) -> WsConnection:
        conns = self._conns
        if not conns:
            raise self._closed_error() if self._state == LinkState.CLOSED else LinkClosed(
                f"link to {self.peer} is reconnecting", CloseCode.ABNORMAL)
        if priority == Priority.BACKGROUND and len(conns) > 1 and isinstance(msg, m.KVChunk):
            # Never on the first connection, which carries every control frame: a frame in a
            # socket cannot be preempted, and tokens or heartbeats must not wait behind it.
            bulk = conns[1:]
            return bulk[stripe % len(bulk)] if stripe is not None else min(
                bulk, key=lambda c: c.transport.get_write_buffer_size())
        if stripe is not None:
            return conns[stripe % len(conns)]
        if len(conns) == 1 or not isinstance(msg, m.KVChunk):
            return conns[0]
        self._rr = (self._rr + 1) % len(conns)
        best = conns[self._rr]
        for c in conns:
            if c.transport.get_write_buffer_size() < best.transport.get_write_buffer_size():
                best = c
        return best

    def _frame(self, conn: WsConnection, msg: m.Message, corr: int, flags: int) -> tuple[list, int, bool]:
        """Encode with the next sequence number -> (buffers, wire bytes, zero-copy payload).

        A shaped frame is numbered as it leaves the emulated wire, so a foreground frame
        that overtook background ones there is not held back by the receiver's reordering."""
        head, payload = frames.encode(msg, corr=corr, seq=self._tx_seq, flags=flags)
        _check_size(msg, len(head) + payload.nbytes, self.cfg)
        # No copy: a shaped frame's payload is already a snapshot the pipe owns (`_shaped_item`).
        bufs, wire = conn.frame_buffers(head, payload, copy=False)
        self._tx_seq = (self._tx_seq + 1) & _SEQ_MASK      # only once the frame exists: no gaps
        self.stats.frames_sent += 1
        self.stats.bytes_sent += wire
        if isinstance(msg, m.KVChunk):
            self.stats.kv_bytes_sent += msg.span.nbytes
            if msg.span.virtual:
                wire += msg.span.nbytes      # shaping charges the KV it stands for
        return bufs, wire, len(bufs) > 1 and not conn.client

    def _shaped(self) -> bool:
        return self._shaping is not None

    def _shaped_item(self, conn: WsConnection, msg: m.Message, corr: int, flags: int) -> tuple[tuple, int]:
        """-> (pipe item, wire bytes): the frame is encoded, numbered, when it leaves the pipe."""
        head, payload = frames.encode(msg, corr=corr, flags=flags)
        n = len(head) + payload.nbytes
        _check_size(msg, n, self.cfg)
        wire = ws_header_size(n, masked=conn.client) + n
        if isinstance(msg, m.KVChunk):
            if msg.span.virtual:
                wire += msg.span.nbytes      # shaping charges the KV it stands for
            elif payload.nbytes:
                # Delivery is deferred: snapshot the payload so the caller may reuse it.
                msg = m.KVChunk(msg.span, payload.tobytes(), msg.seq, msg.last)
        return (conn, msg, corr, flags), wire

    async def _transmit(self, msg: m.Message, corr: int, flags: int, priority: Priority = Priority.FOREGROUND,
                        stripe: int | None = None) -> float | None:
        conn = self._pick(msg, stripe, priority)
        if self._pipe is not None:
            item, wire = self._shaped_item(conn, msg, corr, flags)
            return await self._pipe.put(item, wire, priority, control=not isinstance(msg, m.KVChunk))
        bufs, wire, zero_copy = self._frame(conn, msg, corr, flags)
        conn.write(bufs)
        await conn.drain(empty=zero_copy)
        return None

    def _transmit_nowait(self, msg: m.Message, corr: int = 0, flags: int = 0) -> None:
        if self._state != LinkState.OPEN or not self._conns or self._conns[0].state != ConnState.OPEN:
            return
        conn = self._conns[0]
        if self._pipe is not None:
            self._pipe.put_nowait(*self._shaped_item(conn, msg, corr, flags))
            return
        bufs, wire, _ = self._frame(conn, msg, corr, flags)
        try:
            conn.write(bufs)
        except LinkClosed:
            pass

    async def _deliver(self, item: tuple[WsConnection, m.Message, int, int]) -> None:
        conn, msg, corr, flags = item
        if conn.state == ConnState.OPEN:
            bufs, _, _ = self._frame(conn, msg, corr, flags)
            conn.write(bufs)
            await conn.drain(empty=False)

    async def send_all(self, msgs: Iterable[m.Message], *, timeout: float | None = None,
                       priority: PriorityLike = Priority.FOREGROUND) -> float:
        """Stripes the messages over the link's connections (one writer per connection)."""
        if len(self._conns) <= 1 or self._pipe is not None:
            return await super().send_all(msgs, timeout=timeout, priority=priority)
        t = self.cfg.send_timeout_s if timeout is None else timeout
        it = iter(msgs)
        meter = ServiceMeter(self._loop)

        async def writer(i: int) -> None:
            for msg in it:   # one shared iterator: each message is taken by exactly one writer
                await self._timed(self._send_frame(msg, 0, 0, priority, meter, stripe=i), t, "a send_all frame")

        try:
            async with asyncio.TaskGroup() as tg:
                for i in range(len(self._conns)):
                    tg.create_task(writer(i))
        except* LinkError as eg:
            raise eg.exceptions[0] from None
        return meter.seconds

    # -- inbound ---------------------------------------------------------------

    def _on_conn_frame(self, conn: WsConnection, head: frames.FrameHead, msg: m.Message, wire: int,
                       owned: int) -> None:
        if conn not in self._conns:
            return
        self.stats.frames_received += 1
        self.stats.bytes_received += wire
        if isinstance(msg, m.KVChunk):
            self.stats.kv_bytes_received += msg.span.nbytes
        if head.seq != self._rx_seq:
            ahead = (head.seq - self._rx_seq) & _SEQ_MASK
            if ahead > _SEQ_MASK // 2 or head.seq in self._reorder or len(self._reorder) >= _MAX_REORDER:
                conn._violation(CloseCode.PROTOCOL_ERROR, f"frame sequence {head.seq} unexpected "
                                                          f"(next is {self._rx_seq})")
                return
            self._reorder[head.seq] = (head, msg, owned, conn, wire)
            self._held_bytes += wire
            self._held_by[conn] = self._held_by.get(conn, 0) + 1
            if (self._inbound_bytes + self._held_bytes > self.cfg.inbound_buffer_bytes
                    and conn not in self._ahead_paused):
                self._ahead_paused.add(conn)
                conn.transport.pause_reading()
            return
        self._rx_seq = (self._rx_seq + 1) & _SEQ_MASK
        self._on_message(msg, head.corr, head.is_reply, owned)
        while self._reorder and self._state == LinkState.OPEN:
            item = self._reorder.pop(self._rx_seq, None)
            if item is None:
                break
            self._rx_seq = (self._rx_seq + 1) & _SEQ_MASK
            h, mm, ow, c, w = item
            self._held_bytes -= w
            self._held_by[c] -= 1
            if not self._held_by[c]:
                del self._held_by[c]
                # Nothing of it is ahead any more: the next missing frame may be on it.
                if c in self._ahead_paused:
                    self._ahead_paused.discard(c)
                    if self._reading and c.state == ConnState.OPEN:
                        c.transport.resume_reading()
            self._on_message(mm, h.corr, h.is_reply, ow)

    def _heard_since(self, since: float) -> bool:
        # Any read on any stripe: a frame still arriving, or one held for reordering, is the peer alive.
        return self._last_rx > since or any(c.rx_at > since for c in self._conns)

    def _set_reading(self, on: bool) -> None:
        for c in self._conns:
            if c.state != ConnState.OPEN:
                continue
            if on:
                if c not in self._ahead_paused:
                    c.transport.resume_reading()
            else:
                c.transport.pause_reading()


# ---------------------------------------------------------------------------
# Dialing side


class WsClientLink(WsLink):
    """The dialing side: owns its connections and reconnects them."""

    def __init__(self, url: str, local: str, cfg: NetConfig, shaping: str, stripes: int) -> None:
        super().__init__(local, "?", cfg, cfg.shaping(shaping) if shaping else None)
        self.url = url
        self._shaping_name = shaping
        self._nstripes = stripes
        self._secret = _secret(cfg)
        tls = cfg.tls
        self._ssl = client_context(tls)
        self._server_name = tls.server_name or None
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=cfg.connect_timeout_s, sock_read=None))
        self._responses: list[aiohttp.ClientResponse] = []

    async def _dial_stripe(self, i: int, link_id: str) -> tuple[WsConnection, aiohttp.ClientResponse, str]:
        key = base64.b64encode(os.urandom(16)).decode()
        headers = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                   "Sec-WebSocket-Key": key}
        kwargs: dict = {"ssl": self._ssl} if self._ssl is not None else {}
        if self._server_name:
            kwargs["server_hostname"] = self._server_name
        try:
            resp = await self._session.request("GET", self.url, headers=headers, read_until_eof=False, **kwargs)
        except aiohttp.ClientSSLError as e:
            raise AuthError(f"TLS with {self.url} failed: {e}") from None
        except (aiohttp.ClientError, OSError) as e:
            raise LinkClosed(f"cannot connect to {self.url}: {e}", CloseCode.ABNORMAL) from None
        conn: WsConnection | None = None
        try:
            accept = base64.b64encode(hashlib.sha1(key.encode() + _WS_GUID).digest()).decode()
            if (resp.status != 101 or resp.headers.get("Upgrade", "").lower() != "websocket"
                    or resp.headers.get("Sec-WebSocket-Accept") != accept or resp.connection is None
                    or resp.connection.transport is None):
                raise LinkClosed(f"{self.url} is not a pddgw link endpoint (HTTP {resp.status})",
                                 CloseCode.PROTOCOL_ERROR)
            transport = resp.connection.transport
            conn = WsConnection(transport, resp.connection.protocol, client=True, max_frame=self.cfg.max_frame_bytes,
                                max_control=self.cfg.max_control_bytes, peer=self.url)
            conn.attach()
            hello = m.Hello(self.local, link_id, i, self._nstripes, auth.new_nonce(), self._shaping_name)
            conn.send_message(hello)
            ch = await conn.next_handshake(self.cfg.auth_timeout_s)
            if not isinstance(ch, m.Challenge):
                raise AuthError(f"{self.url}: expected a challenge, got {type(ch).__name__}")
            if not auth.verify(auth.server_proof(self._secret, hello, ch.node, ch.nonce), ch.proof):
                conn.close(CloseCode.AUTH_FAILED, "server failed authentication")
                raise AuthError(f"{self.url} ({ch.node}) failed authentication: wrong deployment secret")
            conn.send_message(m.Auth(auth.client_proof(self._secret, hello, ch.node, ch.nonce)))
            welcome = await conn.next_handshake(self.cfg.auth_timeout_s)
            if not isinstance(welcome, m.Welcome):
                raise AuthError(f"{self.url}: expected welcome, got {type(welcome).__name__}")
            conn.state = ConnState.READY
            return conn, resp, ch.node
        except BaseException:
            if conn is not None:
                conn.abort()
            resp.close()
            raise

    async def _dial(self) -> None:
        """Open every stripe of a new epoch, or none."""
        link_id = auth.new_nonce()[:32]
        tasks = [asyncio.ensure_future(self._dial_stripe(i, link_id)) for i in range(self._nstripes)]
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s + self.cfg.auth_timeout_s):
                results = await asyncio.gather(*tasks)
        except BaseException as e:
            for t in tasks:
                t.cancel()
            done = await asyncio.gather(*tasks, return_exceptions=True)
            for r in done:
                if isinstance(r, tuple):
                    r[0].abort()
                    r[1].close()
            if isinstance(e, TimeoutError):
                raise LinkTimeout(f"connecting to {self.url}: not open within "
                                  f"{self.cfg.connect_timeout_s + self.cfg.auth_timeout_s}s") from None
            raise
        self.peer = results[0][2]
        self._responses = [r[1] for r in results]
        self._attach([r[0] for r in results])

    def _lost(self, err: LinkError) -> None:
        if self._state != LinkState.OPEN:
            return
        closed = err if isinstance(err, LinkClosed) else LinkClosed(str(err))
        log.warning("link connection lost; reconnecting", local=self.local, peer=self.peer, url=self.url,
                    code=closed.code, reason=closed.reason)
        self._state = LinkState.RECONNECTING
        self._opened.clear()
        self._fail_inflight(closed)
        conns = self._detach(closed.code, closed.reason)
        responses, self._responses = self._responses, []
        self._spawn(self._retire(conns, responses), "retire")
        self._spawn(self._reconnect(), "reconnect")

    async def _retire(self, conns: list[WsConnection], responses: list[aiohttp.ClientResponse]) -> None:
        """Release the old epoch's HTTP connections once their close handshakes are over."""
        try:
            if conns:
                await asyncio.wait([c.closed for c in conns])
        finally:
            for r in responses:
                r.close()

    async def _reconnect(self) -> None:
        delay = 0.05
        while self._state == LinkState.RECONNECTING:
            await asyncio.sleep(delay)
            try:
                await self._dial()
            except LinkError as e:
                log.info("reconnect failed", url=self.url, error=str(e))
                delay = min(delay * 2, self.cfg.reconnect_max_s)
                continue
            self.stats.reconnects += 1
            log.info("link reconnected", local=self.local, peer=self.peer, url=self.url)
            return

    def _close_responses(self) -> None:
        responses, self._responses = self._responses, []
        for r in responses:
            r.close()

    async def _shutdown_transport(self, code: int, reason: str) -> None:
        await super()._shutdown_transport(code, reason)
        self._close_responses()
        await self._session.close()


async def connect(url: str, node: str, cfg: NetConfig, handler: Handler | None = None, *,
                  shaping: str = "", kv_sink: KvSink | None = None, stripes: int | None = None) -> WsClientLink:
    """Dial `url` (ws:// or wss://) as node `node`; -> an open, authenticated link.

    `shaping` names a `[[net.links]]` entry; the server applies its own entry of
    that name to its direction.  `stripes` defaults to `cfg.stripes`.  Raises
    AuthError (wrong secret, TLS failure), LinkTimeout or LinkClosed.
    """
    if shaping and not any(s.name == shaping for s in cfg.links):
        raise ConfigError(f"net.links: no entry named {shaping!r}")
    link = WsClientLink(url, node, cfg, shaping, stripes or cfg.stripes)
    link.set_handler(handler)
    link.set_kv_sink(kv_sink)
    try:
        await link._dial()
    except BaseException:
        await link.close(CloseCode.GOING_AWAY, "connect failed")
        raise
    return link


# ---------------------------------------------------------------------------
# Accepting side


@dataclass(slots=True)
class _Group:
    """Stripes of one link that have authenticated so far."""

    hello: m.Hello
    conns: list[WsConnection | None]
    timer: asyncio.TimerHandle | None = None
    peers: list[str] = field(default_factory=list)


class WsServer:
    """Accepts authenticated links at `LINK_PATH`; each is handed to `on_link`.

    Either `await start(host, port)` (own aiohttp site, TLS from `cfg.tls`) or
    `add_routes(app)` to share an existing aiohttp application.  Accepted links
    get `handler` and `kv_sink`.  A peer that fails authentication, sends an
    oversized or malformed frame, or stays silent is disconnected with a close
    code and a log line; the server keeps serving.
    """

    def __init__(self, node: str, cfg: NetConfig, handler: Handler | None = None, *,
                 on_link: Callable[[WsLink], None] | None = None, kv_sink: KvSink | None = None) -> None:
        self.node = node
        self.cfg = cfg
        self.handler = handler
        self.on_link = on_link
        self.kv_sink = kv_sink
        self._secret = _secret(cfg)
        self.links: set[WsLink] = set()
        self._groups: dict[tuple[str, str], _Group] = {}
        self._handshaking: set[WsConnection] = set()
        self._runner: web.AppRunner | None = None
        self.url = ""
        self._closing = False

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(LINK_PATH, self._handle)

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Listen on host:port (0 = any free port); -> the URL peers dial."""
        app = web.Application()
        self.add_routes(app)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        ssl_ctx = server_context(self.cfg.tls)
        site = web.TCPSite(self._runner, host, port, ssl_context=ssl_ctx)
        await site.start()
        bound = self._runner.addresses[0][1]
        self.url = f"{'wss' if ssl_ctx else 'ws'}://{host}:{bound}{LINK_PATH}"
        return self.url

    async def close(self) -> None:
        """Close every link (GOING_AWAY), drop half-open peers, stop listening."""
        self._closing = True
        for c in list(self._handshaking):
            c.close(CloseCode.GOING_AWAY, "server shutting down")
        for g in list(self._groups.values()):
            self._drop_group(g, CloseCode.GOING_AWAY, "server shutting down")
        # All at once: each close is a handshake with its own peer.
        await asyncio.gather(*(link.close(CloseCode.GOING_AWAY, "server shutting down")
                               for link in list(self.links)))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse(max_msg_size=HANDSHAKE_MAX, compress=False, autoping=False)
        await ws.prepare(request)
        peer = f"{request.remote}"
        if self._closing:
            await ws.close(code=CloseCode.GOING_AWAY, message=b"server shutting down")
            return ws
        try:
            async with asyncio.timeout(self.cfg.auth_timeout_s):
                first = await ws.receive()
        except TimeoutError:
            log.warning("link peer rejected: no hello in time", peer=peer, code=int(CloseCode.AUTH_TIMEOUT))
            await ws.close(code=CloseCode.AUTH_TIMEOUT, message=b"authentication timed out")
            return ws
        if first.type != WSMsgType.BINARY:
            code = ws.close_code or CloseCode.PROTOCOL_ERROR
            log.warning("link peer rejected: no binary hello", peer=peer, got=first.type.name, code=int(code),
                        detail=str(first.data)[:200])
            await ws.close(code=code, message=b"expected a hello frame")
            return ws
        try:
            hello = frames.decode(first.data, max_control=HANDSHAKE_MAX).msg
            if not isinstance(hello, m.Hello):
                raise FrameError(f"expected Hello, got {type(hello).__name__}")
            if hello.shaping and not any(s.name == hello.shaping for s in self.cfg.links):
                raise FrameError(f"unknown link shaping {hello.shaping!r}")
        except FrameError as e:
            log.warning("link peer rejected: bad hello", peer=peer, code=int(CloseCode.BAD_FRAME), reason=str(e))
            await ws.close(code=CloseCode.BAD_FRAME, message=b"bad hello")
            return ws
        # From here on the connection speaks pddgw framing (the client sends
        # nothing more until it sees our challenge, so aiohttp holds no bytes).
        transport = request.transport
        assert transport is not None
        conn = WsConnection(transport, request.protocol, client=False, max_frame=self.cfg.max_frame_bytes,
                            max_control=self.cfg.max_control_bytes, peer=f"{hello.node}@{peer}")
        conn.attach()
        self._handshaking.add(conn)
        try:
            nonce = auth.new_nonce()
            conn.send_message(m.Challenge(self.node, nonce, auth.server_proof(self._secret, hello, self.node, nonce)))
            try:
                answer = await conn.next_handshake(self.cfg.auth_timeout_s)
            except LinkTimeout:
                log.warning("link peer rejected: no auth in time", peer=conn.peer, code=int(CloseCode.AUTH_TIMEOUT))
                conn.close(CloseCode.AUTH_TIMEOUT, "authentication timed out")
                answer = None
            except LinkError as e:
                log.warning("link peer rejected: left during authentication", peer=conn.peer, reason=str(e))
                answer = None
            if answer is not None:
                proof = auth.client_proof(self._secret, hello, self.node, nonce)
                if not isinstance(answer, m.Auth) or not auth.verify(proof, answer.proof):
                    log.warning("link peer rejected: authentication failed", peer=conn.peer,
                                code=int(CloseCode.AUTH_FAILED))
                    conn.close(CloseCode.AUTH_FAILED, "authentication failed")
                else:
                    conn.state = ConnState.READY
                    conn.send_message(m.Welcome())
                    self._join(hello, conn)
            await asyncio.shield(conn.closed)
        except asyncio.CancelledError:
            conn.abort()
            raise
        finally:
            self._handshaking.discard(conn)
        return ws

    def _join(self, hello: m.Hello, conn: WsConnection) -> None:
        key = (hello.node, hello.link_id)
        g = self._groups.get(key)
        if g is None:
            g = _Group(hello, [None] * hello.stripes)
            g.timer = asyncio.get_running_loop().call_later(
                self.cfg.auth_timeout_s, self._expire, key)
            self._groups[key] = g
        if hello.stripes != len(g.conns) or g.conns[hello.stripe] is not None:
            conn._violation(CloseCode.PROTOCOL_ERROR, f"stripe {hello.stripe}/{hello.stripes} does not fit its link")
            return
        g.conns[hello.stripe] = conn
        if any(c is None for c in g.conns):
            return
        del self._groups[key]
        if g.timer is not None:
            g.timer.cancel()
        conns = [c for c in g.conns if c is not None]
        if any(c.state != ConnState.READY for c in conns):
            self._drop_group(g, CloseCode.GOING_AWAY, "a stripe was lost")
            return
        shaping = self.cfg.shaping(hello.shaping) if hello.shaping else None
        link = WsLink(self.node, hello.node, self.cfg, shaping)
        link.set_handler(self.handler)
        link.set_kv_sink(self.kv_sink)
        link.on_closed = self.links.discard
        self.links.add(link)
        link._attach(conns)
        log.info("link accepted", local=self.node, peer=hello.node, stripes=len(conns),
                 shaping=hello.shaping or None)
        if self.on_link is not None:
            try:
                self.on_link(link)
            except Exception as e:
                log.error("on_link callback failed", peer=hello.node, error=repr(e))

    def _expire(self, key: tuple[str, str]) -> None:
        g = self._groups.pop(key, None)
        if g is not None:
            log.warning("link dropped: not every stripe connected in time", peer=key[0],
                        stripes=len(g.conns), connected=sum(c is not None for c in g.conns))
            self._drop_group(g, CloseCode.AUTH_TIMEOUT, "not every stripe connected in time")

    def _drop_group(self, g: _Group, code: int, reason: str) -> None:
        self._groups = {k: v for k, v in self._groups.items() if v is not g}
        if g.timer is not None:
            g.timer.cancel()
        for c in g.conns:
            if c is not None:
                c.close(code, reason)
