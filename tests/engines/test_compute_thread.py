"""The process's compute thread (pddgw/engines/compute_thread.py): calls by turn then arrival,
one at a time on one thread, failures to their callers; the multi-threaded CPU engines of a
process share it, and one-off engine work runs on a thread that ends."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pddgw.engines import compute_thread
from pddgw.engines.async_engine import AsyncEngine, in_passing_thread
from pddgw.engines.compute_thread import ComputeThread, Turn

from .conftest import make_engine, req


def test_waiting_calls_run_by_turn_then_arrival_on_one_thread():
    ct = ComputeThread(name="test-compute")
    gate = threading.Event()
    order: list[str] = []
    threads: set[str] = set()

    def note(tag: str) -> str:
        order.append(tag)
        threads.add(threading.current_thread().name)
        return tag

    first = ct.submit(Turn.DECODE, gate.wait)                 # holds the thread while the rest queue
    futs = [ct.submit(turn, note, tag) for turn, tag in ((Turn.DECODE, "md-1"), (Turn.PREFILL, "p-1"),
                                                          (Turn.RELAY, "rld"), (Turn.CONTROL, "import"),
                                                          (Turn.PREFILL, "p-2"), (Turn.DECODE, "md-2"))]
    gate.set()
    assert first.result(timeout=30) is True
    assert [f.result(timeout=30) for f in futs] == ["md-1", "p-1", "rld", "import", "p-2", "md-2"]
    assert order == ["import", "p-1", "p-2", "rld", "md-1", "md-2"]
    assert threads == {"test-compute"}


def test_a_failing_call_fails_its_future_and_the_thread_goes_on():
    ct = ComputeThread(name="test-compute-2")

    def boom() -> None:
        raise ValueError("bad call")

    with pytest.raises(ValueError, match="bad call"):
        ct.submit(Turn.CONTROL, boom).result(timeout=30)
    assert ct.submit(Turn.CONTROL, lambda: 7).result(timeout=30) == 7


def test_multi_threaded_cpu_engines_step_on_the_shared_thread(tiny64):
    seen: set[str] = set()

    async def main() -> dict[str, list[int]]:
        engines = [make_engine(tiny64, cpu_threads=2), make_engine(tiny64, cpu_threads=0)]
        assert all(e.shares_compute_thread for e in engines)
        assert not make_engine(tiny64, cpu_threads=1).shares_compute_thread    # opens no OpenMP team
        for e in engines:
            real = e.step

            def step(real=real):
                seen.add(threading.current_thread().name)
                return real()
            e.step = step
        aengs = [AsyncEngine(e, f"e{i}", turn) for i, (e, turn) in enumerate(zip(engines, (Turn.PREFILL, Turn.DECODE)))]
        for a in aengs:
            a.start()
        async def generate(i: int, a: AsyncEngine) -> list[int]:
            return [t async for out in a.generate(req(f"r{i}", [5, 6, 7], 4)) for t in out.ids]

        outs = await asyncio.gather(*(generate(i, a) for i, a in enumerate(aengs)))
        got = {f"r{i}": ids for i, ids in enumerate(outs)}
        for a in aengs:
            await a.stop()
        return got

    got = asyncio.run(main())
    assert got["r0"] == got["r1"] and len(got["r0"]) == 4
    assert seen == {compute_thread.shared()._thread.name}
    assert compute_thread.shared()._thread.is_alive()          # engines stopped, the thread stays


def test_one_off_work_runs_on_a_thread_that_ends():
    async def main() -> threading.Thread:
        return await in_passing_thread(threading.current_thread)

    ran_on = asyncio.run(main())
    assert ran_on is not threading.current_thread() and ran_on.name.startswith("pddgw-once")
    ran_on.join(timeout=60)
    assert not ran_on.is_alive()


def test_cancelling_one_off_work_does_not_hold_the_loop():
    gate, done = threading.Event(), threading.Event()

    def work() -> None:
        gate.wait(30)
        done.set()

    async def main() -> bool:
        task = asyncio.create_task(in_passing_thread(work))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        still_running = not done.is_set()          # the loop did not wait for the work to end
        gate.set()
        return still_running

    assert asyncio.run(main())
