"""The `Link` contract: what every node link offers, whatever carries it.

A link connects this node to one peer.  Over it travel one-way messages,
requests with replies (any number in flight) and per-request streams.  Two
transports keep this contract with the same semantics: `InProcLink` (one
process) and `WsLink` (WebSocket, striped over parallel connections), both on
`LinkBase` (mux.py).  Every operation takes a timeout and fails with
`LinkTimeout` when it expires, so a dead peer surfaces as a typed error within
it; a lost connection fails what was in flight with `LinkClosed`.  Outbound
frames have a traffic class (`Priority`): a foreground frame may overtake
background frames of its link; within one class, frames sent by one task keep
their order.  A link's lifecycle and the traffic classes in full:
docs/protocol.md.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from enum import IntEnum
from typing import TypeVar

import structlog

from pddgw import messages as m
from pddgw.net.errors import CloseCode, LinkError, LinkTimeout, RemoteError

log = structlog.get_logger("pddgw.net")
T = TypeVar("T")

Handler = Callable[["Link", m.Message], Awaitable[m.Message | None]]
"""Called with each inbound message that is not a reply and not for an open stream.
For a request its return value is the reply (None -> `Ack(request_id)`; an
exception -> `Error`); for a one-way message the return value is ignored."""

KvSink = Callable[[m.KVSpan], memoryview | None]
"""Called when a KV chunk's metadata has arrived, before its payload: return a
writable, C-contiguous memoryview of exactly `span.nbytes` bytes and the
payload is received straight into it (the delivered `KVChunk.payload` is that
view), or None to let the link allocate.  Only a delivered KVChunk means the
memory holds the chunk: if the connection drops mid-frame the memory is
partly written (and, from a client, still masked)."""


class Priority(IntEnum):
    """Traffic class of an outbound frame; the lower value is served first."""

    FOREGROUND = 0
    BACKGROUND = 1


PriorityLike = Priority | Callable[[], Priority]
"""A class, or a function read once per frame right before the frame is handed
to the transport (a sender can demote a transfer in progress)."""


class LinkState(IntEnum):
    CONNECTING = 0
    OPEN = 1
    RECONNECTING = 2
    CLOSED = 3


@dataclass(slots=True)
class LinkStats:
    """Counters of one link (wire bytes include every header)."""

    frames_sent: int = 0
    bytes_sent: int = 0
    kv_bytes_sent: int = 0            # KV payload bytes only
    # KV payload bytes sent by traffic class, counted per frame at the class it went out in.
    kv_bytes_sent_foreground: int = 0
    kv_bytes_sent_background: int = 0
    frames_received: int = 0
    bytes_received: int = 0
    kv_bytes_received: int = 0
    kv_bytes_handed: int = 0          # of those, written in place by the sender (`Link.kv_buffer`)
    reconnects: int = 0
    rtt_s: float = 0.0                # last heartbeat round trip (on the loop's clock)
    pongs: int = 0                    # heartbeat round trips measured


class Link(ABC):
    """A message link to one peer node.

    Contract:
    * `send(msg, priority=...)` queues one message and returns when its bytes
      are handed to the transport (a KVChunk payload may be reused from then
      on).  Messages sent by one task with the same priority arrive in the
      order sent; a FOREGROUND frame may overtake BACKGROUND frames of the
      same link (never the reverse).  `priority` is a `Priority` or a
      zero-argument callable returning one, read once per frame right before
      the frame is handed to the transport.
    * `send_nowait(msg)` sends a FOREGROUND frame within the call where the
      transport takes it without waiting (in-process links, mostly), else
      sends nothing and returns False.
    * `send_all(msgs, priority=...)` sends many (KV chunks) as fast as the
      transport allows, striped over parallel connections where the link has
      them; frames of one class arrive in the order of `msgs`.  `timeout` bounds
      each frame's wait, not the whole batch: a batch takes as long as its bytes
      need on a slow or shared wire, and fails only when a frame does not go out
      within the timeout (the wire, not the batch's size, is what stalled).  Returns the
      seconds its frames were in service on the wire, excluding time queued
      behind other frames: on a shaped link the sum of their own
      serialization times (a preempted background frame counts only while it
      was on the wire), on an unshaped one the time spent inside transport
      writes (parallel stripes counted once; ~0 in-process).  Its bytes over
      that time sample the wire's rate, whatever else shares the wire.
    * Requests, replies and heartbeats are FOREGROUND.
    * `request(msg)` sends and waits for the peer handler's reply; an `Error`
      reply raises `RemoteError`.
    * `stream(request_id)` registers (at once, so open it before triggering the
      peer) an async iterator over the messages of that request id; it ends
      after a message that `messages.ends_stream` (`TokenItem.done`,
      `KVChunk.last`, `Cancel`), raises `RemoteError` on an `Error`, and raises
      `LinkTimeout` when nothing arrives within its timeout.
    * Failures are `LinkError`s: `LinkTimeout`, `LinkClosed` (with a close
      code), `RemoteError`, `AuthError`.  A stream that is never read holds
      inbound data and eventually pauses the whole link (back-pressure).
    """

    local: str
    peer: str
    stats: LinkStats

    @property
    @abstractmethod
    def state(self) -> LinkState: ...

    @abstractmethod
    async def send(self, msg: m.Message, *, timeout: float | None = None,
                   priority: PriorityLike = Priority.FOREGROUND) -> None: ...

    @abstractmethod
    async def send_all(self, msgs: Iterable[m.Message], *, timeout: float | None = None,
                       priority: PriorityLike = Priority.FOREGROUND) -> float: ...

    @abstractmethod
    async def request(self, msg: m.Message, *, timeout: float | None = None) -> m.Message: ...

    @abstractmethod
    def stream(self, request_id: str, *, timeout: float | None = None) -> LinkStream: ...

    @abstractmethod
    def set_handler(self, handler: Handler | None) -> None:
        """Who receives inbound requests and one-way messages (see `Handler`); None drops them."""

    @abstractmethod
    def set_kv_sink(self, sink: KvSink | None) -> None:
        """Where inbound KV payloads are received (see `KvSink`); None: link-owned buffers."""

    @abstractmethod
    async def close(self, code: int = CloseCode.NORMAL, reason: str = "closed") -> None:
        """Close for good: in-flight operations fail with LinkClosed, all tasks end."""

    @abstractmethod
    async def wait_closed(self) -> None: ...

    def send_nowait(self, msg: m.Message) -> bool:
        """Send `msg` (FOREGROUND) within the call if the transport takes it without waiting:
        exactly what `send` would do then.  False: nothing was sent (use `send`)."""
        return False

    def kv_buffer(self, span: m.KVSpan) -> memoryview | None:
        """Where the sender may write the payload of `span` before sending it, or None.

        A writable byte view of exactly `span.nbytes` in the receiver's memory
        (in-process: its KV sink, a block of its pool).  A KVChunk sent with
        this very view as its payload is handed over, not copied; the view is
        the receiver's from then on.  Dropped unsent, its memory goes back.
        Transports that copy bytes anyway (sockets) have none.
        """
        return None


class LinkStream:
    """Messages of one request id, in arrival order (see `Link.stream`).

    Use as `async with link.stream(rid) as s: async for msg in s: ...`; leaving
    the block unregisters it.  Or `push` them to a function as they arrive (no
    task waits per message).
    """

    def __init__(self, request_id: str, timeout: float, *, loop: asyncio.AbstractEventLoop, peer: str,
                 consumed: Callable[[int], None], streams: dict[str, LinkStream]) -> None:
        # The link's: its loop, its peer's name, what frees a read message's bytes, its open streams.
        self._loop, self._peer, self._consumed, self._streams = loop, peer, consumed, streams
        self.request_id = request_id
        self._timeout = timeout
        self._items: deque[tuple[m.Message | LinkError, int]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._registered = True
        # The wait in progress times out at `_deadline`.  One timer serves every wait: it is
        # re-armed at the newest deadline when it fires early, not armed and cancelled per
        # message (a token stream waits once per token).
        self._deadline = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deliver: Callable[[m.Message | LinkError], None] | None = None   # see `push`

    def _put(self, item: m.Message | LinkError, nbytes: int) -> None:
        if self._deliver is not None:
            if not self._ended:
                self._deadline = self._loop.time() + self._timeout
                self._hand(item)
            self._consumed(nbytes)
            return
        self._items.append((item, nbytes))
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def push(self, deliver: Callable[[m.Message | LinkError], None]) -> None:
        """Instead of iterating: `deliver` gets each message as it arrives, then what ends the
        stream as iterating would raise it (`LinkError`: `RemoteError` for an `Error`,
        `LinkTimeout` when nothing arrives within the timeout), nothing after the message or
        error that ends it; what arrived before this call at once.  Called on the loop, in the
        link's receive path: it must not block (queue the work, wake a task).  `close` stops it."""
        self._deliver = deliver
        loop = self._loop
        self._deadline = loop.time() + self._timeout
        if self._timer is None:
            self._arm(loop, self._deadline)
        while self._items and not self._ended:
            item, nbytes = self._items.popleft()
            self._consumed(nbytes)
            self._hand(item)

    def _hand(self, item: m.Message | LinkError) -> None:
        """One item to the push receiver, as `__anext__` would yield or raise it."""
        if isinstance(item, LinkError):
            self._ended = True
        elif isinstance(item, m.Error):
            self._ended = True
            item = RemoteError(item.code, item.message, item.request_id)
        elif m.ends_stream(item):
            self._ended = True
        if self._ended and self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            self._deliver(item)  # type: ignore[misc]
        except Exception as e:   # a receiver's bug must not break the link's receive path
            log.error("stream receiver failed", peer=self._peer, request_id=self.request_id, error=repr(e))

    async def __aenter__(self) -> LinkStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    def __aiter__(self) -> LinkStream:
        return self

    async def __anext__(self) -> m.Message:
        if self._ended:
            raise StopAsyncIteration
        if not self._items:
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            self._deadline = loop.time() + self._timeout
            if self._timer is None:
                self._arm(loop, self._deadline)
            try:
                await self._waiter
            finally:
                self._waiter = None
        item, nbytes = self._items.popleft()
        self._consumed(nbytes)
        if isinstance(item, LinkError):
            self._ended = True
            raise item
        if isinstance(item, m.Error):
            self._ended = True
            raise RemoteError(item.code, item.message, item.request_id)
        if m.ends_stream(item):
            self._ended = True
        return item

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self._timer_at = at
        self._timer = loop.call_at(at, self._on_timer, loop)

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        if self._deliver is not None:
            if self._ended:
                return
            if self._deadline > self._timer_at:
                self._arm(loop, self._deadline)
                return
            self._hand(LinkTimeout(f"stream {self.request_id!r}: nothing within {self._timeout}s"))
            return
        waiter = self._waiter
        if waiter is None or waiter.done():
            return                       # nobody waits: the next wait arms its own deadline
        if self._deadline > self._timer_at:
            self._arm(loop, self._deadline)          # a later wait than the one armed for
            return
        waiter.set_exception(LinkTimeout(f"stream {self.request_id!r}: nothing within {self._timeout}s"))

    def _unregister(self) -> None:
        if self._registered:
            self._registered = False
            if self._streams.get(self.request_id) is self:
                del self._streams[self.request_id]

    def close(self) -> None:
        """Unregister and drop what was not read."""
        self._unregister()
        if self._timer is not None and self._waiter is None:    # a reader still waiting keeps its deadline
            self._timer.cancel()
            self._timer = None
        while self._items:
            self._consumed(self._items.popleft()[1])
        self._ended = True
