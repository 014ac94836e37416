"""Link semantics, identical over both transports (in-process and WebSocket)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from net_samples import every_message, kv_payload, same

from pddgw.config import NetConfig, ShapingConfig
from pddgw import messages as m
from pddgw.net.errors import CloseCode, LinkClosed, LinkTimeout, RemoteError
from pddgw.net.inproc import InProcLink, InProcNetwork
from pddgw.net.link import Link, LinkState
from pddgw.net.ws import WsServer, connect

SECRET = "test-secret-0123456789"


def cfg_for(**kw) -> NetConfig:
    base = dict(secret=SECRET, heartbeat_s=0, request_timeout_s=5.0, send_timeout_s=5.0)
    base.update(kw)
    return NetConfig(**base)


class Peer:
    """One side's handler: records one-way messages, runs `on_request` for requests."""

    def __init__(self) -> None:
        self.got: list[m.Message] = []
        self.arrived = asyncio.Event()
        self.on_message: Callable | None = None
        self.sink_memory = bytearray(64 << 20)
        self.sink_off = 0

    async def handle(self, link: Link, msg: m.Message):
        if self.on_message is not None:
            result = await self.on_message(link, msg)
            if result is not None:
                return result
        self.got.append(msg)
        self.arrived.set()
        return m.Ack(getattr(msg, "request_id", ""), len(self.got))

    def sink(self, span: m.KVSpan) -> memoryview:
        n = span.nbytes
        if self.sink_off + n > len(self.sink_memory):
            self.sink_off = 0
        view = memoryview(self.sink_memory)[self.sink_off:self.sink_off + n]
        self.sink_off += n
        return view

    async def wait_for(self, count: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.got) < count:
                self.arrived.clear()
                await self.arrived.wait()


class Pair:
    def __init__(self, client: Link, server: Link, cpeer: Peer, speer: Peer, stop) -> None:
        self.client, self.server, self.cpeer, self.speer, self.stop = client, server, cpeer, speer, stop


@pytest.fixture(params=["inproc", "ws"])
async def make_pair(request):
    """-> async factory(cfg, stripes, shaping) of connected (client, server) links; stops all at the end."""
    stops = []

    async def make(cfg: NetConfig | None = None, stripes: int = 1, shaping: str = "") -> Pair:
        cfg = cfg or cfg_for()
        cpeer, speer = Peer(), Peer()
        accepted: asyncio.Future[Link] = asyncio.get_running_loop().create_future()
        if request.param == "inproc":
            net = InProcNetwork(cfg)
            net.listen("srv", speer.handle, on_link=accepted.set_result, kv_sink=speer.sink)
            client = await net.connect("cli", "srv", handler=cpeer.handle, shaping=shaping or None,
                                       kv_sink=cpeer.sink)
            stop = net.close
        else:
            server = WsServer("srv", cfg, speer.handle, on_link=accepted.set_result, kv_sink=speer.sink)
            url = await server.start("127.0.0.1", 0)
            client = await connect(url, "cli", cfg, cpeer.handle, shaping=shaping, kv_sink=cpeer.sink,
                                   stripes=stripes)

            async def stop() -> None:
                await client.close()
                await server.close()
        srv = await accepted
        pair = Pair(client, srv, cpeer, speer, stop)
        stops.append(pair)
        return pair

    yield make
    for pair in stops:
        await pair.stop()
        assert pair.client.state == LinkState.CLOSED and pair.server.state == LinkState.CLOSED
    left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    assert left == [], left


async def test_every_kind_one_way_both_directions(make_pair):
    p = await make_pair()
    kinds = [x for x in every_message() if not isinstance(x, m.Ping | m.Pong)]
    for a, _, peer in ((p.client, p.server, p.speer), (p.server, p.client, p.cpeer)):
        for msg in kinds:
            await a.send(msg)
        # A TokenBatch is split at the receiving edge: its items arrive as if sent alone.
        want = [it for x in kinds for it in (x.items if isinstance(x, m.TokenBatch) else (x,))]
        await peer.wait_for(len(want))
        assert len(peer.got) == len(want)
        assert all(same(x, y) for x, y in zip(peer.got, want)), peer.got
        kv = next(x for x in peer.got if isinstance(x, m.KVChunk))
        assert kv.payload.obj is peer.sink_memory          # landed in the receiver's memory


async def test_a_token_batch_feeds_each_items_stream_or_the_handler(make_pair):
    p = await make_pair()
    pushed: list = []
    a, b = p.server.stream("a", timeout=5), p.server.stream("b", timeout=5)
    b.push(pushed.append)
    await p.client.send(m.TokenBatch((m.TokenItem("a", 0, (1, 2)), m.TokenItem("b", 0, (3,)),
                                      m.TokenItem("x", 4, (5,)), m.TokenItem("b", 1, (), True, "stop"))))
    assert await anext(a) == m.TokenItem("a", 0, (1, 2))
    await p.speer.wait_for(1)
    assert p.speer.got == [m.TokenItem("x", 4, (5,))]             # no stream: the handler's
    assert pushed == [m.TokenItem("b", 0, (3,)), m.TokenItem("b", 1, (), True, "stop")]
    await p.client.send(m.TokenItem("b", 2, (6,)))                 # after the end: the handler's
    await p.speer.wait_for(2)
    assert pushed[-1].done and p.speer.got[-1] == m.TokenItem("b", 2, (6,))
    a.close()
    b.close()


async def test_heartbeat_kinds_are_answered_by_the_link(make_pair):
    p = await make_pair()
    now_ns = round(asyncio.get_running_loop().time() * 1e9)          # links time pings on the loop's clock
    await p.client.send(m.Pong(now_ns - 5 * 10 ** 9))                # a Pong sent 5 s ago
    await p.client.send(m.Ping(now_ns))                              # answered with a Pong
    async with asyncio.timeout(5):
        while p.client.stats.pongs == 0 or p.server.stats.pongs == 0:
            await asyncio.sleep(0.01)
    assert 5.0 <= p.server.stats.rtt_s < 10.0
    # uvloop's clock ticks in milliseconds: a loopback round trip may read 0.
    assert 0.0 <= p.client.stats.rtt_s < 5.0
    assert p.speer.got == [] and p.cpeer.got == []


async def test_every_kind_as_request_and_reply(make_pair):
    p = await make_pair()

    async def echo(link, msg):
        return msg

    p.speer.on_message = echo
    for msg in every_message():
        if isinstance(msg, m.Error):
            with pytest.raises(RemoteError, match="oom: no free KV blocks"):
                await p.client.request(msg)
        else:
            assert same(await p.client.request(msg), msg)


async def test_requests_are_multiplexed(make_pair):
    p = await make_pair()

    async def slow(link, msg):
        await asyncio.sleep(0.01 * (20 - int(msg.request_id)))    # later requests answer first
        return m.Ack(msg.request_id, int(msg.request_id) * 10)

    p.speer.on_message = slow
    replies = await asyncio.gather(*(p.client.request(m.Ready(str(i))) for i in range(20)))
    assert [(r.request_id, r.seq) for r in replies] == [(str(i), i * 10) for i in range(20)]


async def test_handler_failure_becomes_remote_error(make_pair):
    p = await make_pair()

    async def fail(link, msg):
        raise ValueError("bad prompt")

    p.speer.on_message = fail
    with pytest.raises(RemoteError) as ei:
        await p.client.request(m.Ready("r9"))
    assert (ei.value.code, ei.value.message, ei.value.request_id) == ("ValueError", "bad prompt", "r9")


async def _ack(msg):
    return m.Ack(msg.request_id)


async def test_requests_beyond_the_cap_are_refused_overloaded_without_a_task(make_pair):
    with pytest.raises(ValueError, match="max_inflight_requests must be >= 1"):
        cfg_for(max_inflight_requests=0)
    p = await make_pair(cfg_for(max_inflight_requests=3))
    gate, started = asyncio.Event(), []

    async def hold(link, msg):
        started.append(msg.request_id)
        await gate.wait()

    p.speer.on_message = hold
    held = [asyncio.ensure_future(p.client.request(m.Ready(f"r{i}"))) for i in range(3)]
    async with asyncio.timeout(5):
        while len(started) < 3:
            await asyncio.sleep(0.01)
    with pytest.raises(RemoteError) as ei:
        await p.client.request(m.Ready("r3"))
    assert (ei.value.code, ei.value.request_id) == ("overloaded", "r3")
    assert ei.value.message == "srv serves at most 3 requests at once (net.max_inflight_requests)"
    assert started == ["r0", "r1", "r2"] and p.server._serving == 3
    assert sum(t.get_name().endswith(" request") for t in p.server._tasks) == 3
    # A Cancel is served beyond the cap: it frees what the requests in flight hold.
    p.speer.on_message = lambda link, msg: hold(link, msg) if isinstance(msg, m.Ready) else _ack(msg)
    assert (await p.client.request(m.Cancel("r1", "gone"))).request_id == "r1"
    p.speer.on_message = None
    gate.set()
    assert [r.request_id for r in await asyncio.gather(*held)] == ["r0", "r1", "r2"]
    assert (await p.client.request(m.Ready("r4"))).request_id == "r4"
    async with asyncio.timeout(5):
        while p.server._serving:        # the last handler task ends right after its reply
            await asyncio.sleep(0)


async def test_request_timeout_then_link_still_works(make_pair):
    p = await make_pair()
    gate = asyncio.Event()

    async def stall(link, msg):
        if msg.request_id == "slow":
            await gate.wait()
        return None

    p.speer.on_message = stall
    t0 = time.perf_counter()
    with pytest.raises(LinkTimeout, match="no completion within 0.2s"):
        await p.client.request(m.Ready("slow"), timeout=0.2)
    assert time.perf_counter() - t0 < 2.0
    assert (await p.client.request(m.Ready("fast"))).request_id == "fast"
    gate.set()


async def test_stream_in_order_until_done(make_pair):
    p = await make_pair()

    async def produce(link, msg):
        if isinstance(msg, m.Ready):
            for i in range(5):
                await link.send(m.TokenItem(msg.request_id, i, (100 + i,), i == 4, "stop" if i == 4 else ""))
            await link.send(m.TokenItem(msg.request_id, 99, (1,)))   # after done: not part of the stream
            return m.Ack(msg.request_id)
        return None

    p.speer.on_message = produce
    async with p.client.stream("s1", timeout=5) as st:
        await p.client.send(m.Ready("s1"))
        items = [x async for x in st]
    assert [(x.position, x.ids, x.done) for x in items] == [(i, (100 + i,), i == 4) for i in range(5)]
    await p.cpeer.wait_for(1)
    assert p.cpeer.got[0].position == 99          # the stream was closed: the handler got it


async def test_stream_error_and_idle_timeout(make_pair):
    p = await make_pair()

    async def produce(link, msg):
        if isinstance(msg, m.Ready) and msg.detail == "fail":
            await link.send(m.TokenItem(msg.request_id, 0, (7,)))
            await link.send(m.Error(msg.request_id, "md_down", "main decode failed"))
        return m.Ack(msg.request_id)

    p.speer.on_message = produce
    got = []
    with pytest.raises(RemoteError, match="md_down"):
        async with p.client.stream("e1", timeout=5) as st:
            await p.client.send(m.Ready("e1", "fail"))
            async for x in st:
                got.append(x)
    assert [x.ids for x in got] == [(7,)]
    with pytest.raises(LinkTimeout, match="nothing within 0.1s"):
        async with p.client.stream("quiet", timeout=0.1) as st:
            await st.__anext__()
    with pytest.raises(ValueError, match="already open"):
        p.client.stream("dup")
        p.client.stream("dup")


async def test_striped_bulk_keeps_order_and_content(make_pair):
    p = await make_pair(stripes=3)
    span = lambda i: m.KVSpan("bulk", 0, 1, i * 16, (i + 1) * 16, "float16", (1, 2, 16, 8, 128))  # 64 KiB
    chunks = [m.KVChunk(span(i), kv_payload(span(i), salt=i), i, i == 47) for i in range(48)]
    async with p.server.stream("bulk", timeout=5) as st:
        await p.client.send_all(chunks)
        got = [x async for x in st]
    assert [x.seq for x in got] == list(range(48))
    assert all(bytes(x.payload) == bytes(c.payload) for x, c in zip(got, chunks))
    assert p.client.stats.kv_bytes_sent == p.server.stats.kv_bytes_received == 48 * 65536


@pytest.mark.parametrize("shaping", ["", "emu"])
async def test_kv_written_into_the_receivers_buffer_is_handed_over(make_pair, shaping):
    """In-process, `kv_buffer` is the receiver's sink memory: a chunk sent with that view as its
    payload arrives as the very view, copied nowhere (a shaped wire does not snapshot it); one
    with any other payload is copied into the sink as before.  A socket copies anyway: none."""
    cfg = cfg_for(links=(ShapingConfig(name="emu", gbps=10.0, latency_ms=1.0),))
    p = await make_pair(cfg, shaping=shaping)
    span = lambda i: m.KVSpan("hand", 0, 1, i * 16, (i + 1) * 16, "float16", (1, 2, 16, 8, 128))  # 64 KiB
    buf = p.client.kv_buffer(span(0))
    if not isinstance(p.client, InProcLink):
        assert buf is None
        return
    assert p.speer.sink_off == span(0).nbytes            # the receiver's sink gave it, at once
    assert p.client.kv_buffer(m.KVSpan("v", 0, 1, 0, 16, "float16", (1, 2, 16, 8, 128), True)) is None
    buf[:] = kv_payload(span(0), salt=1)
    other = kv_payload(span(1), salt=2)
    async with p.server.stream("hand", timeout=5) as st:
        await p.client.send_all([m.KVChunk(span(0), buf, 0), m.KVChunk(span(1), other, 1, True)])
        got = [x async for x in st]
    assert got[0].payload is buf
    assert got[1].payload is not other and bytes(got[1].payload) == bytes(other)
    assert p.speer.sink_off == 2 * span(0).nbytes        # the second payload's sink buffer
    assert bytes(p.speer.sink_memory[:span(0).nbytes]) == bytes(kv_payload(span(0), salt=1))
    assert (p.server.stats.kv_bytes_received, p.server.stats.kv_bytes_handed) == (2 * 65536, 65536)


async def test_back_pressure_blocks_the_sender_and_loses_nothing(make_pair):
    p = await make_pair(cfg_for(max_frame_bytes=1 << 20, inbound_buffer_bytes=1 << 20))
    gate = asyncio.Event()

    async def stall(link, msg):
        await gate.wait()       # the receiver's handler does not keep up

    p.speer.on_message = stall
    p.server.set_kv_sink(None)  # payloads held by the link count against its inbound buffer
    span = lambda i: m.KVSpan("bp", 0, 1, i * 16, (i + 1) * 16, "float16", (1, 2, 16, 8, 128))
    payload = bytes(65536)
    sent = 0

    def chunks():
        nonlocal sent
        for i in range(800):                     # 52 MB: more than every socket buffer in between
            yield m.KVChunk(span(i), payload, i)
            sent += 1

    with pytest.raises(LinkTimeout):
        await p.client.send_all(chunks(), timeout=1.0)
    assert sent < 800
    p.speer.on_message = None
    gate.set()
    async with asyncio.timeout(5):
        while not p.speer.got or p.speer.got[-1].seq < sent - 2:
            await asyncio.sleep(0.02)
    seqs = [x.seq for x in p.speer.got]
    assert seqs == list(range(len(seqs))) and len(seqs) >= sent - 1    # in order, none lost


async def test_close_fails_what_is_in_flight(make_pair):
    p = await make_pair()

    async def never(link, msg):
        await asyncio.Event().wait()

    p.speer.on_message = never
    pending = asyncio.ensure_future(p.client.request(m.Ready("x"), timeout=10))
    stream = p.client.stream("y", timeout=10)
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    await p.server.close(CloseCode.GOING_AWAY, "draining")
    with pytest.raises(LinkClosed) as ei:
        await pending
    assert ei.value.code == CloseCode.GOING_AWAY
    with pytest.raises(LinkClosed):
        await stream.__anext__()
    assert time.perf_counter() - t0 < 2.0
    stream.close()
    with pytest.raises(LinkClosed):
        await p.server.send(m.Ready("z"))


async def test_shaping_accuracy_10MB_over_100Mbps_20ms_rtt(make_pair):
    cfg = cfg_for(links=(ShapingConfig(name="emu", gbps=0.1, latency_ms=10.0),))
    p = await make_pair(cfg, shaping="emu")
    span = lambda i: m.KVSpan("big", 0, 1, i * 250, (i + 1) * 250, "float32", (1, 2, 250, 10, 50))  # 1 MB
    payload = bytes(1_000_000)
    done = asyncio.get_running_loop().create_future()

    async def on_kv(link, msg):
        if isinstance(msg, m.KVChunk) and msg.last:
            done.set_result(time.perf_counter())

    p.speer.on_message = on_kv
    t0 = time.perf_counter()
    await p.client.send_all(m.KVChunk(span(i), payload, i, i == 9) for i in range(10))
    elapsed = await asyncio.wait_for(done, 5) - t0
    # Never faster than the wire (its bytes at 100 Mbps + 10 ms); how much slower is the machine's
    # load, not shaping: the exact arrival is pinned on the virtual clock (test_shaping_virtual.py).
    assert elapsed >= 0.80, elapsed   # 0.81 s less timer slack


async def test_shaped_latency_is_paid_both_ways(make_pair):
    cfg = cfg_for(links=(ShapingConfig(name="far", latency_ms=40.0),))
    p = await make_pair(cfg, shaping="far")
    t0 = time.perf_counter()
    await p.client.request(m.Ready("rtt"))
    # 2 x 40 ms, less a few ms: uvloop's clock is cached per loop iteration, so a
    # delivery scheduled from a stale "now" may fire slightly early under load.
    assert time.perf_counter() - t0 >= 0.07


async def test_silent_peer_is_detected_by_heartbeats():
    """A link whose bandwidth drops to zero (emulated outage) goes silent: pending work fails."""
    cfg = cfg_for(heartbeat_s=0.05, dead_after_s=0.3,
                  links=(ShapingConfig(name="cut", trace=((0.0, 1.0), (0.2, 0.0))),))
    net = InProcNetwork(cfg)
    net.listen("srv", lambda link, msg: asyncio.Event().wait())
    client = await net.connect("cli", "srv", shaping="cut")
    t0 = time.perf_counter()
    with pytest.raises(LinkClosed) as ei:
        await client.request(m.Ready("r"), timeout=5)
    assert ei.value.code == CloseCode.PEER_SILENT
    assert time.perf_counter() - t0 < 2.0
    await net.close()
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []


async def test_inproc_network_connect_errors():
    # An emulated WAN given explicitly: the default "wan" entry has no figures of
    # its own (the embedded deployment derives them, deploy/regime.py).
    net = InProcNetwork(cfg_for(links=(ShapingConfig(name="wan", gbps=0.004, latency_ms=15.0),)))
    with pytest.raises(LinkClosed, match="no node 'ghost' is listening"):
        await net.connect("cli", "ghost")
    net.listen("srv")
    with pytest.raises(ValueError, match="already listening"):
        net.listen("srv")
    with pytest.raises(ValueError, match="no \\[\\[net.links\\]\\] entry named 'nope'"):
        await net.connect("cli", "srv", shaping="nope")
    link = await net.connect("cli", "srv", shaping="wan")
    assert link._pipe is not None and link._pipe.shaper.cfg == net.cfg.shaping("wan")
    await net.close()


@pytest.mark.parametrize("make_pair", ["ws"], indirect=True)
async def test_shaped_link_foreground_overtakes_background(make_pair):
    """Over WebSocket, live KV preempts a background transfer on the emulated wire.

    Over WebSocket a frame is numbered when it leaves the wire, so the receiver
    (which restores frame order by number) does not hold it back.  Real time: the
    live send must happen while bulk chunk 1 is on the wire, so each chunk takes
    ~0.65 s (a loaded machine's scheduling delay stays far below); in-process links
    and the exact arrival times are tests/net/test_shaping_virtual.py's, on the
    virtual clock.
    """
    from pddgw.net import frames
    from pddgw.net.link import Priority
    from pddgw.net.wsproto import ws_header_size

    # 16 KiB chunks take 655 ms each at 0.2 Mbps: the live transfer, sent when the first
    # bulk chunk has arrived (660 ms), finds the second one on the wire.
    cfg = cfg_for(links=(ShapingConfig(name="emu", gbps=0.0002, latency_ms=5.0),))
    p = await make_pair(cfg, stripes=2, shaping="emu")
    span = lambda rid, i: m.KVSpan(rid, 0, 1, i * 4, (i + 1) * 4, "float16", (1, 2, 4, 8, 128))
    bulk = [m.KVChunk(span("bulk", i), kv_payload(span("bulk", i), salt=i), i, i == 3) for i in range(4)]
    live = [m.KVChunk(span("live", i), kv_payload(span("live", i), salt=50 + i), i, i == 1) for i in range(2)]
    background = asyncio.ensure_future(p.client.send_all(bulk, priority=Priority.BACKGROUND))
    await p.speer.wait_for(1)
    live_service = await p.client.send_all(live)
    bulk_service = await background
    await p.speer.wait_for(6, timeout=30.0)
    assert [(x.span.request_id, x.seq) for x in p.speer.got] == [
        ("bulk", 0), ("live", 0), ("live", 1), ("bulk", 1), ("bulk", 2), ("bulk", 3)]
    by_id = {(x.span.request_id, x.seq): bytes(x.payload) for x in p.speer.got}
    assert all(by_id[(c.span.request_id, c.seq)] == bytes(c.payload) for c in bulk + live)

    def wire(c: m.KVChunk) -> int:
        head, payload = frames.encode(c)
        n = len(head) + payload.nbytes
        return ws_header_size(n, masked=True) + n

    # Service seconds are the frames' own serialization times (bulk chunk 1 was preempted).
    assert live_service == pytest.approx(sum(wire(c) for c in live) * 8 / 2e5, rel=1e-9)
    assert bulk_service == pytest.approx(sum(wire(c) for c in bulk) * 8 / 2e5, rel=1e-9)
