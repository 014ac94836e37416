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
its next queues at the last turn, behind every call waiting then: the relay and main decode
step at least once in that many prefill steps, and no turn starves another.

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
    """A single worker thread running submitted calls by (turn, arrival)."""

    def __init__(self, name: str = "pddgw-compute") -> None:
        self._waiting: list[tuple[int, int, Callable[..., Any], tuple[Any, ...], concurrent.futures.Future]] = []
        self._arrival = itertools.count()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, turn: Turn, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._cond:
            heapq.heappush(self._waiting, (turn, next(self._arrival), fn, args, fut))
            self._cond.notify()
        return fut

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting:
                    self._cond.wait()
                _, _, fn, args, fut = heapq.heappop(self._waiting)
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
