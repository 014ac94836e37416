"""Shaped in-process links on the virtual clock: arrival times exactly as the wire model says.

(The real-socket twins in test_links.py / test_ws.py check only what a loaded machine cannot break:
that shaping is never faster than the wire.)
"""

from __future__ import annotations

import asyncio

import pytest

from pddgw.config import NetConfig, ShapingConfig
from pddgw import messages as m
from pddgw.net.errors import LinkTimeout
from pddgw.net.inproc import InProcNetwork, wire_size
from pddgw.sim.clock import run_virtual

SECRET = "s" * 32


def _cfg(*links: ShapingConfig) -> NetConfig:
    return NetConfig(secret=SECRET, heartbeat_s=0, request_timeout_s=5.0, send_timeout_s=5.0, links=links)


def test_10MB_over_100Mbps_arrives_after_its_bytes_and_one_way_latency():
    msgs = [m.KVChunk(m.KVSpan("big", 0, 1, i * 250, (i + 1) * 250, "float32", (1, 2, 250, 10, 50)),
                      bytes(1_000_000), i, i == 9) for i in range(10)]                     # 1 MB each

    async def main() -> float:
        net = InProcNetwork(_cfg(ShapingConfig(name="emu", gbps=0.1, latency_ms=10.0)))
        loop = asyncio.get_running_loop()
        last: asyncio.Future[float] = loop.create_future()

        async def handle(link, msg):
            if isinstance(msg, m.KVChunk) and msg.last:
                last.set_result(loop.time())

        net.listen("srv", handle)
        client = await net.connect("cli", "srv", shaping="emu")
        t0 = loop.time()
        await client.send_all(msgs)
        arrived = await last
        await net.close()
        return arrived - t0

    wire = sum(wire_size(x) for x in msgs)
    assert wire == 10_001_940                        # payloads + headers + WebSocket framing
    assert run_virtual(main()) == wire * 8 / 0.1e9 + 0.010


def test_a_request_pays_the_latency_both_ways():
    async def main() -> float:
        net = InProcNetwork(_cfg(ShapingConfig(name="far", latency_ms=40.0)))    # unlimited bandwidth

        async def ack(link, msg):
            return m.Ack(msg.request_id, 1, "ok")

        net.listen("srv", ack)
        client = await net.connect("cli", "srv", shaping="far")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        reply = await client.request(m.Ready("rtt"))
        took = loop.time() - t0
        await net.close()
        assert reply == m.Ack("rtt", 1, "ok")
        return took

    assert run_virtual(main()) == 2 * 0.040


@pytest.mark.parametrize("gbps", [0.001, 10.0])       # the sender waits for the wire / it does not
def test_a_token_batch_crosses_a_shaped_wire_as_its_items_would_alone(gbps):
    """Each item is booked at the send's instant at its own TokenItem size: the arrivals, the
    frame and byte counts are those of one frame per item (inproc.py's docstring)."""
    items = [m.TokenItem(f"r{i}", 7 * i, tuple(range(i + 1)), i == 2, "stop" if i == 2 else "") for i in range(3)]

    async def main(batched: bool) -> tuple[list[tuple[float, m.TokenItem]], int, int]:
        net = InProcNetwork(_cfg(ShapingConfig(name="wan", gbps=gbps, latency_ms=15.0)))
        loop = asyncio.get_running_loop()
        got: list[tuple[float, m.TokenItem]] = []

        async def handle(link, msg):
            got.append((loop.time(), msg))

        net.listen("srv", handle)
        client = await net.connect("cli", "srv", shaping="wan")
        if batched:
            await client.send(m.TokenBatch(tuple(items)))
        else:
            await asyncio.gather(*(client.send(it) for it in items))   # at one instant, as tasks did
        await asyncio.sleep(1.0)
        stats = client.stats.frames_sent, client.stats.bytes_sent
        await net.close()
        return got, *stats

    alone, batch = run_virtual(main(False)), run_virtual(main(True))
    assert batch == alone
    assert [msg for _, msg in batch[0]] == items
    assert batch[1:] == (3, sum(wire_size(it) for it in items))
    if gbps < 1:       # (on a fast wire frames due within the clock's resolution land together)
        assert batch[0][2][0] == wire_size(items[2]) * 8 / (gbps * 1e9) + 0.015    # its own bytes


def test_live_kv_overtakes_a_background_transfer_at_the_chunk_boundary():
    """Live KV sent while a background chunk is on the wire goes right after that chunk; the rest
    of the background transfer follows; each side's service time is its own frames' time."""
    from pddgw.net.link import Priority

    span = lambda rid, i: m.KVSpan(rid, 0, 1, i * 4, (i + 1) * 4, "float16", (1, 2, 4, 8, 128))
    bulk = [m.KVChunk(span("bulk", i), bytes(16384), i, i == 3) for i in range(4)]
    live = [m.KVChunk(span("live", i), bytes(16384), i, i == 1) for i in range(2)]
    chunk_s = wire_size(bulk[0]) * 8 / 2e6                       # ~65 ms at 2 Mbps

    async def main():
        net = InProcNetwork(_cfg(ShapingConfig(name="emu", gbps=0.002, latency_ms=5.0)))
        loop = asyncio.get_running_loop()
        got: list[tuple[str, int, float]] = []
        first = loop.create_future()
        memory = bytearray(1 << 20)

        async def handle(link, msg):
            got.append((msg.span.request_id, msg.seq, loop.time()))
            if not first.done():
                first.set_result(None)

        net.listen("srv", handle, kv_sink=lambda s: memoryview(memory)[:s.nbytes])
        client = await net.connect("cli", "srv", shaping="emu")
        t0 = loop.time()
        background = asyncio.ensure_future(client.send_all(bulk, priority=Priority.BACKGROUND))
        await first                                   # bulk 0 arrived: bulk 1 is on the wire
        live_service = await client.send_all(live)
        bulk_service = await background
        await asyncio.sleep(1.0)
        await net.close()
        return t0, got, live_service, bulk_service

    t0, got, live_service, bulk_service = run_virtual(main())
    assert [(rid, seq) for rid, seq, _ in got] == [
        ("bulk", 0), ("live", 0), ("live", 1), ("bulk", 1), ("bulk", 2), ("bulk", 3)]
    # Arrivals in chunk times after the 5 ms latency: live is sent when bulk 0 arrives (1 chunk +
    # 5 ms) and preempts bulk 1 on the wire; bulk 1 then finishes its remaining part, the wire
    # busy throughout, so the last chunk arrives after 6 chunk times as without live traffic.
    late = 0.005 / chunk_s
    assert [(t - t0 - 0.005) / chunk_s for _, _, t in got] == pytest.approx(
        [1, 2 + late, 3 + late, 4, 5, 6], abs=1e-3)
    assert live_service == pytest.approx(sum(wire_size(c) for c in live) * 8 / 2e6, rel=1e-9)
    assert bulk_service == pytest.approx(sum(wire_size(c) for c in bulk) * 8 / 2e6, rel=1e-9)


def test_send_all_times_each_frame_so_a_batch_may_outlast_the_timeout():
    """`send_timeout_s` bounds each frame's wait: 10 MB over 10 Mbps (8 s) with a 5 s timeout
    arrives whole, 0.8 s a frame; a frame that cannot go out for 5 s fails the batch."""
    def chunk(rid: str, i: int, last: bool) -> m.KVChunk:
        return m.KVChunk(m.KVSpan(rid, 0, 1, i * 250, (i + 1) * 250, "float32", (1, 2, 250, 10, 50)),
                         bytes(1_000_000), i, last)

    async def main() -> tuple[float, str]:
        net = InProcNetwork(_cfg(ShapingConfig(name="slow", gbps=0.01)))
        loop = asyncio.get_running_loop()
        got: list[int] = []

        async def handle(link, msg):
            if isinstance(msg, m.KVChunk):
                got.append(msg.seq)

        net.listen("srv", handle)
        client = await net.connect("cli", "srv", shaping="slow")
        t0 = loop.time()
        await client.send_all([chunk("big", i, i == 9) for i in range(10)])
        took = loop.time() - t0
        assert got == list(range(10))
        # A 7 MB frame takes 5.6 s on the wire: past the deadline, the batch fails.
        huge = m.KVChunk(m.KVSpan("huge", 0, 1, 0, 1750, "float32", (1, 2, 1750, 10, 50)), bytes(7_000_000), 0, True)
        try:
            await client.send_all([chunk("huge0", 0, False), huge])
            err = ""
        except LinkTimeout as e:
            err = str(e)
        await net.close()
        return took, err

    took, err = run_virtual(main())
    assert 8.0 < took < 8.01                                      # 10 x 1,000,194 wire bytes at 10 Mbps
    assert err == "a send_all frame to srv: no completion within 5.0s"
