"""The virtual clock's lean loop: the stock loop's results, to the last bit, in less time."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading

import pytest

from pddgw.config import PolicyConfig
from pddgw.sim import clock
from pddgw.sim.cluster import run_deployment
from pddgw.sim.scenario import deployment_config, load_scenario
from pddgw.sim.workload import agentic, shared_prefix
from tests.sim.test_sim import TINY


def _timers(log: list[tuple[str, float]]):
    """Timers with ties, cancellations (enough to trigger the heap's bulk clean-up) and
    timers armed from timers; each logs (name, loop time) when it runs."""

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def hit(name: str) -> None:
            log.append((name, loop.time()))
            if name == "a1":              # armed while the loop runs timers of the same instant
                loop.call_at(1.0, hit, "a1-same-instant")
                loop.call_later(0.0, hit, "a1-later-0")

        for i in range(8):
            loop.call_at(1.0, hit, f"tie{i}")
        loop.call_at(1.0, hit, "a1")
        loop.call_at(0.5 + 1e-12, hit, "within-resolution")   # runs with the 0.5 group
        loop.call_at(0.5, hit, "half")
        doomed = [loop.call_at(0.25 + i * 1e-3, hit, f"cancelled{i}") for i in range(150)]
        for h in doomed[::3]:
            h.cancel()
        await asyncio.sleep(0.2995)      # the first 50 are due by then
        for h in doomed:
            h.cancel()
        await asyncio.sleep(2.0)
        log.append(("end", loop.time()))

    return main()


def test_the_lean_loop_runs_timers_in_the_stock_order_at_the_stock_times():
    lean: list[tuple[str, float]] = []
    stock: list[tuple[str, float]] = []
    clock.run_virtual(_timers(lean))
    clock.run_virtual(_timers(stock), clock.ReferenceVirtualLoop)
    assert lean == stock
    names = [n for n, _ in lean]
    assert names.index("half") < names.index("within-resolution") < names.index("tie0")
    # Of the first 50 (the rest are cancelled in bulk), every third was cancelled.
    assert [n for n in names if n.startswith("cancelled")] == [f"cancelled{i}" for i in range(50) if i % 3]
    assert lean[-1] == ("end", 0.2995 + 2.0)
    assert dict(lean)["a1-same-instant"] == 1.0


def test_the_lean_loop_simulates_a_deployment_exactly_as_the_stock_loop():
    sc = load_scenario(TINY)
    # Handoffs (catch-up rounds), a shared WAN, a prefix cache: every timer kind a run has.
    dep = dataclasses.replace(sc.deployment("pdd"), policy=PolicyConfig(
        pipeline="P-RLD-MD", handoff_mode="catch-up", catchup_threshold=4, catchup_threshold_md_loaded=2,
        catchup_max_chunk=8))
    cfg = deployment_config(sc, dep, wan_gbps=100.0)
    runs = [dataclasses.replace(clock.run_virtual(run_deployment(cfg, agentic(sc.workload.agentic, sc.seed),
                                                                 shared_prefix(512, sc.seed)), factory),
                                wall_s=0.0)
            for factory in (clock.VirtualClockLoop, clock.ReferenceVirtualLoop)]
    assert runs[0] == runs[1]
    assert len(runs[0].requests) == 12 and all(r.error is None for r in runs[0].requests)
    assert any(r.catchup_rounds for r in runs[0].requests)


def test_the_lean_loop_still_wakes_for_another_thread():
    """With no timer it waits in the real selector; call_soon_threadsafe's self-pipe ends the wait."""

    async def main() -> str:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        t = threading.Thread(target=loop.call_soon_threadsafe, args=(fut.set_result, "woken"))
        t.start()
        try:
            return await fut
        finally:
            t.join()

    assert clock.run_virtual(main()) == "woken"


def test_a_registered_socket_is_polled_before_the_clock_jumps():
    """With only its self-pipe registered the loop jumps the clock without polling; a socket
    registered makes it poll first, so bytes already there are read at the same instant."""
    import socket

    async def main() -> tuple[bytes, float]:
        loop = asyncio.get_running_loop()
        a, b = socket.socketpair()
        a.setblocking(False)
        got: asyncio.Future[tuple[bytes, float]] = loop.create_future()
        loop.add_reader(a, lambda: got.done() or got.set_result((a.recv(8), loop.time())))
        try:
            b.send(b"x")
            t0 = loop.time()
            sleeper = asyncio.ensure_future(asyncio.sleep(100.0))    # a timer the clock could jump to
            data, t = await got
            sleeper.cancel()
            return data, t - t0
        finally:
            loop.remove_reader(a)
            a.close()
            b.close()

    assert clock.run_virtual(main()) == (b"x", 0.0)


def test_run_virtual_raises_the_collector_thresholds_for_the_run_only():
    before = gc.get_threshold()

    async def inside() -> tuple[int, int, int]:
        await asyncio.sleep(5.0)
        return gc.get_threshold()

    assert clock.run_virtual(inside()) == (100_000, 50, 100)
    assert gc.get_threshold() == before

    async def fails() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        clock.run_virtual(fails())
    assert gc.get_threshold() == before
