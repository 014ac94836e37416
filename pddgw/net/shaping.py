"""Link shaping: emulate a WAN or fabric link on top of a fast local one.

A `Shaper` is one direction of one emulated wire, shared by every `ShapedPipe`
that crosses it: a NIC with two strict-priority classes (`Priority`).
1. A frame queues in its class's FIFO; n bytes take n * 8 bits at the
   bandwidth of the moment (constant, or a step trace integrated across
   steps: `serialization_end`, `bits_between`).
2. Foreground is a plain FIFO wire: a frame's end is known when queued (`schedule`).
3. Background frames fill the gaps, one `loop.call_at` timer per head frame; a
   foreground frame preempts it, the bits sent so far counting as done (no
   byte is sent twice).
4. A frame arrives one-way latency (+- seeded jitter) after its serialization
   ends, never before the pipe's previous arrival.
5. Control frames (anything but KV) are serialized at once at the current
   rate, behind nobody's bulk frames (on a real WAN they ride their own
   connections), yet never overtake an earlier frame of their own pipe.
6. Liveness (`ShapedPipe.heard_since`): the far end hears bytes while a frame
   of the pipe is booked and the wire moves bits, or its background frame is
   on the wire; an outage (bandwidth 0) or an idle sender is silence.

`ShapedPipe.put` waits until the frame has left the emulated NIC (the sender
feels bandwidth and queueing, not latency) and returns its seconds on the
wire; a timer hands frames on at their arrival times, absolute on the loop's
clock (virtual too).
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import math
import random
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog

from pddgw.config import ShapingConfig
from pddgw.net.link import Priority

log = structlog.get_logger("pddgw.net")

_NEVER = 1e9  # seconds; a schedule that never completes (bandwidth 0 forever)
# Waits shorter than this are not slept: no event-loop timer resolves them, and a
# small frame on a fast fabric would otherwise cost a timer per frame for nothing.
MIN_SLEEP_S = 1e-6


@dataclass(slots=True)
class ClassStats:
    """Accounting of one traffic class on one wire."""

    bytes_booked: int = 0      # bytes of the frames queued (dropped ones included)
    busy_s: float = 0.0        # seconds the wire spent serializing them
    frames: int = 0


@dataclass(slots=True, eq=False)
class _Frame:
    """A background frame waiting for, or on, the wire."""

    pipe: ShapedPipe
    item: Any
    bits_left: float
    done: asyncio.Future[float]      # -> its seconds on the wire, once it has left the NIC
    service_s: float = 0.0


class Shaper:
    """One direction of one wire: the two-class schedule of the module docstring.

    Foreground booking (`schedule`) is pure arithmetic; background frames need
    the running loop (their timer).
    """

    def __init__(self, cfg: ShapingConfig, t0: float) -> None:
        self.cfg = cfg
        self._t0 = t0
        self._latency = cfg.latency_ms / 1e3
        self._jitter = cfg.jitter_ms / 1e3
        self._rng = random.Random(cfg.seed)
        self._times = [t for t, _ in cfg.trace]
        self._rates = [g * 1e9 for _, g in cfg.trace]          # bits per second
        self._last_arrival = t0               # arrival order of frames booked without a pipe
        self._fg_free_at = t0                 # the foreground class holds the wire until then
        # (queued, start, end, nbytes) of foreground frames that background service
        # may still overlap: the QoS counter's evidence, and `queued_bytes`.
        self._fg_windows: deque[tuple[float, float, float, int]] = deque()
        self._bg: deque[_Frame] = deque()
        self._bg_start = t0                   # when the head of `_bg` (re)starts serializing
        self._bg_end = t0                     # ... and when it would be done
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self.classes = (ClassStats(), ClassStats())            # indexed by Priority
        # For every foreground frame, the background bytes serialized on this
        # wire between its queueing and the end of its serialization, summed:
        # 0 with preemption, > 0 if background traffic ever delayed foreground.
        self.bg_bytes_ahead_of_fg = 0.0
        # Background frames whose sender gave up before any of their bits was
        # serialized (a cancelled transfer): they left the queue unsent.
        self.bg_bytes_withdrawn = 0

    # -- totals (both classes) -------------------------------------------------

    @property
    def bytes_booked(self) -> int:
        return sum(c.bytes_booked for c in self.classes)

    @property
    def busy_s(self) -> float:
        return sum(c.busy_s for c in self.classes)

    @property
    def frames(self) -> int:
        return sum(c.frames for c in self.classes)

    def queued_bytes(self, priority: Priority, now: float | None = None) -> int:
        """Bytes of `priority` frames waiting for or on the wire at `now` (default: the loop's time)."""
        if now is None:
            now = asyncio.get_running_loop().time()
        bits = 0.0
        if priority == Priority.FOREGROUND:
            for _, start, end, nbytes in self._fg_windows:
                if end > now:
                    bits += nbytes * 8.0 if start >= now else self.bits_between(now, end)
        elif self._bg:
            bits = sum(f.bits_left for f in self._bg)
            if self._bg_start < now:
                bits -= min(self._bg[0].bits_left, self.bits_between(self._bg_start, now))
        return round(bits / 8)

    # -- the bandwidth trace -----------------------------------------------------

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
        return self._end_of_bits(start, nbytes * 8.0)

    def _end_of_bits(self, start: float, bits: float) -> float:
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

    def bits_between(self, a: float, b: float) -> float:
        """Bits the wire serializes from absolute time `a` to `b` (the inverse of `serialization_end`)."""
        bits = 0.0
        t, stop = a - self._t0, b - self._t0
        while t < stop:
            rate, end = self._rate(t)
            if rate == math.inf:
                return math.inf
            step_end = min(end, stop)
            bits += rate * (step_end - t)
            t = step_end
        return bits

    # -- foreground: arithmetic ------------------------------------------------

    def schedule(self, nbytes: int, now: float, pipe: ShapedPipe | None = None,
                 item: Any = None) -> tuple[float, float]:
        """Queue a foreground frame at `now` -> (serialization end, arrival), both absolute.

        With a `pipe`, the frame is handed to it for delivery at its arrival.
        """
        _, done, arrival = self._book(nbytes, now, pipe, item)
        return done, arrival

    def _book(self, nbytes: int, now: float, pipe: ShapedPipe | None, item: Any) -> tuple[float, float, float]:
        """-> (start, end, arrival) of a foreground frame queued at `now`."""
        self._complete_until(now)
        self._preempt(now)
        start = max(now, self._fg_free_at)
        done = self._end_of_bits(start, nbytes * 8.0)
        self._fg_free_at = done
        st = self.classes[Priority.FOREGROUND]
        st.bytes_booked += nbytes
        st.busy_s += done - start
        st.frames += 1
        # Background service from now on starts at `now` or later: older windows are evidence of nothing.
        while self._fg_windows and self._fg_windows[0][2] <= now:
            self._fg_windows.popleft()
        self._fg_windows.append((now, start, done, nbytes))
        arrival = self._arrive(done, pipe, item)
        if self._bg:
            self._restart_bg(done)
            self._kick(now)
        return start, done, arrival

    def control(self, nbytes: int, now: float, pipe: ShapedPipe | None = None, item: Any = None) -> float:
        """Step 5: a control frame sent at `now` -> its serialization end."""
        done = self._end_of_bits(now, nbytes * 8.0)
        self._arrive(done, pipe, item)
        return done

    def _arrive(self, done: float, pipe: ShapedPipe | None, item: Any) -> float:
        """Arrival of a frame whose serialization ends at `done`; a pipe gets the item, in arrival order."""
        delay = self._latency
        if self._jitter:
            delay += self._rng.uniform(-self._jitter, self._jitter)
        if pipe is None:
            arrival = self._last_arrival = max(done + delay, self._last_arrival)
        else:
            arrival = pipe._last_arrival = max(done + delay, pipe._last_arrival)
            pipe._arrive(arrival, item)
        return arrival

    # -- background: event-driven --------------------------------------------------

    def _queue_background(self, pipe: ShapedPipe, item: Any, nbytes: int, now: float) -> asyncio.Future[float]:
        self._loop = pipe._loop
        self._complete_until(now)
        frame = _Frame(pipe, item, nbytes * 8.0, self._loop.create_future())
        st = self.classes[Priority.BACKGROUND]
        st.bytes_booked += nbytes
        st.frames += 1
        self._bg.append(frame)
        if len(self._bg) == 1:
            self._restart_bg(max(now, self._fg_free_at))
        self._kick(now)
        return frame.done

    def _restart_bg(self, start: float) -> None:
        """The head of the background queue (re)starts at `start`."""
        self._bg_start = start
        self._bg_end = self._end_of_bits(start, self._bg[0].bits_left)

    def _served(self, frame: _Frame, start: float, end: float) -> None:
        """`frame` was on the wire from `start` to `end`."""
        frame.service_s += end - start
        if end > start:
            frame.pipe._bg_heard = (start + self._latency, end + self._latency)
        self.classes[Priority.BACKGROUND].busy_s += end - start
        for queued, _, fg_end, _ in self._fg_windows:
            lo, hi = max(start, queued), min(end, fg_end)
            if hi > lo:
                self.bg_bytes_ahead_of_fg += self.bits_between(lo, hi) / 8

    def _preempt(self, now: float) -> None:
        """The background frame on the wire (if any) stops at `now`; what it sent so far is sent."""
        if self._bg and self._bg_start < now:
            head = self._bg[0]
            head.bits_left = max(0.0, head.bits_left - self.bits_between(self._bg_start, now))
            self._served(head, self._bg_start, now)
            self._bg_start = now

    def _complete_until(self, now: float) -> None:
        """Complete the background frames whose serialization ended by `now`, in order."""
        while self._bg and self._bg_end <= now:
            head = self._bg.popleft()
            start, end = self._bg_start, self._bg_end
            head.bits_left = 0.0
            self._served(head, start, end)
            while self._fg_windows and self._fg_windows[0][2] <= end:
                self._fg_windows.popleft()
            if not head.pipe.closed:
                self._arrive(end, head.pipe, head.item)
            if not head.done.done():        # the sender may have given up (timeout)
                head.done.set_result(head.service_s)
            if self._bg:
                self._restart_bg(max(end, self._fg_free_at))

    def _kick(self, now: float) -> None:
        """Complete what is due, then keep one timer at the end of the background head."""
        self._complete_until(now)
        if not self._bg:
            if self._timer is not None:
                self._timer.cancel()
                self._timer, self._timer_at = None, math.inf
            return
        if self._timer is not None:
            if self._timer_at <= self._bg_end:
                return          # fires first and re-arms (a preemption only pushes the end later)
            self._timer.cancel()
        assert self._loop is not None
        self._timer_at = self._bg_end
        self._timer = self._loop.call_at(self._bg_end, self._on_timer)

    def _on_timer(self) -> None:
        assert self._loop is not None
        at = self._timer_at
        self._timer, self._timer_at = None, math.inf
        # A loop runs a timer up to its clock resolution early: it is due at `at`.
        self._kick(max(self._loop.time(), at))

    def _withdraw(self, done: asyncio.Future[float], now: float) -> None:
        """The sender of a background frame gave up (cancelled): a frame none of
        whose bits is on the wire leaves the queue; one already partly sent
        finishes (its far end holds its first bytes; a frame is never cut)."""
        self._complete_until(now)
        for i, f in enumerate(self._bg):  # noqa: B007 (i is used after the loop)
            if f.done is done:
                break
        else:
            return                       # already served
        if i == 0:
            self._preempt(now)
            if f.service_s > 0:
                return
        del self._bg[i]
        self.bg_bytes_withdrawn += round(f.bits_left / 8)
        if i == 0 and self._bg:
            self._restart_bg(max(now, self._fg_free_at))
        self._kick(now)

    def serving(self, pipe: ShapedPipe, t: float) -> float | None:
        """When the background frame of `pipe` on the wire at `t` started there; None if none is."""
        if self._bg and self._bg[0].pipe is pipe and self._bg_start <= t < self._bg_end:
            return self._bg_start
        return None

    def _drop(self, pipe: ShapedPipe, now: float) -> None:
        """`pipe` is cut: its background frames leave the queue; other pipes keep their places.

        Booked foreground slots stay booked: the foreground schedule is fixed
        when a frame is queued (that is what makes it arithmetic).
        """
        if not any(f.pipe is pipe for f in self._bg):
            return
        self._complete_until(now)
        head_cut = bool(self._bg) and self._bg[0].pipe is pipe
        if head_cut:
            self._preempt(now)
        for f in self._bg:
            if f.pipe is pipe and not f.done.done():
                f.done.set_result(f.service_s)
        self._bg = deque(f for f in self._bg if f.pipe is not pipe)
        if head_cut and self._bg:
            self._restart_bg(max(now, self._fg_free_at))
        self._kick(now)


class ShapedPipe:
    """Delivers items to `deliver` at their shaped arrival times, in order.

    `deliver` is a plain function (called from one loop timer, every item due
    at that instant in one go; what it returns is ignored) or a coroutine
    function (awaited by a delivery task: the real transport's back-pressure
    then delays later arrivals too).  Pipes given the same `shaper` share one
    wire (a WAN that several links cross).
    """

    def __init__(self, cfg: ShapingConfig, deliver: Callable[[Any], Awaitable[None] | None],
                 shaper: Shaper | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self.shaper = shaper if shaper is not None else Shaper(cfg, self._loop.time())
        self._deliver = deliver
        self._queue: deque[tuple[float, Any]] = deque()
        self._last_arrival = -math.inf
        # Liveness (step 6): when the oldest frame now in `_queue` was booked (inf: none is), and
        # the arrival window of the bytes of this pipe's last background service interval.
        self._busy_since = math.inf
        self._bg_heard = (-math.inf, -math.inf)
        # A plain-function `deliver` (in-process links) is called from one loop timer at the
        # head frame's arrival, every frame then due in one go: a frame costs no task wake-up
        # and no sleep of its own.  A coroutine `deliver` (a real transport's back-pressure)
        # keeps a delivery task that awaits each.
        self._timer: asyncio.TimerHandle | None = None
        self._wake = asyncio.Event()
        self._task = (self._loop.create_task(self._run(), name="shaped-pipe")
                      if inspect.iscoroutinefunction(deliver) else None)
        self.closed = False

    def put_nowait(self, item: Any, nbytes: int) -> float:
        """Send a control frame (heartbeats); -> the time its serialization ends."""
        now = self._loop.time()
        if self.closed:
            return now
        return self.shaper.control(nbytes, now, self, item)

    async def put(self, item: Any, nbytes: int, priority: Priority = Priority.FOREGROUND,
                  control: bool = False) -> float:
        """Queue `item` in its class (a `control` frame: step 5) and wait until
        it has left the emulated NIC.

        -> the seconds the frame itself was on the wire (its serialization
        time; not the time it waited for other frames).
        """
        now = self._loop.time()
        if self.closed:
            return 0.0
        if control:
            start, done = now, self.shaper.control(nbytes, now, self, item)
        elif priority == Priority.FOREGROUND:
            start, done, _ = self.shaper._book(nbytes, now, self, item)
        else:
            done_fut = self.shaper._queue_background(self, item, nbytes, now)
            try:
                return await done_fut
            except asyncio.CancelledError:
                # A cancelled transfer's frame that has not started never crosses the wire.
                self.shaper._withdraw(done_fut, self._loop.time())
                raise
        if done - now >= MIN_SLEEP_S:
            await asyncio.sleep(done - now)
        return done - start

    def _arrive(self, arrival: float, item: Any) -> None:
        """The shaper hands over a serialized frame (arrivals never decrease)."""
        if not self.closed:
            if not self._queue:
                self._busy_since = self._loop.time()
            self._queue.append((arrival, item))
            if self._task is not None:
                self._wake.set()
            elif self._timer is None:
                self._arm(arrival)

    def _arm(self, arrival: float) -> None:
        """One timer at the head frame's arrival (`call_soon` when it is due already, so a
        delivery never runs inside the sender's call)."""
        if arrival - self._loop.time() >= MIN_SLEEP_S:
            self._timer = self._loop.call_at(arrival, self._on_due, arrival)
        else:
            self._timer = self._loop.call_soon(self._on_due, arrival)  # type: ignore[assignment]

    def _on_due(self, at: float) -> None:
        """Deliver, in order, every frame whose arrival is due (what `_run` does, without a task).

        A loop runs a timer up to its clock's resolution early (uvloop's clock ticks in
        milliseconds): the frames due by `at`, the instant it was set for, are due, as `_run`'s
        sleep has it (re-arming for them would spin the loop until its clock ticks)."""
        self._timer = None
        loop, queue = self._loop, self._queue
        while queue and not self.closed:
            arrival, item = queue[0]
            if arrival - max(loop.time(), at) >= MIN_SLEEP_S:
                if self._timer is None:      # (a delivery may have queued and armed already)
                    self._arm(arrival)
                return
            queue.popleft()
            if not queue:
                self._busy_since = math.inf
            try:
                self._deliver(item)
            except Exception as e:  # the link behind is failing; it reports that itself
                log.debug("shaped delivery failed", error=repr(e))

    def heard_since(self, since: float) -> bool:
        """Step 6: whether the far end has heard bytes of this pipe after loop time `since`."""
        now = self._loop.time()
        if self.closed:
            return False
        lat = self.shaper._latency
        hi = now - lat                   # bits put on the wire by then have arrived by now
        if self._queue:
            lo = max(self._busy_since, since - lat)
            if hi > lo and self.shaper.bits_between(lo, hi) > 0:
                return True
        start, end = self._bg_heard
        if start <= now and end > since:
            return True
        on_wire = self.shaper.serving(self, hi)
        return on_wire is not None and self.shaper.bits_between(max(on_wire, since - lat), hi) > 0

    async def _run(self) -> None:
        loop = self._loop
        while True:
            while not self._queue:
                self._wake.clear()
                await self._wake.wait()
            arrival, item = self._queue[0]
            delay = arrival - loop.time()
            if delay >= MIN_SLEEP_S:
                await asyncio.sleep(delay)
            self._queue.popleft()
            if not self._queue:
                self._busy_since = math.inf
            try:
                result = self._deliver(item)
                if inspect.isawaitable(result):
                    await result
            except Exception as e:  # the link behind is failing; it reports that itself
                log.debug("shaped delivery failed", error=repr(e))

    def close(self) -> None:
        """Stop delivering; what is still in flight or queued is dropped (a cut cable)."""
        if self.closed:
            return
        self.closed = True
        self._queue.clear()
        if self._task is not None:
            self._task.cancel()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.shaper._drop(self, self._loop.time())

    async def wait_closed(self) -> None:
        if self._task is not None:
            await asyncio.wait([self._task])
