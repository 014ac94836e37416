"""WAN QoS: two traffic classes on every link and every shared emulated wire.

Timing tests run on the simulator's virtual clock (`run_virtual`): times are
exact schedule arithmetic (frame sizes from `wire_size`, the bandwidth of the
config), not wall-clock windows.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest

from pddgw.config import NetConfig, ShapingConfig
from pddgw import messages as m
from pddgw.net.errors import LinkClosed
from pddgw.net.inproc import InProcNetwork, inproc_pair, wire_size
from pddgw.net.link import Priority
from pddgw.net.shaping import Shaper
from pddgw.sim.clock import run_virtual

FG, BG = Priority.FOREGROUND, Priority.BACKGROUND
TOKENS = 64                                   # 64 tokens x 4 KiB = 256 KiB per chunk
GBPS = 0.1
LATENCY = 0.005


def chunks(rid: str, n: int, tokens: int = TOKENS, virtual: bool = False) -> list[m.KVChunk]:
    out = []
    for i in range(n):
        span = m.KVSpan(rid, 0, 1, i * tokens, (i + 1) * tokens, "float16", (1, 2, tokens, 8, 128), virtual)
        payload = b"" if virtual else random.Random(f"{rid}/{i}").randbytes(span.nbytes)
        out.append(m.KVChunk(span, payload, i, i == n - 1))
    return out


def secs(msgs: list[m.KVChunk], gbps: float = GBPS) -> list[float]:
    """Serialization time of each frame on a wire of `gbps`."""
    return [wire_size(c) * 8 / (gbps * 1e9) for c in msgs]


def ends(start: float, durations: list[float]) -> list[float]:
    """Back-to-back frames from `start` -> their serialization ends."""
    return [start + s for s in itertools.accumulate(durations)]


class Rx:
    """A receiving node: when each KV chunk arrived (its sink is called on arrival) and what."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, str, int]] = []     # (time, request id, chunk index)
        self.msgs: list[m.Message] = []

    def sink(self, span: m.KVSpan) -> None:
        tokens = span.token_end - span.token_start
        self.arrivals.append((asyncio.get_running_loop().time(), span.request_id, span.token_start // tokens))

    async def handle(self, link, msg: m.Message) -> None:
        self.msgs.append(msg)

    def times(self, rid: str) -> list[float]:
        return [t for t, r, _ in self.arrivals if r == rid]

    def order(self) -> list[tuple[str, int]]:
        return [(r, i) for _, r, i in self.arrivals]


async def shared_wire(shaping: ShapingConfig, *pairs: tuple[str, str]):
    """-> (network, {sender: link}, {receiver: Rx}, the shared Shaper) for links east -> west."""
    net = InProcNetwork(NetConfig(heartbeat_s=0, send_timeout_s=60.0, links=(shaping,)))
    links, rx = {}, {}
    for src, dst in pairs:
        rx[dst] = Rx()
        net.listen(dst, rx[dst].handle, kv_sink=rx[dst].sink)
        links[src] = await net.connect(src, dst, shaping=shaping.name, groups=("east", "west"))
    return net, links, rx, net.shapers[(shaping.name, "east", "west")]


async def at(t: float, coro):
    """Run `coro` at virtual time `t`."""
    await asyncio.sleep(t - asyncio.get_running_loop().time())
    return await coro


WAN = ShapingConfig(name="wan", gbps=GBPS, latency_ms=LATENCY * 1e3, shared=True)


# -- strict priority with preemption on a shared wire ------------------------------


def _bulk_then_live(bulk_priority: Priority):
    """20 chunks on link a from t=0, 5 on link b from t=0.1, one shared 100 Mbps wire."""
    bulk, live = chunks("bulk", 20), chunks("live", 5)

    async def main():
        net, links, rx, shaper = await shared_wire(WAN, ("a", "ra"), ("b", "rb"))
        probe = {}

        async def look():
            probe["fg"], probe["bg"] = shaper.queued_bytes(FG), shaper.queued_bytes(BG)

        a = asyncio.create_task(links["a"].send_all(bulk, priority=bulk_priority))
        b = asyncio.create_task(at(0.1, links["b"].send_all(live)))
        probe_at = 0.1 + secs(live)[0] / 2
        p = asyncio.create_task(at(probe_at, look()))
        services = (await a, await b)
        await p
        await asyncio.sleep(0.1)                         # the last frames land
        await net.close()
        return services, rx, shaper, probe

    return bulk, live, run_virtual(main())


def test_foreground_preempts_background_on_a_shared_wire():
    bulk, live, ((a_service, b_service), rx, shaper, probe) = _bulk_then_live(BG)
    sa, sb = secs(bulk), secs(live)
    # The live transfer sees a foreground-only wire: back to back from t = 0.1.
    assert rx["rb"].times("live") == pytest.approx([t + LATENCY for t in ends(0.1, sb)], rel=1e-12)
    assert shaper.bg_bytes_ahead_of_fg == 0
    # The bulk transfer is delayed by exactly the live bytes, none of its own is lost or resent:
    # the wire never idles, so its last chunk leaves when all bytes of both have been serialized.
    assert rx["ra"].times("bulk")[-1] == pytest.approx(sum(sa) + sum(sb) + LATENCY, rel=1e-12)
    assert rx["ra"].times("bulk")[-1] > rx["rb"].times("live")[-1]
    got = [x for x in rx["ra"].msgs if isinstance(x, m.KVChunk)]
    assert [x.seq for x in got] == list(range(20))
    assert all(bytes(x.payload) == bytes(c.payload) for x, c in zip(got, bulk))
    # Service seconds: each transfer's own serialization time, not the time it waited.
    assert a_service == pytest.approx(sum(sa), rel=1e-12)
    assert b_service == pytest.approx(sum(sb), rel=1e-12)
    # Per-class accounting; the totals keep their old names.
    bg, fg = shaper.classes[BG], shaper.classes[FG]
    assert (bg.frames, bg.bytes_booked) == (20, sum(wire_size(c) for c in bulk))
    assert (fg.frames, fg.bytes_booked) == (5, sum(wire_size(c) for c in live))
    assert (bg.busy_s, fg.busy_s) == (pytest.approx(sum(sa), rel=1e-12), pytest.approx(sum(sb), rel=1e-12))
    assert shaper.bytes_booked == bg.bytes_booked + fg.bytes_booked
    assert shaper.busy_s == pytest.approx(sum(sa) + sum(sb), rel=1e-12)
    # Mid first live frame: half of it is still to go; the preempted bulk frame waits with
    # what it had not sent at t = 0.1 (bulk frames are back to back from t = 0).
    k = next(i for i, t in enumerate(ends(0.0, sa)) if t > 0.1)
    left = (ends(0.0, sa)[k] - 0.1) * GBPS * 1e9 / 8
    assert probe["fg"] == pytest.approx(wire_size(live[0]) / 2, abs=1)
    assert probe["bg"] == pytest.approx(left, abs=1)
    assert shaper.queued_bytes(FG, now=1e6) == shaper.queued_bytes(BG, now=1e6) == 0


def test_the_same_transfers_all_foreground_share_the_wire_fifo():
    bulk, live, ((a_service, b_service), rx, shaper, _) = _bulk_then_live(FG)
    sa, sb = secs(bulk), secs(live)
    # The live frame queued at 0.1 waits for the bulk frame on the wire; then each
    # sender's next frame queues behind the other's: they alternate.
    bulk_ends = ends(0.0, sa)
    k = next(i for i, t in enumerate(bulk_ends) if t > 0.1)
    expected = [bulk_ends[k] + sum(sb[:i + 1]) + sum(sa[k + 1:k + 1 + i]) for i in range(5)]
    assert rx["rb"].times("live") == pytest.approx([t + LATENCY for t in expected], rel=1e-12)
    assert rx["rb"].times("live")[0] > 0.1 + sb[0] + LATENCY      # later than with priority
    assert rx["ra"].times("bulk")[-1] == pytest.approx(sum(sa) + sum(sb) + LATENCY, rel=1e-12)
    assert (a_service, b_service) == (pytest.approx(sum(sa), rel=1e-12), pytest.approx(sum(sb), rel=1e-12))
    assert shaper.classes[BG].frames == 0 and shaper.bg_bytes_ahead_of_fg == 0


# -- priority as a callable: demotion mid-transfer -------------------------------------


def test_demoting_a_transfer_mid_way_lets_a_later_foreground_transfer_overtake():
    old, new = chunks("old", 10), chunks("new", 3)
    so, sn = secs(old), secs(new)
    cls = {"old": FG}
    reads = []

    def priority() -> Priority:
        reads.append(asyncio.get_running_loop().time())
        return cls["old"]

    async def demote_then_send(link):
        cls["old"] = BG                       # nobody waits for "old" any more
        return await link.send_all(new)

    async def main():
        net, links, rx, _ = await shared_wire(WAN, ("a", "ra"))
        flip = sum(so[:3]) + so[3] / 2      # mid fourth frame
        task = asyncio.create_task(links["a"].send_all(old, priority=priority))
        await at(flip, demote_then_send(links["a"]))
        await task
        await asyncio.sleep(0.1)
        await net.close()
        return rx["ra"]

    rx = run_virtual(main())
    # The fourth frame was handed over as foreground and finishes; the other six wait.
    assert rx.order() == ([("old", i) for i in range(4)] + [("new", i) for i in range(3)]
                          + [("old", i) for i in range(4, 10)])
    assert len(reads) == 10                  # read once per frame, when the frame is handed over
    assert reads[:5] == pytest.approx([0.0] + ends(0.0, so[:4]), rel=1e-12)
    # The new transfer sees a foreground-only wire after the fourth frame.
    assert rx.times("new") == pytest.approx([t + LATENCY for t in ends(sum(so[:4]), sn)], rel=1e-12)
    assert rx.times("old")[-1] == pytest.approx(sum(so) + sum(sn) + LATENCY, rel=1e-12)


# -- delivery order ------------------------------------------------------------------


def test_per_pipe_order_within_a_class_and_foreground_overtakes_background():
    jittery = ShapingConfig(name="wan", gbps=GBPS, latency_ms=10.0, jitter_ms=5.0, seed=3, shared=True)
    a_bg, a_fg, b_bg, b_fg = chunks("a-bg", 8), chunks("a-fg", 3), chunks("b-bg", 6), chunks("b-fg", 4)
    s = secs(a_bg)[0]

    async def main():
        net, links, rx, shaper = await shared_wire(jittery, ("a", "ra"), ("b", "rb"))
        await asyncio.gather(
            links["a"].send_all(a_bg, priority=BG),
            links["b"].send_all(b_bg, priority=BG),
            at(2.5 * s, links["a"].send_all(a_fg)),
            at(4.2 * s, links["b"].send_all(b_fg)),
        )
        await asyncio.sleep(0.1)
        await net.close()
        return rx, shaper

    rx, shaper = run_virtual(main())
    for dst, (bg, n_bg), (fg, n_fg) in (("ra", ("a-bg", 8), ("a-fg", 3)), ("rb", ("b-bg", 6), ("b-fg", 4))):
        r = rx[dst]
        times = [t for t, _, _ in r.arrivals]
        assert times == sorted(times)                                # jitter never reorders a pipe
        assert [i for x, i in r.order() if x == bg] == list(range(n_bg))
        assert [i for x, i in r.order() if x == fg] == list(range(n_fg))
        kinds = [x for x, _ in r.order()]
        first_fg, last_fg = kinds.index(fg), len(kinds) - 1 - kinds[::-1].index(fg)
        # The foreground frames arrive together, between background frames queued before them.
        assert 0 < first_fg and last_fg < len(kinds) - 1
        assert kinds[first_fg:last_fg + 1] == [fg] * (last_fg - first_fg + 1)
    assert shaper.bg_bytes_ahead_of_fg == 0


# -- service seconds: the bandwidth sample -----------------------------------------


def test_service_seconds_track_a_trace_step_down_and_up_while_queued_behind_other_traffic():
    trace = ShapingConfig(name="wan", trace=((0.0, 0.8), (1.0, 0.2), (2.0, 0.8)), latency_ms=1.0, shared=True)
    flood_chunk = chunks("flood", 1, tokens=25, virtual=True)[0]
    batches = {t: chunks(f"probe-{t}", 4, tokens=25) for t in (0.5, 1.5, 2.5)}

    async def main():
        net, links, _, _ = await shared_wire(trace, ("x", "rx"), ("y", "ry"))
        stop = False

        def flood():
            while not stop:
                yield flood_chunk

        flooding = asyncio.create_task(links["x"].send_all(flood()))
        samples = {}
        for t, batch in batches.items():
            await asyncio.sleep(t - asyncio.get_running_loop().time())
            t0 = asyncio.get_running_loop().time()
            service = await links["y"].send_all(batch)
            samples[t] = (service, asyncio.get_running_loop().time() - t0)
        stop = True
        await flooding
        await net.close()
        return samples

    samples = run_virtual(main())
    for t, gbps in ((0.5, 0.8), (1.5, 0.2), (2.5, 0.8)):
        service, elapsed = samples[t]
        nbytes = sum(wire_size(c) for c in batches[t])
        assert service == pytest.approx(nbytes * 8 / (gbps * 1e9), rel=1e-9)
        assert nbytes / service == pytest.approx(gbps * 1e9 / 8, rel=1e-9)     # the wire's rate
        assert elapsed > 1.5 * service          # it really queued behind the flood (FIFO, same class)


def test_bits_between_inverts_serialization_end_across_trace_steps():
    s = Shaper(ShapingConfig(trace=((0.0, 1.0), (0.5, 0.25), (0.7, 2.0)), trace_period_s=1.0), t0=3.0)
    for start in (3.0, 3.2, 3.49, 3.6, 3.95, 4.45):
        for nbytes in (1, 1000, 125_000_000, 400_000_000):
            end = s.serialization_end(start, nbytes)
            assert s.bits_between(start, end) == pytest.approx(nbytes * 8, rel=1e-9, abs=1e-5)  # time ulps
    assert s.bits_between(3.4, 3.6) == pytest.approx(0.1e9 + 0.1 * 0.25e9)
    assert s.bits_between(5.0, 5.0) == 0


# -- a cut cable -------------------------------------------------------------------


def test_closing_one_link_drops_its_queued_frames_only():
    a_bg, b_bg = chunks("a", 10), chunks("b", 6)
    sa, sb = secs(a_bg), secs(b_bg)

    async def main():
        net, links, rx, shaper = await shared_wire(WAN, ("a", "ra"), ("b", "rb"))
        a = asyncio.create_task(links["a"].send_all(a_bg, priority=BG))
        b = asyncio.create_task(links["b"].send_all(b_bg, priority=BG))
        await asyncio.sleep(2.5 * sa[0])
        await links["a"].close()
        with pytest.raises(LinkClosed):
            await a
        b_service = await b
        await asyncio.sleep(0.1)
        left = (shaper.queued_bytes(BG), shaper._timer)
        await net.close()
        return rx, shaper, b_service, left

    rx, shaper, b_service, left = run_virtual(main())
    got = [x for x in rx["rb"].msgs if isinstance(x, m.KVChunk)]
    assert [x.seq for x in got] == list(range(6))
    assert all(bytes(x.payload) == bytes(c.payload) for x, c in zip(got, b_bg))
    assert b_service == pytest.approx(sum(sb), rel=1e-12)
    # The wire never idled until b's last frame left, and a's dropped bytes were never serialized.
    assert rx["rb"].times("b")[-1] == pytest.approx(shaper.busy_s + LATENCY, rel=1e-12)
    assert shaper.busy_s < sum(sa) + sum(sb)
    assert len(rx["ra"].arrivals) < 10
    assert left == (0, None)


# -- unshaped links: the gate -----------------------------------------------------------


def test_unshaped_background_frame_waits_while_a_foreground_frame_is_in_transmit():
    async def main():
        a, b = inproc_pair("a", "b", NetConfig(heartbeat_s=0))
        got = []

        async def handle(link, msg):
            got.append(msg.request_id)

        b.set_handler(handle)
        entered = []
        transmit = a._transmit

        async def spy(msg, corr, flags, priority=FG, **kw):
            entered.append((msg.request_id, priority))
            return await transmit(msg, corr, flags, priority, **kw)

        a._transmit = spy
        b._set_reading(False)                      # the receiver stalls: a frame stays inside _transmit
        fg = asyncio.create_task(a.send(m.Ready("fg-1")))
        await asyncio.sleep(0)
        bg = asyncio.create_task(a.send_all([m.Ready("bg-1"), m.Ready("bg-2")], priority=BG))
        fg2 = asyncio.create_task(a.send(m.Ready("fg-2")))
        for _ in range(5):
            await asyncio.sleep(0)
        held = list(entered)                       # foreground never waits for the gate
        b._set_reading(True)
        service = await asyncio.gather(fg, bg, fg2)
        for _ in range(5):
            await asyncio.sleep(0)
        await a.close()
        return held, entered, got, service[1]

    held, entered, got, service = run_virtual(main())
    assert held == [("fg-1", FG), ("fg-2", FG)]
    assert entered == held + [("bg-1", BG), ("bg-2", BG)]
    assert got == ["fg-1", "fg-2", "bg-1", "bg-2"]
    assert service == 0.0                              # in-process: no time inside the transport


def test_unshaped_foreground_does_not_wait_for_a_background_frame_in_transmit():
    async def main():
        a, b = inproc_pair("a", "b", NetConfig(heartbeat_s=0))
        b.set_handler(lambda link, msg: asyncio.sleep(0))
        b._set_reading(False)
        bg = asyncio.create_task(a.send(m.Ready("bg"), priority=BG))
        await asyncio.sleep(0)
        assert a._fg_busy == 0
        fg = asyncio.create_task(a.send(m.Ready("fg")))
        await asyncio.sleep(0)
        busy = a._fg_busy                        # inside _transmit, next to the background frame
        b._set_reading(True)
        await asyncio.gather(bg, fg)
        await a.close()
        return busy

    assert run_virtual(main()) == 1
