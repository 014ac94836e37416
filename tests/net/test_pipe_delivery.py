"""`ShapedPipe` with a plain-function `deliver` (in-process links): one loop timer per
arrival instant, every item due then delivered in one go, in order, at its exact arrival.

On the virtual clock; 8 Gbps = one byte per nanosecond, so a 1,000-byte control frame
is serialized in 1 us and a 2,000,000-byte one in 2 ms; one-way latency 10 ms.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from pddgw.config import ShapingConfig
from pddgw.net.shaping import ShapedPipe
from pddgw.sim.clock import VirtualClockLoop, run_virtual


def test_items_due_together_arrive_in_one_timer_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        got: list[tuple[float, str]] = []

        def deliver(item: str) -> None:
            got.append((loop.time(), item))
            if item == "boom":
                raise RuntimeError("the link behind failed")

        pipe = ShapedPipe(ShapingConfig(gbps=8.0, latency_ms=10.0), deliver)
        calls = []
        on_due = pipe._on_due
        pipe._on_due = lambda at: (calls.append(loop.time()), on_due(at))
        assert pipe._task is None                        # no delivery task for a plain function
        pipe.put_nowait("a", 1000)                       # ends 1e-6, arrives 0.010001
        pipe.put_nowait("b", 1000)                       # same end, same arrival: same timer
        pipe.put_nowait("boom", 1000)                    # a failing delivery stops nothing after it
        pipe.put_nowait("c", 2_000_000)                  # ends 0.002, arrives 0.012
        await asyncio.sleep(0.02)
        pipe.put_nowait("d", 1000)                       # arrives 0.030001 ...
        await asyncio.sleep(0.005)
        pipe.close()                                     # ... but the cable is cut at 0.025
        await asyncio.sleep(0.02)
        await pipe.wait_closed()
        return got, calls, pipe._timer

    got, calls, timer = run_virtual(main())
    assert [item for _, item in got] == ["a", "b", "boom", "c"]
    assert [t for t, _ in got] == pytest.approx([0.010001, 0.010001, 0.010001, 0.012], abs=1e-12)
    assert calls == pytest.approx([0.010001, 0.012], abs=1e-12)
    assert timer is None


class _MillisecondLoop(VirtualClockLoop):
    """uvloop's clock on virtual time: `time()` in whole milliseconds, so a timer runs up to
    a millisecond before the instant it was set for."""

    def __init__(self) -> None:
        super().__init__()
        self._clock_resolution = 1e-3

    def time(self) -> float:
        return math.floor(round(self._vselector.now * 1e6) / 1e3) / 1e3


def test_a_timer_run_early_by_the_clock_s_tick_delivers_its_frame():
    """A frame arriving between two ticks goes out on its timer's one call (re-arming for it
    until the clock reached it spun the loop: on this clock, for ever)."""
    async def main():
        got: list[str] = []
        pipe = ShapedPipe(ShapingConfig(gbps=8.0, latency_ms=10.4), got.append)
        calls = []
        on_due = pipe._on_due

        def counted(at: float) -> None:
            calls.append(at)
            if len(calls) > 20:
                pipe.close()             # the spin this test guards against, cut short
            on_due(at)

        pipe._on_due = counted
        pipe.put_nowait("a", 1000)                       # arrives 0.010401, between ticks
        pipe.put_nowait("b", 2_000_000)                  # arrives 0.0124
        await asyncio.sleep(0.02)
        pipe.close()
        await pipe.wait_closed()
        return got, calls

    got, calls = run_virtual(main(), _MillisecondLoop)
    assert got == ["a", "b"]
    assert calls == pytest.approx([0.010401, 0.0124], abs=1e-12)


def test_a_coroutine_deliver_keeps_its_task_and_back_pressure():
    async def main():
        loop = asyncio.get_running_loop()
        got: list[tuple[float, str]] = []

        async def deliver(item: str) -> None:
            got.append((loop.time(), item))
            await asyncio.sleep(0.005)                   # the transport takes 5 ms per item

        pipe = ShapedPipe(ShapingConfig(gbps=8.0, latency_ms=10.0), deliver)
        assert pipe._task is not None
        pipe.put_nowait("a", 1000)
        pipe.put_nowait("b", 1000)
        await asyncio.sleep(0.05)
        pipe.close()
        await pipe.wait_closed()
        return got

    got = run_virtual(main())
    assert [item for _, item in got] == ["a", "b"]
    # b is due at 0.010001 too but waits for a's delivery to finish.
    assert [t for t, _ in got] == pytest.approx([0.010001, 0.015001], abs=1e-12)
