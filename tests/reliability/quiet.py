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

State = Callable[[], Awaitable[dict[str, Any]]]


def leftovers(state: dict[str, Any]) -> dict[str, Any]:
    """Everything non-zero that should be zero at rest (empty: quiescent)."""
    out: dict[str, Any] = {}
    router = state["router"]
    busy = {k: v for k, v in router["inflight"].items() if v}
    if router["active_requests"]:
        busy["active_requests"] = router["active_requests"]
    if busy:
        out["router"] = busy
    for name, node in state["nodes"].items():
        if not node.get("healthy", True):
            continue            # a node the test killed holds nothing any more
        nb = {k: v for k, v in node["inflight"].items() if v}
        if node["kv_blocks_in_use"]:
            nb["kv_blocks_in_use"] = node["kv_blocks_in_use"]
        if nb:
            out[name] = nb
    return out


async def wait_quiescent(state: State, timeout: float = 60.0) -> dict[str, Any]:
    """Poll until `leftovers` is empty (-> the quiet document); AssertionError with what is left."""
    deadline = time.monotonic() + timeout
    while True:
        doc = await state()
        left = leftovers(doc)
        if not left:
            return doc
        if time.monotonic() > deadline:
            raise AssertionError(f"still in use after {timeout:.0f} s: {left}")
        await asyncio.sleep(0.1)
