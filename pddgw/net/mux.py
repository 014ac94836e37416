"""`LinkBase`: the transport-independent multiplexer behind every `Link`.

Replies are matched to requests by a correlation id in the frame header,
stream messages by their `request_id`; anything else goes to the handler, one
at a time, in arrival order (a request runs in its own task, up to
`max_inflight_requests` at once).  A `TokenBatch` is split at this edge:
streams and handlers never see a batch.  A transport (`InProcLink`, `WsLink`)
moves the bytes; everything here is the same for both.  A link's lifecycle
(`LinkState`) and its traffic classes: docs/protocol.md.
"""

from __future__ import annotations

import asyncio
from abc import abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import structlog

from pddgw.config import NetConfig
from pddgw import messages as m
from pddgw.net.errors import CloseCode, LinkClosed, LinkError, LinkTimeout, RemoteError

from pddgw.net.link import Handler, KvSink, Link, LinkState, LinkStats, LinkStream, Priority, PriorityLike

log = structlog.get_logger("pddgw.net")
T = TypeVar("T")


class LinkBase(Link):
    """Multiplexing, dispatch, heartbeats and timeouts shared by both transports.

    A transport implements `_transmit` / `_transmit_nowait` (one frame out),
    `_shaped`, `_set_reading` (inbound back-pressure) and `_shutdown_transport`,
    and feeds inbound messages, in order, to `_on_message`.
    """

    def __init__(self, local: str, peer: str, cfg: NetConfig) -> None:
        self.local = local
        self.peer = peer
        self.cfg = cfg
        self.stats = LinkStats()
        self._loop = asyncio.get_running_loop()
        self._state = LinkState.CONNECTING
        self._opened = asyncio.Event()
        self._closed = asyncio.Event()          # set once every task of the link has ended
        self._dead = asyncio.Event()            # set when the state becomes CLOSED
        self._close_error: LinkClosed | None = None
        self._handler: Handler | None = None
        self._kv_sink: KvSink | None = None
        self._pending: dict[int, asyncio.Future[m.Message]] = {}
        self._next_corr = 0
        self._streams: dict[str, LinkStream] = {}
        self._inbox: deque[tuple[m.Message, int]] = deque()
        self._inbox_wake = asyncio.Event()
        self._inbound_bytes = 0
        self._reading = True
        self._serving = 0                       # request handler tasks running
        self._tasks: set[asyncio.Task] = set()
        # Unshaped links: foreground frames waiting for or inside `_transmit`;
        # background frames wait for `_fg_idle` (shaped links preempt on the wire instead).
        self._fg_busy = 0
        self._fg_idle = asyncio.Event()
        self._fg_idle.set()
        self._last_rx = self._loop.time()
        self._dispatcher = self._spawn(self._dispatch_loop(), "dispatch")
        self._heartbeat = self._spawn(self._heartbeat_loop(), "heartbeat") if cfg.heartbeat_s else None

    # -- transport hooks ---------------------------------------------------

    @abstractmethod
    async def _transmit(self, msg: m.Message, corr: int, flags: int,
                        priority: Priority = Priority.FOREGROUND) -> float | None:
        """Send one frame; wait for transport back-pressure; raise LinkClosed if the connection is gone.

        -> on a shaped link the seconds the frame was on the emulated wire; else
        None (the caller times the call).
        """

    @abstractmethod
    def _shaped(self) -> bool:
        """Whether frames cross a `ShapedPipe`, which schedules the classes itself."""

    @abstractmethod
    def _transmit_nowait(self, msg: m.Message, corr: int = 0, flags: int = 0) -> None:
        """Send one small frame without waiting (heartbeats); silently dropped if not open."""

    def _send_at_once(self, msg: m.Message, priority: PriorityLike, corr: int = 0, flags: int = 0) -> bool:
        """Send a frame the transport takes without waiting, synchronously: exactly what
        `_send_frame` would do when nothing in it suspends, minus its coroutines.  False
        (nothing done): the caller takes the general path.  A transport with no such case
        keeps this."""
        return False

    def _heard_since(self, since: float) -> bool:
        """Whether any byte from the peer arrived after loop time `since`.

        The base counts whole inbound messages; a transport that sees bytes
        before their frame is complete (a socket read, a shaped wire
        serializing the peer's frame) overrides it.
        """
        return self._last_rx > since

    @abstractmethod
    def _set_reading(self, on: bool) -> None:
        """Pause / resume taking inbound frames from the peer."""

    @abstractmethod
    async def _shutdown_transport(self, code: int, reason: str) -> None:
        """Close every connection of the link (final close)."""

    # -- public API ----------------------------------------------------------

    @property
    def state(self) -> LinkState:
        return self._state

    def set_handler(self, handler: Handler | None) -> None:
        self._handler = handler

    def set_kv_sink(self, sink: KvSink | None) -> None:
        self._kv_sink = sink

    def send_nowait(self, msg: m.Message) -> bool:
        return self._send_at_once(msg, Priority.FOREGROUND)

    async def send(self, msg: m.Message, *, timeout: float | None = None,
                   priority: PriorityLike = Priority.FOREGROUND) -> None:
        # Most frames of a simulated run (tokens, load reports) never wait: sent in the call.
        if self._send_at_once(msg, priority):
            return
        t = self.cfg.send_timeout_s if timeout is None else timeout
        await self._timed(self._send_frame(msg, 0, 0, priority), t, f"send {type(msg).__name__}")

    async def send_all(self, msgs: Iterable[m.Message], *, timeout: float | None = None,
                       priority: PriorityLike = Priority.FOREGROUND) -> float:
        t = self.cfg.send_timeout_s if timeout is None else timeout
        meter = ServiceMeter(self._loop)

        for msg in msgs:
            await self._timed(self._send_frame(msg, 0, 0, priority, meter), t, "a send_all frame")
        return meter.seconds

    async def request(self, msg: m.Message, *, timeout: float | None = None) -> m.Message:
        t = self.cfg.request_timeout_s if timeout is None else timeout
        self._next_corr = self._next_corr % 0xFFFF_FFFF + 1
        corr = self._next_corr
        fut: asyncio.Future[m.Message] = self._loop.create_future()
        self._pending[corr] = fut
        what = f"request {type(msg).__name__}"
        try:
            # Most frames are taken at once: then only the reply is waited for, by a timer on it.
            if self._send_at_once(msg, Priority.FOREGROUND, corr):
                reply = await self._reply(fut, t, what)
            else:
                reply = await self._timed(self._exchange(msg, corr, fut), t, what)
        finally:
            self._pending.pop(corr, None)
        if isinstance(reply, m.Error):
            raise RemoteError(reply.code, reply.message, reply.request_id)
        return reply

    async def _exchange(self, msg: m.Message, corr: int, fut: asyncio.Future[m.Message]) -> m.Message:
        await self._send_frame(msg, corr, 0)
        return await fut

    async def _reply(self, fut: asyncio.Future[m.Message], timeout: float, what: str) -> m.Message:
        """`fut` awaited, failed with LinkTimeout `timeout` from now unless answered."""
        timer = self._loop.call_later(timeout, self._expire, fut, what, timeout)
        try:
            return await fut
        finally:
            timer.cancel()

    def _expire(self, fut: asyncio.Future, what: str, timeout: float) -> None:
        if not fut.done():
            fut.set_exception(LinkTimeout(f"{what} to {self.peer}: no completion within {timeout}s"))

    def stream(self, request_id: str, *, timeout: float | None = None) -> LinkStream:
        if self._state == LinkState.CLOSED:
            raise self._closed_error()
        if request_id in self._streams:
            raise ValueError(f"a stream for {request_id!r} is already open on this link")
        st = LinkStream(request_id, self.cfg.request_timeout_s if timeout is None else timeout, loop=self._loop,
                        peer=self.peer, consumed=self._consumed, streams=self._streams)
        self._streams[request_id] = st
        return st

    async def close(self, code: int = CloseCode.NORMAL, reason: str = "closed") -> None:
        if self._state != LinkState.CLOSED:
            self._finish(LinkClosed(f"link to {self.peer} {reason}", code))
            try:
                await self._shutdown_transport(code, reason)
            finally:
                await self._cancel_tasks()
        await self._closed.wait()

    async def wait_closed(self) -> None:
        await self._closed.wait()

    # -- internals -------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any], name: str,
               done: Callable[[asyncio.Task], None] | None = None) -> asyncio.Task:
        """A task of this link (cancelled with it); `done` replaces the callback that forgets it
        and must forget it itself (one callback per task: a request is served per task)."""
        task = self._loop.create_task(coro, name=f"link {self.local}->{self.peer} {name}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard if done is None else done)
        return task

    async def _cancel_tasks(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks)
        self._closed.set()

    def _closed_error(self) -> LinkClosed:
        return self._close_error or LinkClosed(f"link to {self.peer} is closed", CloseCode.NORMAL)

    async def _timed(self, coro: Awaitable[T], timeout: float, what: str) -> T:
        """`coro` awaited by a deadline `timeout` from the call (LinkTimeout after it)."""
        try:
            async with asyncio.timeout(timeout) as cm:
                return await coro
        except TimeoutError:
            if cm.expired():
                raise LinkTimeout(f"{what} to {self.peer}: no completion within {timeout}s") from None
            raise

    async def _wait_open(self) -> None:
        while self._state != LinkState.OPEN:
            if self._state == LinkState.CLOSED:
                raise self._closed_error()
            await wait_until(self._opened, self._dead)

    async def _send_frame(self, msg: m.Message, corr: int, flags: int,
                          priority: PriorityLike = Priority.FOREGROUND, meter: ServiceMeter | None = None,
                          **where: Any) -> None:
        """One frame out at its priority; `where`: transport-specific placement (a stripe)."""
        if self._state != LinkState.OPEN:
            await self._wait_open()
        p = priority() if callable(priority) else priority
        if self._shaped():
            service = await self._transmit(msg, corr, flags, p, **where)
            if meter is not None and service is not None:
                meter.shaped_s += service
            self._count_kv(msg, p)
            return
        # Unshaped: a frame handed to the transport cannot be overtaken, so a
        # background frame is not handed over while a foreground one waits for
        # or is inside the transport.  Foreground never waits here.
        if p == Priority.FOREGROUND:
            self._fg_busy += 1
            self._fg_idle.clear()
        else:
            while self._fg_busy:
                if not await wait_until(self._fg_idle, self._dead):
                    raise self._closed_error()
        try:
            if meter is not None:
                meter.enter()
            try:
                await self._transmit(msg, corr, flags, p, **where)
            finally:
                if meter is not None:
                    meter.leave()
            self._count_kv(msg, p)
        finally:
            if p == Priority.FOREGROUND:
                self._fg_busy -= 1
                if not self._fg_busy:
                    self._fg_idle.set()

    def _count_kv(self, msg: m.Message, p: Priority) -> None:
        if isinstance(msg, m.KVChunk):
            if p == Priority.FOREGROUND:
                self.stats.kv_bytes_sent_foreground += msg.span.nbytes
            else:
                self.stats.kv_bytes_sent_background += msg.span.nbytes

    def _set_open(self) -> None:
        self._state = LinkState.OPEN
        self._last_rx = self._loop.time()
        self._opened.set()

    def _fail_inflight(self, err: LinkError) -> None:
        """The connection is gone: every request and stream in flight fails with `err`."""
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()  # mark retrieved: the waiter may already have timed out
        for st in list(self._streams.values()):
            st._put(err, 0)
            st._unregister()

    def _lost(self, err: LinkError) -> None:
        """Connection lost (transport callback): reconnecting transports override."""
        if self._state == LinkState.CLOSED:
            return
        closed = err if isinstance(err, LinkClosed) else LinkClosed(str(err))
        self._finish(closed)
        self._spawn(self._after_lost(closed), "teardown")

    async def _after_lost(self, err: LinkClosed) -> None:
        await self._shutdown_transport(err.code, err.reason)
        await self._cancel_tasks()

    def _finish(self, err: LinkClosed) -> None:
        if self._state == LinkState.CLOSED:
            return
        self._state = LinkState.CLOSED
        self._close_error = err
        self._opened.clear()
        self._dead.set()
        self._fail_inflight(err)
        self._inbox_wake.set()
        log.info("link closed", local=self.local, peer=self.peer, code=err.code, reason=err.reason)

    # -- inbound ---------------------------------------------------------------

    def _on_message(self, msg: m.Message, corr: int, is_reply: bool, owned_bytes: int) -> None:
        """One inbound message, in order.  `owned_bytes`: payload memory the link holds for it."""
        self._last_rx = self._loop.time()
        if is_reply:
            fut = self._pending.pop(corr, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            else:
                log.debug("late reply dropped", peer=self.peer, corr=corr, kind=type(msg).__name__)
            return
        if corr:
            cap = self.cfg.max_inflight_requests
            # A Cancel is never refused: it frees what the others hold (refused, the request's
            # KV and session would stay on this node until it restarts).
            if self._serving >= cap and type(msg) is not m.Cancel:
                # Refused without a task: a flood of requests costs a reply each, not a task each.
                self._transmit_nowait(m.Error(getattr(msg, "request_id", ""), "overloaded",
                                              f"{self.local} serves at most {cap} requests at once "
                                              f"(net.max_inflight_requests)"), corr, _FLAG_REPLY)
                return
            self._serving += 1
            self._spawn(self._serve_request(msg, corr), "request", self._request_done)
            return
        if isinstance(msg, m.Ping):
            self._transmit_nowait(m.Pong(msg.sent_ns))
            return
        if isinstance(msg, m.Pong):
            self.stats.rtt_s = max(0.0, (_loop_ns(self._loop) - msg.sent_ns) / 1e9)
            self.stats.pongs += 1
            return
        if type(msg) is m.TokenBatch:
            # Split at the edge: each item goes where it would have gone alone, in order.
            for item in msg.items:
                self._route(item, 0)
        else:
            self._route(msg, owned_bytes)
        if self._reading and self._inbound_bytes > self.cfg.inbound_buffer_bytes:
            self._reading = False
            self._set_reading(False)

    def _route(self, msg: m.Message, owned_bytes: int) -> None:
        """A one-way message to its stream (by request_id) or, without one, to the handler."""
        rid = getattr(msg, "request_id", None)
        st = self._streams.get(rid) if rid is not None else None
        self._inbound_bytes += owned_bytes
        if st is not None:
            st._put(msg, owned_bytes)
            if m.ends_stream(msg) or isinstance(msg, m.Error):
                st._unregister()        # what follows for this id goes to the handler again
        else:
            self._inbox.append((msg, owned_bytes))
            self._inbox_wake.set()

    def _consumed(self, nbytes: int) -> None:
        self._inbound_bytes -= nbytes
        if not self._reading and self._inbound_bytes <= self.cfg.inbound_buffer_bytes // 2:
            self._reading = True
            self._set_reading(True)

    async def _dispatch_loop(self) -> None:
        while True:
            while not self._inbox:
                if self._state == LinkState.CLOSED:
                    return
                self._inbox_wake.clear()
                await self._inbox_wake.wait()
            msg, nbytes = self._inbox.popleft()
            try:
                if self._handler is None:
                    log.debug("no handler; message dropped", peer=self.peer, kind=type(msg).__name__)
                else:
                    await self._handler(self, msg)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("link handler failed", peer=self.peer, kind=type(msg).__name__, error=repr(e))
            finally:
                self._consumed(nbytes)

    def _request_done(self, task: asyncio.Task) -> None:
        # A done callback, not a `finally`: a task cancelled before it starts never runs its body.
        self._tasks.discard(task)
        self._serving -= 1

    async def _serve_request(self, msg: m.Message, corr: int) -> None:
        rid = getattr(msg, "request_id", "")
        try:
            if self._handler is None:
                reply: m.Message | None = m.Error(rid, "no_handler", f"{self.local} has no handler")
            else:
                reply = await self._handler(self, msg)
            if reply is None:
                reply = m.Ack(rid)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            code = e.code if isinstance(e, RemoteError) else type(e).__name__
            reply = m.Error(rid, code, str(e)[: m.MAX_TEXT_CHARS])
        try:
            if not self._send_at_once(reply, Priority.FOREGROUND, corr, _FLAG_REPLY):
                await self._timed(self._send_frame(reply, corr, _FLAG_REPLY), self.cfg.send_timeout_s, "reply")
        except LinkError as e:
            log.debug("reply not sent", peer=self.peer, error=str(e))

    async def _heartbeat_loop(self) -> None:
        interval = self.cfg.heartbeat_s
        while True:
            await asyncio.sleep(interval)
            if self._state != LinkState.OPEN:
                continue
            now = self._loop.time()
            if now - self._last_rx > self.cfg.dead_after_s and not self._heard_since(now - self.cfg.dead_after_s):
                log.warning("peer silent; dropping connection", local=self.local, peer=self.peer,
                            silent_s=round(now - self._last_rx, 3))
                self._peer_silent()
                continue
            self._transmit_nowait(m.Ping(_loop_ns(self._loop)))

    def _peer_silent(self) -> None:
        self._lost(LinkClosed(f"no byte from {self.peer} within {self.cfg.dead_after_s}s", CloseCode.PEER_SILENT))


_FLAG_REPLY = 0x01  # frames.FLAG_REPLY; duplicated to keep this module free of the codec


class ServiceMeter:
    """Seconds the frames of one `send_all` were in service (see `Link.send_all`).

    A shaped transport reports each frame's wire time (`shaped_s`, summed: one
    wire serializes one frame at a time).  Otherwise the meter takes the union
    of the intervals frames spent inside the transport (`enter` / `leave`):
    parallel stripes share the path, and summing their overlapping writes would
    count the same seconds once per stripe.
    """

    __slots__ = ("_loop", "shaped_s", "_inside", "_since", "_unshaped_s")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.shaped_s = 0.0
        self._inside = 0
        self._since = 0.0
        self._unshaped_s = 0.0

    def enter(self) -> None:
        if not self._inside:
            self._since = self._loop.time()
        self._inside += 1

    def leave(self) -> None:
        self._inside -= 1
        if not self._inside:
            self._unshaped_s += self._loop.time() - self._since

    @property
    def seconds(self) -> float:
        return self.shaped_s + self._unshaped_s


def _loop_ns(loop: asyncio.AbstractEventLoop) -> int:
    """The loop's clock in ns: heartbeat RTTs are measured on the clock the loop runs on."""
    return max(0, round(loop.time() * 1e9))


def sink_buffer(sink: KvSink | None, span: m.KVSpan, peer: str) -> tuple[memoryview, int]:
    """Destination of a KV payload -> (writable byte view, bytes the link owns).

    Where the sink has none, a link-owned bytearray.
    """
    n = span.payload_nbytes
    view = sink_view(sink, span, peer) if n else None
    return (view, 0) if view is not None else (memoryview(bytearray(n)), n)


def sink_view(sink: KvSink | None, span: m.KVSpan, peer: str) -> memoryview | None:
    """The sink's memory for a payload of `span` as a writable byte view, or None.

    A sink that fails or returns an unusable buffer is logged and counts as
    none: a bad sink must not take the link down.
    """
    if sink is None:
        return None
    n = span.payload_nbytes
    try:
        buf = sink(span)
        if buf is None:
            return None
        view = memoryview(buf)
        if view.readonly or not view.c_contiguous or view.nbytes != n:
            raise ValueError(f"needs a writable contiguous buffer of {n} bytes, got {view.nbytes} "
                             f"(readonly={view.readonly})")
        return view.cast("B")
    except Exception as e:
        log.error("KV sink failed; using a link buffer", peer=peer, request_id=span.request_id, error=repr(e))
        return None


async def wait_until(event: asyncio.Event, closed: asyncio.Event) -> bool:
    """Wait for `event` or `closed`; -> True when `event` is set."""
    if event.is_set():
        return True
    if closed.is_set():
        return False
    loop = asyncio.get_running_loop()
    a = loop.create_task(event.wait())
    b = loop.create_task(closed.wait())
    try:
        await asyncio.wait([a, b], return_when=asyncio.FIRST_COMPLETED)
    finally:
        a.cancel()
        b.cancel()
    return event.is_set()
