"""The room queue (admission.py) on the simulator's virtual clock: order, bounds, wake-ups."""

from __future__ import annotations

import asyncio

import pytest

from pddgw.pipeline.admission import Overloaded, RoomQueue
from pddgw.sim.clock import run_virtual


def test_waiters_retry_one_at_a_time_in_arrival_order():
    async def main():
        q = RoomQueue(max_waiting=8, max_wait_s=100.0, retry_s=50.0)
        order: list[str] = []

        async def waiter(name: str) -> None:
            await q.wait(name, "full")
            order.append(name)

        tasks = [asyncio.create_task(waiter(n)) for n in "abc"]
        await asyncio.sleep(1)
        assert len(q) == 3 and order == []
        q.wake()
        await asyncio.sleep(0)
        q.wake()            # the woken head has not run yet: still one retry at a time
        await asyncio.sleep(1)
        assert order == ["a"] and len(q) == 2
        q.wake()
        await asyncio.sleep(1)
        assert order == ["a", "b"]
        q.wake()
        await asyncio.gather(*tasks)
        return order, q.waited, q.refused

    assert run_virtual(main()) == (["a", "b", "c"], 3, 0)


def test_a_refused_head_keeps_its_place():
    async def main():
        q = RoomQueue(max_waiting=8, max_wait_s=100.0, retry_s=50.0)
        first = asyncio.create_task(q.wait("a", "full"))
        await asyncio.sleep(0)
        second = asyncio.create_task(q.wait("b", "full"))
        await asyncio.sleep(1)
        q.wake()
        await first                       # "a" retried and was refused again ...
        again = asyncio.create_task(q.wait("a", "full", front=True))
        await asyncio.sleep(1)
        q.wake()                          # ... so the next turn is still its own
        await again
        return second.done(), len(q)

    assert run_virtual(main()) == (False, 1)


def test_the_head_retries_on_its_own_after_retry_s():
    async def main():
        loop = asyncio.get_running_loop()
        q = RoomQueue(max_waiting=8, max_wait_s=100.0, retry_s=0.5)
        t0 = loop.time()
        await q.wait("a", "full")         # nobody wakes it: room freed out of the router's sight
        return loop.time() - t0

    assert run_virtual(main()) == pytest.approx(0.5)


def test_bounds_refuse_with_overloaded_naming_the_setting():
    async def main():
        q = RoomQueue(max_waiting=1, max_wait_s=3.0, retry_s=10.0)
        loop = asyncio.get_running_loop()
        head = asyncio.create_task(q.wait("a", "import needs 12 KV blocks, 0 allocatable"))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as full:
            await q.wait("b", "full")
        t0 = loop.time()
        with pytest.raises(Overloaded) as late:
            await head
        return str(full.value), str(late.value), loop.time() - t0, q.refused, len(q)

    full, late, waited, refused, left = run_virtual(main())
    assert full == "1 requests already wait for KV room (server.max_queued_requests = 1)"
    assert late == "no KV room within 3 s (server.max_queue_wait_s): import needs 12 KV blocks, 0 allocatable"
    assert waited == pytest.approx(3.0)
    assert (refused, left) == (2, 0)


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        q = RoomQueue(max_waiting=8, max_wait_s=100.0, retry_s=50.0)
        a = asyncio.create_task(q.wait("a", "full"))
        b = asyncio.create_task(q.wait("b", "full"))
        await asyncio.sleep(1)
        a.cancel()
        await asyncio.sleep(0)
        q.wake()
        await b
        return a.cancelled(), len(q)

    assert run_virtual(main()) == (True, 0)
