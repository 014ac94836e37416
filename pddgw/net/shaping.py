"""Link shaping: emulate a WAN or fabric link on top of a fast local one.

A `Shaper` is the schedule of one link direction, a store-and-forward model of
a NIC feeding a pipe:

1. a frame of n bytes starts serializing when the wire is free (after the
   previous frame) and takes n * 8 / bandwidth seconds; the bandwidth is
   constant or follows a step trace (`ShapingConfig.trace`), integrated across
   steps, so a trace change mid-frame is honoured;
2. it arrives one-way latency (+- uniform jitter) after its serialization
   ends, but never before the previous frame arrived (links do not reorder).

`ShapedPipe` applies the schedule: `put` waits until the frame has left the
emulated NIC (the sender feels the bandwidth, not the latency: transfers are
pipelined) and a delivery task hands each frame to the real transport at its
arrival time.  Times are absolute, so timer lateness does not accumulate.
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from pddgw.config import ShapingConfig

log = structlog.get_logger("pddgw.net")

_NEVER = 1e9  # seconds; a schedule that never completes (bandwidth 0 forever)
# Waits shorter than this are not slept: no event-loop timer resolves them, and a
# small frame on a fast fabric would otherwise cost a timer per frame for nothing.
_MIN_SLEEP_S = 1e-6


class Shaper:
    """Serialization + latency schedule of one direction of a link (pure arithmetic)."""

    def __init__(self, cfg: ShapingConfig, t0: float) -> None:
        self.cfg = cfg
        self._t0 = t0
        self._free_at = t0                    # the wire is busy until then
        self._last_arrival = t0
        self._latency = cfg.latency_ms / 1e3
        self._jitter = cfg.jitter_ms / 1e3
        self._rng = random.Random(cfg.seed)
        self._times = [t for t, _ in cfg.trace]
        self._rates = [g * 1e9 for _, g in cfg.trace]          # bits per second
        # Accounting: bytes booked and seconds the wire spent serializing them.
        self.bytes_booked = 0
        self.busy_s = 0.0

    def _rate(self, t: float) -> tuple[float, float]:
        """(bits/s at link time t, link time when that rate ends)."""
        cfg = self.cfg
        if not cfg.trace:
            return (cfg.gbps * 1e9 if cfg.gbps else math.inf), math.inf
        period = cfg.trace_period_s
        base = 0.0
        if period:
            base = math.floor(t / period) * period
            t -= base
        i = bisect.bisect_right(self._times, t) - 1
        if i + 1 < len(self._times):
            end = self._times[i + 1]
        else:
            end = period if period else math.inf
        return self._rates[i], base + end

    def serialization_end(self, start: float, nbytes: int) -> float:
        """Absolute time at which `nbytes` starting at absolute `start` are on the wire."""
        bits = nbytes * 8.0
        t = start - self._t0
        while True:
            rate, end = self._rate(t)
            if rate == math.inf:
                return self._t0 + t
            if rate > 0:
                need = bits / rate
                if t + need <= end:
                    return self._t0 + t + need
                bits -= rate * (end - t)
            if end == math.inf:
                return self._t0 + _NEVER
            t = end

    def schedule(self, nbytes: int, now: float) -> tuple[float, float]:
        """Book a frame sent at `now` -> (serialization end, arrival), both absolute."""
        start = max(now, self._free_at)
        done = self.serialization_end(start, nbytes)
        self._free_at = done
        self.bytes_booked += nbytes
        self.busy_s += done - start
        delay = self._latency
        if self._jitter:
            delay += self._rng.uniform(-self._jitter, self._jitter)
        arrival = max(done + delay, self._last_arrival)
        self._last_arrival = arrival
        return done, arrival


class ShapedPipe:
    """Delivers items to `deliver` at their shaped arrival times, in order.

    `deliver` may be a plain function or a coroutine function (awaited: the
    real transport's back-pressure then delays later arrivals too).  Pipes
    given the same `shaper` share one wire: their frames serialize one after
    another in booking order (a WAN that several links cross).
    """

    def __init__(self, cfg: ShapingConfig, deliver: Callable[[Any], Awaitable[None] | None],
                 shaper: Shaper | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.shaper = shaper if shaper is not None else Shaper(cfg, self._loop.time())
        self._deliver = deliver
        self._queue: deque[tuple[float, Any]] = deque()
        self._wake = asyncio.Event()
        self._task = self._loop.create_task(self._run(), name="shaped-pipe")
        self.closed = False

    def put_nowait(self, item: Any, nbytes: int) -> float:
        """Book `item`; -> the time its serialization ends (for `put`)."""
        done, arrival = self.shaper.schedule(nbytes, self._loop.time())
        self._queue.append((arrival, item))
        self._wake.set()
        return done

    async def put(self, item: Any, nbytes: int) -> None:
        """Book `item` and wait until it has left the emulated NIC."""
        done = self.put_nowait(item, nbytes)
        delay = done - self._loop.time()
        if delay >= _MIN_SLEEP_S:
            await asyncio.sleep(delay)

    async def _run(self) -> None:
        loop = self._loop
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            arrival, item = self._queue[0]
            delay = arrival - loop.time()
            if delay >= _MIN_SLEEP_S:
                await asyncio.sleep(delay)
            self._queue.popleft()
            try:
                result = self._deliver(item)
                if inspect.isawaitable(result):
                    await result
            except Exception as e:  # the link behind is failing; it reports that itself
                log.debug("shaped delivery failed", error=repr(e))

    def close(self) -> None:
        """Stop delivering; what is still in flight is dropped (a cut cable)."""
        self.closed = True
        self._queue.clear()
        self._task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.wait([self._task])
