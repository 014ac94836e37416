"""The end of every reliability test: nothing left in use anywhere.

`state` is the router's `/debug/state` document (RouterSide.state): the
router's own in-flight counters and every node's pool and in-flight entries.
Work that outlives a response (MD alignment, the Cancels of `_release`) may
still be finishing when a test's last response arrives, so `wait_quiescent`
polls until everything is zero, then the caller holds an exact document.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from pddgw.bench.common import state_leftovers

State = Callable[[], Awaitable[dict[str, Any]]]


async def wait_quiescent(state: State, timeout: float = 60.0) -> dict[str, Any]:
    """Poll until `state_leftovers` is empty (-> the quiet document); AssertionError with what is left."""
    deadline = time.monotonic() + timeout
    while True:
        doc = await state()
        left = state_leftovers(doc)
        if not left:
            return doc
        if time.monotonic() > deadline:
            raise AssertionError(f"still in use after {timeout:.0f} s: {left}")
        await asyncio.sleep(0.1)
