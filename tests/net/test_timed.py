"""`LinkBase._timed`: the deadline every send, request and reply runs under.

A coroutine runs under a deadline counted from the call, and leaves no timer
armed once it finished.  On the virtual clock
(`run_virtual`), so every time below is exact.
"""

from __future__ import annotations

import asyncio

import pytest

from pddgw import messages as m
from pddgw.net.errors import LinkTimeout
from pddgw.net.inproc import inproc_pair
from pddgw.sim.clock import run_virtual


async def _link():
    a, b = inproc_pair("a", "b")
    return a, b


def test_a_coroutine_that_never_suspends_leaves_no_timer_armed():
    async def main():
        a, b = await _link()
        loop = asyncio.get_running_loop()

        async def quick():
            return 41 + 1

        def live() -> int:                     # the heartbeat timers of the pair, if any
            return sum(not h.cancelled() for _, h in loop._scheduled)

        before = live()
        result = await a._timed(quick(), 3.0, "quick")
        armed = live() - before
        await a.close()
        await b.close()
        return result, armed, loop.time()

    assert run_virtual(main()) == (42, 0, 0.0)


def test_a_suspended_coroutine_keeps_the_deadline_of_the_call():
    async def main():
        a, b = await _link()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_at(1.5, fut.set_result, "reply")

        async def slow():
            await asyncio.sleep(1.0)           # suspends at t=0; the deadline is 0 + 3.0
            got = await fut                    # a value sent back through the resumption
            await asyncio.sleep(0.25)
            return got, loop.time()

        ok = await a._timed(slow(), 3.0, "slow")

        async def too_slow():
            await asyncio.sleep(1.0)
            await asyncio.sleep(5.0)

        t0 = loop.time()
        with pytest.raises(LinkTimeout, match=r"too_slow to b: no completion within 3.0s"):
            await a._timed(too_slow(), 3.0, "too_slow")
        late = loop.time() - t0
        await a.close()
        await b.close()
        return ok, t0, late

    assert run_virtual(main()) == (("reply", 1.75), 1.75, 3.0)


def test_errors_and_cancellation_pass_through_unchanged():
    async def main():
        a, b = await _link()
        loop = asyncio.get_running_loop()

        async def fails_at_once():
            raise ValueError("bad frame")

        with pytest.raises(ValueError, match="bad frame"):
            await a._timed(fails_at_once(), 3.0, "x")

        async def own_timeout():            # a TimeoutError of its own is not the link's
            await asyncio.sleep(0.5)
            raise TimeoutError("inner")

        with pytest.raises(TimeoutError, match="inner"):
            await a._timed(own_timeout(), 3.0, "x")

        seen = []

        async def cancelled():
            try:
                await asyncio.sleep(10.0)
            except asyncio.CancelledError:
                seen.append(loop.time())
                raise

        task = asyncio.ensure_future(a._timed(cancelled(), 30.0, "x"))
        await asyncio.sleep(2.0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await a.close()
        await b.close()
        return seen

    assert run_virtual(main()) == [2.5]


def test_a_stream_times_out_exactly_one_timeout_after_its_last_wait_began():
    """Ten items 0.25 s apart never time a 1.1 s stream out; after the last (t=2.5) the wait
    times out at 2.5 + 1.1.  Eleven waits, four timers: armed at t=0 for 1.1, re-armed there
    for the wait begun at 1.0 (-> 2.1), at 2.1 for the one begun at 2.0 (-> 3.1), at 3.1 for
    the one begun at 2.5 (-> 3.6)."""

    async def main():
        a, b = await _link()
        loop = asyncio.get_running_loop()
        stream = a.stream("r1", timeout=1.1)
        arms = []
        arm = stream._arm
        stream._arm = lambda lp, at: (arms.append((lp.time(), at)), arm(lp, at))
        for k in range(10):
            loop.call_at(0.25 * (k + 1), b._transmit_nowait, m.TokenItem("r1", k, (k,)))
        got = []
        try:
            async for msg in stream:
                got.append((msg.position, loop.time()))
        except LinkTimeout as e:
            failed = (str(e), loop.time())
        stream.close()
        await a.close()
        await b.close()
        return got, failed, arms

    got, failed, arms = run_virtual(main())
    assert got == [(k, 0.25 * (k + 1)) for k in range(10)]
    assert failed[0] == "stream 'r1': nothing within 1.1s"
    assert failed[1] == pytest.approx(3.6, abs=1e-12)
    assert [t for pair in arms for t in pair] == pytest.approx([0.0, 1.1, 1.1, 2.1, 2.1, 3.1, 3.1, 3.6], abs=1e-12)
