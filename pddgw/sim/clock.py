"""The virtual clock `pddgw sim` runs on.

An asyncio loop whose time jumps to the next timer whenever nothing is
ready, so every `asyncio.sleep`, timeout, heartbeat, shaped transfer and
cost-model engine step takes virtual time and no wall time.  It is
`looptime`'s loop (a maintained library made for exactly this, in tests) on
a plain selector loop, with two settings that matter here:

* `noop_cycles=0`: looptime normally spins 42 idle loop iterations before
  each jump, to let code that talks to threads or sockets catch up.  A
  simulated deployment has neither (in-process links, engines that run
  inline), and a 1,000-request run makes ~10^6 jumps, so those spins would
  cost more than the simulation itself.
* integer time at 1 us resolution (looptime's own): sums of many float
  delays do not drift, so the same scenario gives the same timings, run
  after run.

Runs are deterministic as long as the code on the loop uses no threads and
no real I/O, which holds for the cost-model engine and in-process links.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import looptime

T = TypeVar("T")


def new_virtual_loop() -> asyncio.AbstractEventLoop:
    """A fresh loop on virtual time, starting at t = 0."""
    return looptime.patch_event_loop(asyncio.SelectorEventLoop(), start=0.0, noop_cycles=0)


def run_virtual(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on a virtual clock."""
    with asyncio.Runner(loop_factory=new_virtual_loop) as runner:
        return runner.run(coro)
