"""The process's compute thread (pddgw/engines/compute_thread.py): calls by turn then arrival,
one at a time on one thread, failures to their callers; the multi-threaded CPU engines of a
process share it, and one-off engine work runs on a thread that ends."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest

from pddgw.engines import async_engine, compute_thread
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


def test_a_call_queued_behind_runs_after_every_call_waiting_then_and_before_later_ones():
    ct = ComputeThread(name="test-compute-behind")
    gate = threading.Event()
    order: list[str] = []
    ct.submit(Turn.DECODE, gate.wait)
    for turn, tag in ((Turn.DECODE, "md-1"), (Turn.RELAY, "rld-1")):
        ct.submit(turn, order.append, tag)
    behind = ct.submit(Turn.PREFILL, order.append, "p", behind=True)
    later = [ct.submit(turn, order.append, tag) for turn, tag in ((Turn.RELAY, "rld-2"), (Turn.CONTROL, "import"),
                                                                   (Turn.PREFILL, "p-2"), (Turn.DECODE, "md-2"))]
    gate.set()
    for f in (behind, *later):
        f.result(timeout=30)
    assert order == ["import", "rld-1", "md-1", "p", "p-2", "rld-2", "md-2"]


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


def _prefill_engine(model, steps: int, on_step, monkeypatch) -> tuple[AsyncEngine, ComputeThread]:
    """A prefill engine on a compute thread of its own whose one request takes `steps` steps (16
    prompt tokens each, the first token with the last), `on_step(n)` called as step n begins."""
    ct = ComputeThread(name="test-compute-streak")
    monkeypatch.setattr(compute_thread, "shared", lambda: ct)
    engine = make_engine(model, cpu_threads=2, max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64)
    real, count = engine.step, iter(range(1, 1000))

    def step():
        on_step(next(count))
        return real()
    engine.step = step
    aeng = AsyncEngine(engine, "p", Turn.PREFILL)
    return aeng, ct


def test_a_prefill_engine_steps_back_to_back_and_yields_every_streak(tiny64, monkeypatch):
    """Steps of the other engines queued during the streak run after its PREFILL_STREAK-th step
    (relay first), control calls between any two steps; the streak then goes on."""
    monkeypatch.setattr(async_engine, "PREFILL_STREAK", 3)
    order: list[str] = []
    ct_box: list[ComputeThread] = []

    def on_step(n: int) -> None:
        order.append(f"P{n}")
        ct = ct_box[0]
        if n == 2:      # the relay's and main decode's steps arrive mid-streak
            ct.submit(Turn.DECODE, order.append, "MD")
            ct.submit(Turn.RELAY, order.append, "RLD")
        if n == 4:
            ct.submit(Turn.CONTROL, order.append, "import")

    async def main() -> list[int]:
        aeng, ct = _prefill_engine(tiny64, 7, on_step, monkeypatch)
        ct_box.append(ct)
        aeng.start()
        ids = [t async for out in aeng.generate(req("r", list(range(3, 3 + 7 * 16)), 1)) for t in out.ids]
        await aeng.stop()
        return ids

    assert len(asyncio.run(main())) == 1
    assert order == ["P1", "P2", "P3", "RLD", "MD", "P4", "import", "P5", "P6", "P7"]


def test_a_relay_stepping_again_does_not_pass_the_streak_s_next_step(tiny64, monkeypatch):
    """The relay queues its next step as its last ends (as its engine loop does): that step waits
    for P's, which was queued behind the relay's first at the streak's end."""
    monkeypatch.setattr(async_engine, "PREFILL_STREAK", 2)
    order: list[str] = []
    ct_box: list[ComputeThread] = []

    def relay(n: int) -> None:
        order.append(f"RLD{n}")
        if n < 3:
            ct_box[0].submit(Turn.RELAY, relay, n + 1)

    def on_step(n: int) -> None:
        order.append(f"P{n}")
        if n == 1:
            ct_box[0].submit(Turn.RELAY, relay, 1)

    async def main() -> None:
        aeng, ct = _prefill_engine(tiny64, 7, on_step, monkeypatch)
        ct_box.append(ct)
        aeng.start()
        async for _ in aeng.generate(req("r", list(range(3, 3 + 7 * 16)), 1)):
            pass
        await aeng.stop()
        await asyncio.wrap_future(ct.submit(Turn.DECODE, lambda: None))     # whatever was queued has run

    asyncio.run(main())
    # P7, the burst's last step, goes before RLD3 (the next test).
    assert order == ["P1", "P2", "RLD1", "P3", "P4", "RLD2", "P5", "P6", "P7", "RLD3"]


def test_a_paged_engine_tells_when_its_next_step_ends_every_prompt(tiny64):
    """Prompt tokens left within the step's token budget (16) and its sequences (4)."""
    engine = make_engine(tiny64, max_num_batched_tokens=16, max_num_seqs=4, num_blocks=64)
    engine.add_request(req("a", list(range(3, 3 + 24)), 1))
    assert (engine.prompt_work(), engine.prompt_ends_next_step()) == (True, False)
    engine.step()                                        # 16 of 24 computed
    assert (engine.prompt_work(), engine.prompt_ends_next_step()) == (True, True)
    for i in range(3):
        engine.add_request(req(f"b{i}", [5, 6], 1))      # 8 + 3 x 2 tokens, 4 sequences
    assert engine.prompt_ends_next_step()
    engine.add_request(req("c", [7, 8], 1))              # a 5th sequence
    assert not engine.prompt_ends_next_step()
    while engine.has_work():
        engine.step()
    assert (engine.prompt_work(), engine.prompt_ends_next_step()) == (False, True)


@pytest.mark.parametrize("steps, order", [
    (4, ["P1", "P2", "P3", "P4", "RLD"]),            # the 4th computes every prompt token left
    (5, ["P1", "P2", "P3", "RLD", "P4", "P5"]),
])
def test_a_streak_due_to_yield_first_takes_the_step_that_ends_its_prompts(tiny64, monkeypatch, steps, order):
    """The relay waits one step more rather than the burst's last prompts waiting for it; a
    step more only: the streak yields as before where two are left."""
    monkeypatch.setattr(async_engine, "PREFILL_STREAK", 3)
    seen: list[str] = []
    ct_box: list[ComputeThread] = []

    def on_step(n: int) -> None:
        seen.append(f"P{n}")
        if n == 1:
            ct_box[0].submit(Turn.RELAY, seen.append, "RLD")

    async def main() -> None:
        aeng, ct = _prefill_engine(tiny64, steps, on_step, monkeypatch)
        ct_box.append(ct)
        aeng.start()
        async for _ in aeng.generate(req("r", list(range(3, 3 + steps * 16)), 1)):
            pass
        await aeng.stop()
        await asyncio.wrap_future(ct.submit(Turn.DECODE, lambda: None))     # whatever was queued has run

    asyncio.run(main())
    assert seen == order


def test_no_step_of_a_streak_runs_once_the_engine_is_stopped(tiny64, monkeypatch):
    closed_at_step: list[bool] = []
    box: list[AsyncEngine] = []
    second = threading.Event()

    def on_step(n: int) -> None:
        closed_at_step.append(box[0]._closed)
        if n == 2:
            second.set()

    async def main() -> None:
        aeng, ct = _prefill_engine(tiny64, 50, on_step, monkeypatch)
        box.append(aeng)
        aeng.start()
        await aeng.add(req("r", [3 + i % 300 for i in range(50 * 16)], 1))
        await asyncio.get_running_loop().run_in_executor(None, second.wait, 30)
        await aeng.stop()
        await asyncio.wrap_future(ct.submit(Turn.DECODE, lambda: None))     # whatever was queued has run

    asyncio.run(main())
    assert 2 <= len(closed_at_step) < 50 and not any(closed_at_step)


def test_a_prefill_engine_s_decodes_alone_do_not_run_back_to_back(tiny64, monkeypatch):
    """A relaying P decodes what it prefilled: once no prompt is left to compute, each of its steps
    is queued by the event loop after the last one's outputs, as any engine's is, not by the last
    step on the compute thread, so what was queued meanwhile is not pushed behind it.  (Which of
    a decode step and a call queued meanwhile runs first is then the thread's turn order against
    the loop's timing: pinned here is who queues.)"""
    queued_by: list[str] = []

    async def main() -> list[int]:
        aeng, ct = _prefill_engine(tiny64, 1, lambda n: None, monkeypatch)
        submit = ct.submit

        def recording(turn, fn, *args, behind=False):
            if getattr(fn, "__name__", "") == "_step_and_queue":
                queued_by.append(threading.current_thread().name)
            return submit(turn, fn, *args, behind=behind)

        monkeypatch.setattr(ct, "submit", recording)
        aeng.start()
        ids = [t async for out in aeng.generate(req("r", list(range(3, 19)), 4)) for t in out.ids]
        await aeng.stop()
        return ids

    assert len(asyncio.run(main())) == 4
    # Step 1 computes the 16-token prompt; steps 2-4 decode, each queued by the loop.
    assert queued_by == [threading.main_thread().name] * 4


def test_the_shared_thread_has_the_loop_hand_over_the_gil_sooner():
    """Once a process has its compute thread, another thread holding the GIL gives it up after
    SWITCH_INTERVAL_S (0.1 ms), not the interpreter's 5 ms (the module docstring says why)."""
    code = ("import sys; from pddgw.engines import compute_thread as c; before = sys.getswitchinterval(); "
            "c.shared(); c.shared(); print(round(before * 1e6), round(sys.getswitchinterval() * 1e6))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["5000", "100"]                   # microseconds
