"""Holding under overload: a saturated shared WAN and the links that cross it.

On the simulator's virtual clock (`run_virtual`), so every time is schedule
arithmetic: a frame of n wire bytes (`wire_size`: the KV payload plus its
headers) takes n * 8 / rate seconds, and arrives one latency after its
serialization ends.

* Liveness counts bytes, not whole frames: a link whose one frame waits 12 s
  behind other links' traffic on a saturated wire is alive (its bytes crawl
  in), while a hung peer on the same wire is dropped at the first heartbeat
  check past `dead_after_s`.
* A control frame never waits behind its own link's preempted background frame.
* A cancelled background transfer's frame that has not started never crosses
  the wire: each byte moves once.
* Over WebSocket the same two rules hold on real connections (a stand-in
  transport): every read counts as the peer alive, and background KV keeps
  off the connection that carries the control frames.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest

from pddgw.config import NetConfig, ShapingConfig
from pddgw import messages as m
from pddgw.net.errors import CloseCode
from pddgw.net.inproc import InProcNetwork, wire_size
from pddgw.net.link import LinkState, Priority
from pddgw.sim.clock import run_virtual

BG = Priority.BACKGROUND


def kv(rid: str, i: int, tokens: int, heads: int = 16) -> m.KVChunk:
    """A virtual KV chunk (no payload; the wire is charged its bytes): 2 * heads * 128 * 2 bytes a token."""
    span = m.KVSpan(rid, 0, 1, i * tokens, (i + 1) * tokens, "float16", (1, 2, tokens, heads, 128), True)
    return m.KVChunk(span, b"", i, False)


class Rx:
    """A receiving node: the loop time each message reached its link."""

    def __init__(self) -> None:
        self.got: list[tuple[float, str, str]] = []     # (time, kind, request id)

    def sink(self, span: m.KVSpan) -> None:
        return None                     # a link buffer (virtual chunks have no payload anyway)

    async def handle(self, link, msg: m.Message) -> None:
        kind = "kv" if isinstance(msg, m.KVChunk) else type(msg).__name__
        rid = msg.span.request_id if isinstance(msg, m.KVChunk) else msg.request_id
        self.got.append((asyncio.get_running_loop().time(), kind, rid))

    def times(self, rid: str, kind: str = "kv") -> list[float]:
        return [t for t, k, r in self.got if r == rid and k == kind]


# 1 Gbps shared by every link A -> B, 15 ms one way; heartbeats every 2 s, dead after 10 s.
WAN = ShapingConfig(name="wan", gbps=1.0, latency_ms=15.0, shared=True)
RATE = 1e9
LAT = 0.015
# 15,625 tokens x 8 KiB = 128,000,000 KV bytes a frame: 1.024 s on the wire plus its headers.
TOKENS = 15_625


def test_a_saturated_wan_drops_no_healthy_link_and_only_a_hung_peer():
    """12 live frames from one link fill the wire for 12.3 s; a second link's single
    frame queued behind them, a third link's background transfer starved by them,
    and a hung fourth link.  Before bytes counted, the queued link's far end heard
    no whole frame for 13.3 s and dropped it at the 12 s heartbeat check."""

    async def main():
        cfg = NetConfig(heartbeat_s=2.0, dead_after_s=10.0, send_timeout_s=600.0, request_timeout_s=600.0,
                        links=(WAN,))
        net = InProcNetwork(cfg)
        rx = Rx()
        accepted = {}
        net.listen("md", rx.handle, kv_sink=rx.sink, on_link=lambda link: accepted.__setitem__(link.peer, link))
        links = {name: await net.connect(name, "md", shaping="wan", groups=("A", "B"))
                 for name in ("live", "p0", "align", "hung")}
        hung = links["hung"]
        hung._heartbeat.cancel()                     # a hung process: no heartbeat...
        hung._transmit_nowait = lambda *a, **k: None  # ...and no pong either
        loop = asyncio.get_running_loop()
        closed_at = {}

        async def watch(name):
            await accepted[name].wait_closed()
            closed_at[name] = (loop.time(), accepted[name]._close_error.code)

        watchers = [asyncio.create_task(watch(n)) for n in accepted]
        sends = [asyncio.create_task(links["live"].send(kv("live", i, TOKENS))) for i in range(12)]
        sends.append(asyncio.create_task(links["p0"].send(kv("p0", 0, TOKENS))))
        sends.append(asyncio.create_task(links["align"].send_all([kv("align", i, TOKENS) for i in range(2)],
                                                                 priority=BG)))
        await asyncio.gather(*sends)
        await asyncio.sleep(1.0)                     # the last frame lands; heartbeats go on
        states = {n: link.state for n, link in accepted.items()}
        end = loop.time()
        dropped = dict(closed_at)
        for w in watchers:
            w.cancel()
        await net.close()
        return rx, states, dropped, end

    rx, states, closed_at, end = run_virtual(main())
    frames = [kv("live", i, TOKENS) for i in range(12)] + [kv("p0", 0, TOKENS)] + \
        [kv("align", i, TOKENS) for i in range(2)]
    sizes = [wire_size(f) for f in frames]
    assert all(128_000_000 < n < 128_000_200 for n in sizes)     # the KV plus its frame headers
    ends = list(itertools.accumulate(n * 8 / RATE for n in sizes))  # 1.024 s apiece, and a little
    # Foreground FIFO: live's 12 frames, then p0's; background fills the wire after them.
    assert rx.times("live") == pytest.approx([e + LAT for e in ends[:12]], abs=1e-9)
    assert rx.times("p0") == pytest.approx([ends[12] + LAT], abs=1e-9)
    assert rx.times("align") == pytest.approx([ends[13] + LAT, ends[14] + LAT], abs=1e-9)
    assert ends[12] == pytest.approx(13 * 1.024, abs=1e-4)       # p0's frame waited 12.3 s
    # Alive all along: the crawling link, the starved background one, the busy one.
    assert states == {"live": LinkState.OPEN, "p0": LinkState.OPEN, "align": LinkState.OPEN,
                      "hung": LinkState.CLOSED}
    # The hung peer sent no byte since the link opened at 0: the heartbeat check at
    # 12 s (every 2 s; 10 s is not past 10 s) is the first to see more than 10 s of silence.
    assert closed_at == {"hung": (12.0, CloseCode.PEER_SILENT)}
    assert end > ends[-1] + LAT


def test_an_outage_is_silence_even_with_frames_queued():
    """Bandwidth 0 from 1 s on: a frame queued then moves no bit, so it is no sign of
    life; both ends drop the link at the first heartbeat check past 10 s of silence."""

    async def main():
        cut = ShapingConfig(name="cut", trace=((0.0, 1.0), (1.0, 0.0)), latency_ms=15.0)
        cfg = NetConfig(heartbeat_s=2.0, dead_after_s=10.0, send_timeout_s=600.0, links=(cut,))
        net = InProcNetwork(cfg)
        rx = Rx()
        net.listen("md", rx.handle, kv_sink=rx.sink)
        link = await net.connect("p", "md", shaping="cut")
        loop = asyncio.get_running_loop()
        await asyncio.sleep(1.5)
        send = asyncio.create_task(link.send(kv("late", 0, TOKENS)))   # queued into the outage
        await link.wait_closed()
        closed = (loop.time(), link._close_error.code)
        send.cancel()                   # its frame would end at the end of time
        await net.close()
        return rx, closed

    rx, (when, code) = run_virtual(main())
    assert rx.times("late") == []
    # The first heartbeats go at 2 s, into the outage: no byte ever crossed after the
    # link opened at 0, and the frame queued at 1.5 s moves no bit.  The check at
    # 12 s is the first to see more than 10 s of silence.
    assert code == CloseCode.PEER_SILENT
    assert when == pytest.approx(12.0, abs=1e-9)


# 100 Mbps, 5 ms one way; 64 tokens x 4 KiB = 256 KiB KV chunks (~21 ms each).
QOS = ShapingConfig(name="emu", gbps=0.1, latency_ms=5.0, shared=True)
QRATE = 0.1e9
QLAT = 0.005


async def _two_links():
    net = InProcNetwork(NetConfig(heartbeat_s=0, send_timeout_s=60.0, links=(QOS,)))
    rx = Rx()
    net.listen("w", rx.handle, kv_sink=rx.sink)
    x = await net.connect("x", "w", shaping="emu", groups=("east", "west"))
    y = await net.connect("y", "w", shaping="emu", groups=("east", "west"))
    return net, rx, x, y, net.shapers[("emu", "east", "west")]


def test_a_control_frame_never_waits_behind_its_links_preempted_background_frame():
    """x's background frame 0 is on the wire when y's live frame preempts it at S/2;
    x's token frame, sent at 3S/4 while x's frame is preempted, arrives one control
    serialization and one latency later, long before the rest of x's frame."""

    async def main():
        net, rx, x, y, _ = await _two_links()
        loop = asyncio.get_running_loop()
        s = wire_size(kv("x", 0, 64, heads=8)) * 8 / QRATE
        bulk = asyncio.create_task(x.send_all([kv("x", i, 64, heads=8) for i in range(2)], priority=BG))
        await asyncio.sleep(s / 2)
        t1 = loop.time()
        live = asyncio.create_task(y.send(kv("y", 0, 64, heads=8)))
        await asyncio.sleep(s / 4)
        t2 = loop.time()
        await x.send(m.TokenItem("x", 0, (7, 8, 9)))
        await asyncio.gather(bulk, live)
        await asyncio.sleep(0.1)
        await net.close()
        return rx, s, t1, t2

    rx, s, t1, t2 = run_virtual(main())
    assert t1 == pytest.approx(s / 2, abs=1e-12) and t2 == pytest.approx(3 * s / 4, abs=1e-12)
    ctl = wire_size(m.TokenItem("x", 0, (7, 8, 9))) * 8 / QRATE
    assert ctl < 1e-5                                           # under 125 bytes
    s0, s1, sy = (wire_size(c) * 8 / QRATE for c in (kv("x", 0, 64, heads=8), kv("x", 1, 64, heads=8),
                                                     kv("y", 0, 64, heads=8)))
    assert s0 == s and sy == s and s1 == pytest.approx(s, rel=1e-4)   # ~21 ms each
    assert rx.times("y") == pytest.approx([t1 + sy + QLAT], abs=1e-12)
    assert rx.times("x", "TokenItem") == pytest.approx([t2 + ctl + QLAT], abs=1e-12)
    # x's frame 0: S/2 before the preemption, the other S/2 after y's frame (t1 + S).
    assert rx.times("x") == pytest.approx([t1 + sy + s0 / 2 + QLAT, t1 + sy + s0 / 2 + s1 + QLAT], abs=1e-12)
    assert rx.times("x", "TokenItem")[0] < rx.times("x")[0] - s


def test_a_cancelled_background_transfer_moves_each_byte_once():
    """y's background frame is on the wire, x's waits behind it when x's transfer is
    cancelled: x's frame leaves the queue unsent and the wire goes on with y's
    next frame at once (it does not idle for x's slot)."""

    async def main():
        net, rx, x, y, wire = await _two_links()
        s = wire_size(kv("y", 0, 64, heads=8)) * 8 / QRATE
        ybulk = asyncio.create_task(y.send_all([kv("y", i, 64, heads=8) for i in range(2)], priority=BG))
        await asyncio.sleep(0)
        xbulk = asyncio.create_task(x.send_all([kv("x", i, 64, heads=8) for i in range(3)], priority=BG))
        await asyncio.sleep(s / 2)
        xbulk.cancel()
        with pytest.raises(asyncio.CancelledError):
            await xbulk
        await ybulk
        await asyncio.sleep(0.1)
        busy = wire.classes[BG].busy_s
        await net.close()
        return rx, s, wire, busy

    rx, s, wire, busy = run_virtual(main())
    frame = wire_size(kv("x", 0, 64, heads=8))
    assert rx.times("x") == []
    # y's frames back to back: its second one was queued (at S, when its first was
    # done) behind x's frame; x's left at S/2, so it starts at S.
    s1 = wire_size(kv("y", 1, 64, heads=8)) * 8 / QRATE
    assert rx.times("y") == pytest.approx([s + QLAT, s + s1 + QLAT], abs=1e-12)
    assert wire.bg_bytes_withdrawn == frame
    assert busy == pytest.approx(s + s1, abs=1e-12)              # only y's two frames were serialized


def test_a_cancelled_frame_already_on_the_wire_finishes_and_nothing_after_it_goes():
    """Cut mid-frame, a frame would leave its far end with half a frame: it finishes;
    the transfer's later frames were never queued."""

    async def main():
        net, rx, x, y, wire = await _two_links()
        s = wire_size(kv("x", 0, 64, heads=8)) * 8 / QRATE
        xbulk = asyncio.create_task(x.send_all([kv("x", i, 64, heads=8) for i in range(3)], priority=BG))
        await asyncio.sleep(s / 2)
        xbulk.cancel()
        with pytest.raises(asyncio.CancelledError):
            await xbulk
        await asyncio.sleep(0.1)
        busy = wire.classes[BG].busy_s
        await net.close()
        return rx, s, wire, busy

    rx, s, wire, busy = run_virtual(main())
    assert rx.times("x") == pytest.approx([s + QLAT], abs=1e-12)
    assert wire.bg_bytes_withdrawn == 0
    assert busy == pytest.approx(s, abs=1e-12)


# ---------------------------------------------------------------------------
# Real sockets count bytes too: a WebSocket connection's reads, on a stand-in transport


class _Transport:
    """What WsConnection needs of a transport; closing tells the protocol, as a real one does."""

    def __init__(self) -> None:
        self.closing = False
        self.proto = None
        self.out: list[bytes] = []       # one entry per write

    def get_extra_info(self, name, default=None):
        return default

    def set_protocol(self, p):
        self.proto = p

    def set_write_buffer_limits(self, high=None, low=None): ...
    def pause_reading(self): ...
    def resume_reading(self): ...
    def get_write_buffer_size(self): return 0

    def write(self, data):
        self.out.append(bytes(data))

    def writelines(self, bufs):
        self.out.append(b"".join(bytes(b) for b in bufs))

    def is_closing(self):
        return self.closing

    def close(self):
        if not self.closing:
            self.closing = True
            asyncio.get_running_loop().call_soon(self.proto.connection_lost, None)

    abort = close


class _Prev:
    def connection_lost(self, exc): ...


def test_a_websocket_link_counts_the_bytes_of_a_frame_still_arriving():
    """A 1 MiB KV frame crawls in over 19 s, 1/20 of it a second, from a peer that sends
    nothing else: the link stays open (before, its last whole frame was the handshake,
    and the 12 s check dropped it), gets the frame whole at 19 s, and is dropped at the
    first check past 10 s of true silence after it: 30 s."""
    from pddgw.net import frames
    from pddgw.net.ws import WsLink
    from pddgw.net.wsproto import ConnState, WsConnection, ws_header

    async def main():
        cfg = NetConfig(secret="test-secret-0123456789", heartbeat_s=2.0, dead_after_s=10.0)
        link = WsLink("cli", "srv", cfg, None)
        conn = WsConnection(_Transport(), _Prev(), client=True, max_frame=cfg.max_frame_bytes,
                            max_control=cfg.max_control_bytes, peer="srv")
        conn.attach()
        conn.state = ConnState.READY
        got = []

        async def handler(lk, msg):
            got.append((asyncio.get_running_loop().time(), msg.span.request_id))

        link.set_handler(handler)
        link._attach([conn])
        span = m.KVSpan("crawl", 0, 1, 0, 256, "float16", (1, 2, 256, 8, 128))     # 1 MiB
        head, payload = frames.encode(m.KVChunk(span, bytes(span.nbytes), 0, True), seq=0)
        wire = ws_header(len(head) + payload.nbytes, False) + head + payload.tobytes()
        step = -(-len(wire) // 20)
        loop = asyncio.get_running_loop()
        for i in range(20):                  # slices at 0, 1, ..., 19 s
            data = memoryview(wire)[i * step:(i + 1) * step]
            while data:
                buf = conn.get_buffer(-1)
                n = min(len(buf), len(data))
                buf[:n] = data[:n]
                data = data[n:]
                conn.buffer_updated(n)
            assert link.state == LinkState.OPEN, loop.time()
            await asyncio.sleep(1.0)
        await asyncio.sleep(29.9 - loop.time())
        before = link.state
        await asyncio.sleep(0.2)
        after = link.state, link._close_error.code
        await link.close()
        return got, before, after

    got, before, after = run_virtual(main())
    assert got == [(19.0, "crawl")]
    assert before == LinkState.OPEN and after == (LinkState.CLOSED, CloseCode.PEER_SILENT)


def test_background_kv_never_takes_the_control_connection_of_a_striped_link():
    """Three stripes: control frames go on the first, background KV on the other two
    only (by stripe, or the least buffered); foreground KV may use any."""
    from pddgw.net.ws import WsLink
    from pddgw.net.wsproto import ConnState, WsConnection

    async def main():
        cfg = NetConfig(secret="test-secret-0123456789", heartbeat_s=0)
        link = WsLink("srv", "cli", cfg, None)
        conns = [WsConnection(_Transport(), _Prev(), client=False, max_frame=cfg.max_frame_bytes,
                              max_control=cfg.max_control_bytes, peer=f"cli/{i}") for i in range(3)]
        for c in conns:
            c.attach()
            c.state = ConnState.READY
        link._attach(conns)
        await link.send_all([kv("bg", i, 64, heads=8) for i in range(4)], priority=BG)
        await link.send(m.TokenItem("t", 0, (1,)))
        await link.send(kv("bg", 9, 64, heads=8), priority=BG)
        writes = [len(c.transport.out) for c in conns]
        await link.send_all([kv("fg", i, 64, heads=8) for i in range(3)])
        fg_writes = [len(c.transport.out) - w for c, w in zip(conns, writes)]
        await link.close()
        return writes, fg_writes

    writes, fg_writes = run_virtual(main())
    # The token alone on stripe 0; the five background frames on stripes 1 and 2 (the
    # stand-in transports never hold bytes, so the first writer takes every frame).
    assert writes == [1, 5, 0]
    assert sum(fg_writes) == 3
