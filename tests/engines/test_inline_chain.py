"""An inline engine's loop as callbacks (`_InlineChain`) is the task loop it replaced, hop for hop.

The reference below is the loop `AsyncEngine._run` ran for inline engines before: a task that
steps, sleeps the modeled time, hands out and polls when a step produced nothing.  Both drive a
scripted inline engine on the virtual clock next to a task that marks every loop hop around
each wake-up; the traces (which engine call, when, between which marks) must be equal, event for
event: that is what keeps a simulated run the same to the last event.
"""

from __future__ import annotations

import asyncio
from collections import deque
from types import SimpleNamespace

import pytest

from pddgw.engines import async_engine
from pddgw.engines.async_engine import AsyncEngine, EngineStopped
from pddgw.sim.clock import ReferenceVirtualLoop, VirtualClockLoop, run_virtual


class _TaskLoop(AsyncEngine):
    """The reference: the task loop for an inline engine, as it was."""

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._ref_run())

    async def _ref_run(self) -> None:
        eng = self.engine
        try:
            while True:
                self._wake.clear()
                if not eng.has_work():
                    await self._wake.wait()
                    continue
                outputs = eng.step()
                modeled = self.engine.step_seconds()
                if modeled > 0:
                    await asyncio.sleep(modeled)
                self._hand_out(outputs)
                if not outputs:
                    try:
                        await asyncio.wait_for(self._wake.wait(), async_engine._IDLE_POLL_S)
                    except TimeoutError:
                        pass
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._crashed(e)


class Scripted:
    """An inline engine whose steps are a script of (modeled seconds, produces output, raises)."""

    runs_inline = True

    def __init__(self, trace: list) -> None:
        self.trace = trace
        self.script: deque[tuple[float, bool, bool]] = deque()
        self._seconds = 0.0
        # Called with each instant where the loop's hops matter (a step's end, a poll's end):
        # the scenario marks the hops from there.
        self.at: list = []

    def has_work(self) -> bool:
        self.trace.append(("has_work", asyncio.get_running_loop().time(), bool(self.script)))
        return bool(self.script)

    def step(self) -> list:
        seconds, output, boom = self.script.popleft()
        loop = asyncio.get_running_loop()
        self.trace.append(("step", loop.time(), seconds, output))
        for mark in self.at:          # timers ahead of the step's own at the same instants
            loop.call_at(loop.time() + seconds, mark, "due")
            loop.call_at(loop.time() + seconds + async_engine._IDLE_POLL_S, mark, "poll")
        if boom:
            raise RuntimeError("engine bug")
        self._seconds = seconds
        return [SimpleNamespace(request_id="nobody", finished=False)] if output else []

    def step_seconds(self) -> float:
        return self._seconds

    def give(self, steps: list[tuple[float, bool, bool]]) -> None:
        self.script.extend(steps)


def _steps(*spec: tuple) -> list[tuple[float, bool, bool]]:
    return [(s[0], s[1], s[2] if len(s) > 2 else False) for s in spec]


async def _scenario(cls: type[AsyncEngine], crash: bool) -> list:
    loop = asyncio.get_running_loop()
    trace: list = []
    eng = Scripted(trace)
    aeng = cls(eng, "t")  # type: ignore[arg-type]

    async def marks(tag: str, n: int = 8) -> None:
        for i in range(n):
            trace.append(("mark", tag, i, loop.time()))
            await asyncio.sleep(0)

    eng.at.append(lambda tag: asyncio.ensure_future(marks(tag)))

    async def wake_with(tag: str, steps: list) -> None:
        m = asyncio.ensure_future(marks(tag))
        await aeng.call(eng.give, steps)
        await m

    aeng.start()
    await marks("start")
    await asyncio.sleep(0.01)
    # Steps with and without output, with and without modeled time: the empty ones poll.
    await wake_with("a", _steps((0.002, True), (0.0, True), (0.003, False), (0.0, False), (0.001, True)))
    await asyncio.sleep(0.0025)               # inside a poll: the wake-up ends it early
    await wake_with("b", _steps((0.001, False)))
    await asyncio.sleep(0.02)                 # every poll times out, the engine idles
    await wake_with("c", _steps((0.0, False), (0.0, False)))
    await asyncio.sleep(0.0001)               # ends the first one's poll: the second polls 5 ms
    await wake_with("d", _steps((0.004, True), (0.004, True)))
    if crash:
        await wake_with("e", _steps((0.001, True, True)))
        await asyncio.sleep(0.02)
        with pytest.raises(EngineStopped):
            await aeng.call(eng.give, [])
    else:
        await asyncio.sleep(0.011)            # stopped while d's second step is modeled
    m = asyncio.ensure_future(marks("stop"))
    await aeng.stop()
    trace.append(("stopped", loop.time()))
    await m
    await asyncio.sleep(0.05)                 # nothing runs after the stop
    trace.append(("end", loop.time()))
    return trace


@pytest.mark.parametrize("loop", [VirtualClockLoop, ReferenceVirtualLoop])
@pytest.mark.parametrize("crash", [False, True])
def test_the_chain_is_the_task_loop_hop_for_hop(loop, crash):
    chain = run_virtual(_scenario(AsyncEngine, crash), loop)
    task = run_virtual(_scenario(_TaskLoop, crash), loop)
    assert chain == task
    steps = [e[1:] for e in chain if e[0] == "step"]
    assert len(steps) == (11 if crash else 10)
    # Modeled time and polls: after an empty step the next waits for a wake-up (c's second
    # waits for d's) or 5 ms (d's first, without e's wake-up), a step with output goes on at once.
    expected = ([0.01, 0.012, 0.012, 0.015, 0.02, 0.021, 0.0325, 0.0326]
                + ([0.0326, 0.0366, 0.0406] if crash else [0.0376, 0.0416]))
    assert [t for t, _, _ in steps] == pytest.approx(expected, abs=1e-12)
    # Nothing ran after the stop (or the crash).
    last = max(i for i, e in enumerate(chain) if e[0] in ("step", "has_work"))
    assert last < chain.index(next(e for e in chain if e[0] == "stopped"))


def test_the_chain_runs_no_task():
    async def main() -> int:
        eng = Scripted([])
        aeng = AsyncEngine(eng, "t")  # type: ignore[arg-type]
        aeng.start()
        await aeng.call(eng.give, _steps((0.001, True), (0.001, False)))
        await asyncio.sleep(0.001)
        n = len(asyncio.all_tasks())
        await aeng.stop()
        return n

    assert run_virtual(main()) == 1           # main itself
