"""Shaped in-process links on the virtual clock: arrival times exactly as the wire model says.

(The real-socket twins in test_links.py / test_ws.py check only what a loaded machine cannot break:
that shaping is never faster than the wire.)
"""

from __future__ import annotations

import asyncio

from pddgw.config import NetConfig, ShapingConfig
from pddgw.net import messages as m
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
