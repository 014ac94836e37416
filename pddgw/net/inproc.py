"""In-process links: the embedded all-in-one deployment and tests.

Same semantics as the WebSocket transport (typed messages validated at
construction, requests, streams, back-pressure, KV sinks, shaping, close
codes), without sockets: a frame is handed to the peer link object.  Payloads
are copied once into the receiver's memory (its KV sink or a fresh buffer), so
the sender may reuse its buffer when `send` returns, exactly as over a socket;
a payload the sender wrote into the receiver's sink (`kv_buffer`) is handed
over as it is, not copied (nor snapshot on a shaped link: it is not the
sender's to reuse).

A `TokenBatch` crosses an unshaped link as one frame; a shaped one books each
item at its own TokenItem's wire size, so the emulated timeline is that of a
frame per request whatever the sender batched.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

from pddgw.config import NetConfig, ShapingConfig
from pddgw.net import frames
from pddgw import messages as m
from pddgw.net.errors import CloseCode, LinkClosed
from pddgw.net.link import Handler, KvSink, LinkState, Priority, PriorityLike
from pddgw.net.mux import LinkBase, sink_buffer, sink_view, wait_until
from pddgw.net.shaping import MIN_SLEEP_S, ShapedPipe, Shaper
from pddgw.net.wsproto import ws_header_size

_Item = tuple[m.Message, int, int, int]  # message, corr, flags, wire bytes


def wire_size(msg: m.Message) -> int:
    """Bytes the message would take on a WebSocket link (server -> client framing).

    A virtual KV chunk counts the KV it stands for, as shaping charges it.
    """
    n = frames.frame_size(msg)
    virtual = msg.span.nbytes if isinstance(msg, m.KVChunk) and msg.span.virtual else 0
    return ws_header_size(n, masked=False) + n + virtual


class InProcLink(LinkBase):
    """One end of an in-process link; see `InProcNetwork.connect` or `inproc_pair`."""

    def __init__(self, local: str, peer: str, cfg: NetConfig, shaping: ShapingConfig | None,
                 shaper: Shaper | None = None) -> None:
        super().__init__(local, peer, cfg)
        self._other: InProcLink | None = None
        self._accepting = asyncio.Event()    # our inbound is open (the peer's back-pressure)
        self._accepting.set()
        self._pipe = (ShapedPipe(shaping, self._deliver, shaper) if shaping is not None and shaping.enabled
                      else None)
        # Our sink's views handed to the peer by `kv_buffer`, by id; an entry goes when its view dies.
        self._handed: dict[int, weakref.ref[memoryview]] = {}

    def kv_buffer(self, span: m.KVSpan) -> memoryview | None:
        other = self._other
        if (span.virtual or self._state != LinkState.OPEN or other is None
                or other._state != LinkState.OPEN):
            return None
        view = sink_view(other._kv_sink, span, self.local)
        if view is not None:
            key, handed = id(view), other._handed
            handed[key] = weakref.ref(view, lambda ref: handed.pop(key, None) if handed.get(key) is ref else None)
        return view

    def _is_handed(self, payload: object) -> bool:
        """Whether `payload` is a view of our sink handed to the peer (`kv_buffer`)."""
        ref = self._handed.get(id(payload))
        return ref is not None and ref() is payload

    # -- outbound --------------------------------------------------------------

    def _prepare(self, msg: m.Message, corr: int, flags: int) -> _Item:
        if self._pipe is not None and isinstance(msg, m.KVChunk) and not (
                self._other is not None and self._other._is_handed(msg.payload)):
            # Delivery is deferred: snapshot the payload so the caller may reuse it.
            msg = m.KVChunk(msg.span, bytes(memoryview(msg.payload).cast("B")), msg.seq, msg.last)
        n = wire_size(msg)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += n
        if isinstance(msg, m.KVChunk):
            self.stats.kv_bytes_sent += msg.span.nbytes
        return msg, corr, flags, n

    def _shaped(self) -> bool:
        return self._pipe is not None

    async def _transmit(self, msg: m.Message, corr: int, flags: int,
                        priority: Priority = Priority.FOREGROUND) -> float | None:
        other = self._other
        if other is None or other._state == LinkState.CLOSED:
            raise self._closed_error()
        if not await wait_until(other._accepting, self._dead):
            raise self._closed_error()
        if self._pipe is not None and type(msg) is m.TokenBatch:
            now = self._loop.time()
            done = self._book_items(msg, now)
            if done - now >= MIN_SLEEP_S:
                await asyncio.sleep(done - now)        # as `ShapedPipe.put` waits for a control frame
            return done - now
        item = self._prepare(msg, corr, flags)
        if self._pipe is not None:
            return await self._pipe.put(item, item[3], priority, control=not isinstance(msg, m.KVChunk))
        other._receive(item)
        return None

    def _book_items(self, batch: m.TokenBatch, now: float, sizes: list[int] | None = None) -> float:
        """A batch on the shaped wire, item by item at `now` (module docstring) -> the last end.
        `sizes`: the items' wire sizes, when known."""
        pipe = self._pipe
        assert pipe is not None
        sizes = sizes or [wire_size(it) for it in batch.items]
        stats = self.stats
        stats.frames_sent += len(sizes)
        stats.bytes_sent += sum(sizes)
        done = now
        for it, n in zip(batch.items, sizes):
            done = max(done, pipe.put_nowait((it, 0, 0, n), n))
        return done

    def _send_at_once(self, msg: m.Message, priority: PriorityLike, corr: int = 0, flags: int = 0) -> bool:
        """`send` of a frame that would not suspend: any frame but KV on an open link whose
        peer reads, handed over at once (unshaped) or booked as a control frame whose
        serialization needs no sleep (shaped) - `_send_frame`, `_transmit` and `put` step by
        step, without their coroutines (a token costs a few of them per hop otherwise)."""
        other = self._other
        if (self._state != LinkState.OPEN or other is None or other._state == LinkState.CLOSED
                or not other._accepting.is_set() or isinstance(msg, m.KVChunk) or callable(priority)):
            return False
        pipe = self._pipe
        if pipe is None:
            # Foreground never waits on an unshaped link, and its busy count would be back
            # where it was by the time the call returns: nothing to count.
            if priority != Priority.FOREGROUND:
                return False
            other._receive(self._prepare(msg, corr, flags))
            return True
        if pipe.closed:
            return False
        now = self._loop.time()
        shaper = pipe.shaper
        if type(msg) is m.TokenBatch:
            # Item by item (module docstring); `_transmit` when one of them would sleep.
            sizes = [wire_size(it) for it in msg.items]
            if shaper.serialization_end(now, max(sizes)) - now >= MIN_SLEEP_S:
                return False
            self._book_items(msg, now, sizes)
            return True
        n = wire_size(msg)
        if shaper.serialization_end(now, n) - now >= MIN_SLEEP_S:
            return False                  # a slow wire: the sender sleeps for it (`ShapedPipe.put`)
        self.stats.frames_sent += 1
        self.stats.bytes_sent += n
        shaper.control(n, now, pipe, (msg, corr, flags, n))
        return True

    def _transmit_nowait(self, msg: m.Message, corr: int = 0, flags: int = 0) -> None:
        other = self._other
        if self._state != LinkState.OPEN or other is None or other._state != LinkState.OPEN:
            return
        item = self._prepare(msg, corr, flags)
        if self._pipe is not None:
            self._pipe.put_nowait(item, item[3])
        else:
            other._receive(item)

    def _deliver(self, item: _Item) -> None:
        """Shaped arrival at the peer."""
        other = self._other
        if other is not None:
            other._receive(item)

    # -- inbound ---------------------------------------------------------------

    def _receive(self, item: _Item) -> None:
        if self._state != LinkState.OPEN:
            return
        msg, corr, flags, nbytes = item
        owned = 0
        if isinstance(msg, m.KVChunk):
            if self._is_handed(msg.payload):
                del self._handed[id(msg.payload)]        # in its place already: ours now
                self.stats.kv_bytes_handed += msg.span.nbytes
            else:
                dest, owned = sink_buffer(self._kv_sink, msg.span, self.peer)
                dest[:] = memoryview(msg.payload).cast("B")
                msg = m.KVChunk(msg.span, dest, msg.seq, msg.last)
            self.stats.kv_bytes_received += msg.span.nbytes
        self.stats.frames_received += 1
        self.stats.bytes_received += nbytes
        self._on_message(msg, corr, bool(flags & frames.FLAG_REPLY), owned)

    def _heard_since(self, since: float) -> bool:
        # Inbound bytes cross the peer's pipe: bytes of a frame still on the emulated wire count.
        if self._last_rx > since:
            return True
        other = self._other
        return other is not None and other._pipe is not None and other._pipe.heard_since(since)

    def _set_reading(self, on: bool) -> None:
        if on:
            self._accepting.set()
        else:
            self._accepting.clear()

    # -- close -----------------------------------------------------------------

    async def _shutdown_transport(self, code: int, reason: str) -> None:
        if self._pipe is not None:
            self._pipe.close()
            await self._pipe.wait_closed()
        other = self._other
        if other is not None and other._state != LinkState.CLOSED:
            other._lost(LinkClosed(f"peer {self.local} closed: {reason}", code))


def inproc_pair(a: str, b: str, cfg: NetConfig | None = None, shaping: ShapingConfig | None = None,
                shapers: tuple[Shaper | None, Shaper | None] = (None, None)) -> tuple[InProcLink, InProcLink]:
    """Two connected, open links a->b and b->a (both directions shaped alike).

    `shapers`: shared wires for a->b and b->a (None: each direction its own).
    """
    cfg = cfg or NetConfig()
    la, lb = InProcLink(a, b, cfg, shaping, shapers[0]), InProcLink(b, a, cfg, shaping, shapers[1])
    la._other, lb._other = lb, la
    la._set_open()
    lb._set_open()
    return la, lb


class InProcNetwork:
    """The nodes of one process: `listen` registers a node, `connect` links to it."""

    def __init__(self, cfg: NetConfig | None = None) -> None:
        self.cfg = cfg or NetConfig()
        self._listeners: dict[str, tuple[Handler | None, Callable[[InProcLink], None] | None, KvSink | None]] = {}
        self.links: list[InProcLink] = []
        # Wires of `shared` shapings: (link name, from group, to group) -> schedule.
        self.shapers: dict[tuple[str, str, str], Shaper] = {}

    def listen(self, node: str, handler: Handler | None = None, *,
               on_link: Callable[[InProcLink], None] | None = None, kv_sink: KvSink | None = None) -> None:
        """Accept links to `node`; each accepted link gets `handler` / `kv_sink`, then `on_link(link)`."""
        if node in self._listeners:
            raise ValueError(f"node {node!r} is already listening")
        self._listeners[node] = (handler, on_link, kv_sink)

    def unlisten(self, node: str) -> None:
        self._listeners.pop(node, None)

    async def connect(self, local: str, remote: str, *, handler: Handler | None = None,
                      shaping: str | ShapingConfig | None = None, kv_sink: KvSink | None = None,
                      groups: tuple[str, str] | None = None) -> InProcLink:
        """Open a link local -> remote; `shaping` names a `[[net.links]]` entry or is one.

        `groups` (local's, remote's; e.g. their clusters) picks the shared wires
        of a `shared` shaping: every link between the same two groups uses them.
        """
        if remote not in self._listeners:
            raise LinkClosed(f"no node {remote!r} is listening", CloseCode.ABNORMAL)
        shape = self.cfg.shaping(shaping) if isinstance(shaping, str) else shaping
        if isinstance(shaping, str) and shape is None and not any(s.name == shaping for s in self.cfg.links):
            raise ValueError(f"no [[net.links]] entry named {shaping!r}")
        srv_handler, on_link, srv_sink = self._listeners[remote]
        shapers: tuple[Shaper | None, Shaper | None] = (None, None)
        if shape is not None and shape.enabled and shape.shared:
            src, dst = groups or (local, remote)
            shapers = (self._wire(shape, src, dst), self._wire(shape, dst, src))
        client, server = inproc_pair(local, remote, self.cfg, shape, shapers)
        client.set_handler(handler)
        client.set_kv_sink(kv_sink)
        server.set_handler(srv_handler)
        server.set_kv_sink(srv_sink)
        self.links += [client, server]
        if on_link is not None:
            on_link(server)
        return client

    def _wire(self, shape: ShapingConfig, src: str, dst: str) -> Shaper:
        key = (shape.name, src, dst)
        if key not in self.shapers:
            self.shapers[key] = Shaper(shape, asyncio.get_running_loop().time())
        return self.shapers[key]

    async def close(self) -> None:
        links, self.links = self.links, []
        for link in links:
            await link.close(CloseCode.GOING_AWAY, "network closed")
