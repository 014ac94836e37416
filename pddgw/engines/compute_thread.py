"""One compute thread for the multi-threaded CPU engines of a process: they take turns on its cores.

Why one thread: torch (and the C kernels) parallelise with OpenMP, and every OS thread that
opens a parallel region keeps a team of worker threads for its life.  Engines on threads of
their own each had a team; two teams on two cores either spin against each other (a decode
step beside a prefill took ~200 instead of 36 ms) or, once the teams hold more threads than
the process has CPUs, libgomp stops spinning and wakes workers by futex (a decode step 50
instead of 33 ms).  On one thread there is one team: each step has every core, and the
embedded deployment (P, RLD and MD in one process on 2 cores) served 1.3 x the tokens/s of
engines on threads of their own, its opening burst's TTFT P99 1.9 instead of 3.4 s.

Order: the calls waiting run by `Turn`, then arrival: short control calls (admissions, KV
imports and exports, aborts) first, then a prefill's step (a prompt waiting holds a first
token), a relay's, a main decode's.  An engine has at most one step waiting.  While prompts
are left to compute, a prefill engine's next step is queued as its last ends (async_engine.py,
`PREFILL_STREAK`), so a burst of prompts is prefilled back to back; every PREFILL_STREAK steps
(one more when that one computes every prompt token left) its next queues `behind` every call
waiting then, and no call but a control call that arrives later goes before it: the relay and
main decode step once in that many prefill steps, and no turn starves another (were the relay's
next step to go first, the relay would step as long as it had work, the prefill waiting).

The GIL: between its kernels a step needs the GIL back from the event loop, and both cores
wait for it; the interpreter makes the loop hand it over after `SWITCH_INTERVAL_S` (its
default is 5 ms).  Measured (embedded `pddgw serve` under vLLM's client, five runs alternated
with six at 5 ms): P's 512-token steps 139 instead of 146 ms on average, TTFT P99 ~4 % lower,
tokens/s unchanged.

Contract: a call runs to its end before the next starts (engines need no locks); a call's
exception is its future's; the thread lives as long as the process (a daemon).
"""

from __future__ import annotations

import concurrent.futures
import heapq
import itertools
import sys
import threading
from collections.abc import Callable
from enum import IntEnum
from typing import Any, TypeVar

T = TypeVar("T")


class Turn(IntEnum):
    """Who goes first among the calls waiting for the thread (lower first)."""

    CONTROL = 0
    PREFILL = 1
    RELAY = 2
    DECODE = 3


class ComputeThread:
    """A single worker thread running submitted calls by (round, turn, arrival)."""

    def __init__(self, name: str = "pddgw-compute") -> None:
        # (round, turn, arrival, ...): a call queued `behind` opens a round; control calls are in round 0.
        self._waiting: list[tuple[int, int, int, Callable[..., Any], tuple[Any, ...], concurrent.futures.Future]] = []
        self._arrival = itertools.count()
        self._round = 0
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, turn: Turn, fn: Callable[..., T], *args: Any,
               behind: bool = False) -> concurrent.futures.Future[T]:
        """Run fn(*args) in its turn; `behind`: after every call waiting now whatever its turn (not a
        control call), the calls arriving later then by turn as usual."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            if behind:
                self._round += 1
            rnd = 0 if turn == Turn.CONTROL else self._round
            heapq.heappush(self._waiting, (rnd, turn, next(self._arrival), fn, args, fut))
            self._cond.notify()
        return fut

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                _, _, _, fn, args, fut = heapq.heappop(self._waiting)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 (the caller's to handle, as an executor does)
                fut.set_exception(e)


_lock = threading.Lock()
_shared: ComputeThread | None = None
SWITCH_INTERVAL_S = 1e-4         # the GIL's hand-over once the compute thread runs (docstring)


def shared() -> ComputeThread:
    """The process's compute thread, started on first use (and the GIL's interval set then)."""
    global _shared
    with _lock:
        if _shared is None:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            _shared = ComputeThread()
        return _shared
