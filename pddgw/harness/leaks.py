"""What a quiet deployment shows, and waiting until it does (docs/architecture.md, The five invariants: 4).

The router's GET /debug/state document holds the router's in-flight
counters and, per node, its KV blocks in use and in-flight entries
(requests, transfers, sessions, pins, streams).  Work that outlives a
response (MD alignment, the Cancels of a release) may still be finishing
when the last response arrives, so callers poll (`wait_until_quiet`) until
`state_leftovers` is empty, then hold an exact document.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import aiohttp

State = Callable[[], Awaitable[dict[str, Any]]]


def state_leftovers(state: dict[str, Any]) -> dict[str, Any]:
    """Everything non-zero in the router's /debug/state document that should be zero at
    rest (empty: quiet): the router's in-flight counters, and per reachable node its KV
    blocks in use and in-flight entries (a node that is down holds nothing any more)."""
    out: dict[str, Any] = {}
    router = state["router"]
    busy = {k: v for k, v in router["inflight"].items() if v}
    if router["active_requests"]:
        busy["active_requests"] = router["active_requests"]
    if busy:
        out["router"] = busy
    for name, node in state["nodes"].items():
        if not node.get("healthy", True):
            continue
        nb = {k: v for k, v in node["inflight"].items() if v}
        if node["kv_blocks_in_use"]:
            nb["kv_blocks_in_use"] = node["kv_blocks_in_use"]
        if nb:
            out[name] = nb
    return out


def count_leaks(left: dict[str, Any]) -> tuple[int, int, int]:
    """`state_leftovers` -> (KV blocks, pins, every other in-flight entry; a byte counter counts once)."""
    blocks = pins = inflight = 0
    for entries in left.values():
        for k, v in entries.items():
            if k == "kv_blocks_in_use":
                blocks += v
            elif k == "pins":
                pins += v
            elif k.endswith("_bytes"):
                inflight += 1
            else:
                inflight += v
    return blocks, pins, inflight


@dataclass(frozen=True, slots=True)
class Leaks:
    quiet: bool                        # everything reached zero within the quiet timeout
    waited_s: float
    blocks: int                        # KV blocks in use on healthy nodes
    pins: int                          # prefix pins on healthy nodes
    inflight: int                      # every other in-flight entry (router and nodes; bytes count as 1)
    leftovers: dict[str, Any]
    unhealthy_nodes: list[str]         # not checked: the router could not reach them at the end


def _unreached(doc: dict[str, Any], expect_healthy: Collection[str]) -> bool:
    nodes = doc.get("nodes", {})
    return any(not nodes.get(n, {}).get("healthy", True) for n in expect_healthy)


async def wait_until_quiet(state: State, timeout_s: float, interval_s: float = 0.2,
                           expect_healthy: Collection[str] = ()) -> tuple[dict[str, Any], dict[str, Any], float]:
    """Poll `state()` until `state_leftovers` is empty or `timeout_s` passed.

    -> (leftovers, the last document, seconds waited).  A document that does not
    come (the router unreachable) counts as a leftover of the router.  Nodes in
    `expect_healthy` (restarted ones: their links redial) are waited for too
    until the router reports them healthy, so that their pools are checked.
    """
    t0 = time.monotonic()
    doc: dict[str, Any] = {}
    while True:
        try:
            doc = await state()
            left = state_leftovers(doc)
        except (TimeoutError, aiohttp.ClientError, KeyError, ValueError) as e:
            left = {"router": {"state": f"unreachable: {e!r}"[:200]}}
        waited = time.monotonic() - t0
        if (not left and not _unreached(doc, expect_healthy)) or waited > timeout_s:
            return left, doc, waited
        await asyncio.sleep(interval_s)


async def wait_quiescent(state: State, timeout: float = 60.0) -> dict[str, Any]:
    """Until `state_leftovers` is empty (-> the quiet document); AssertionError with what is left."""
    left, doc, _ = await wait_until_quiet(state, timeout, 0.1)
    if left:
        raise AssertionError(f"still in use after {timeout:.0f} s: {left}")
    return doc


def router_state(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> State:
    """GET `url`/debug/state on `session` (the router's: no credentials needed)."""
    async def get() -> dict[str, Any]:
        async with session.get(url + "/debug/state", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return await r.json()
    return get


async def measure_leaks(state: State, timeout_s: float,
                        expect_healthy: Collection[str] = ()) -> tuple[Leaks, dict[str, Any]]:
    """Wait until quiet (or the timeout) -> (what is left, counted; the last document)."""
    left, doc, waited = await wait_until_quiet(state, timeout_s, expect_healthy=expect_healthy)
    blocks, pins, inflight = count_leaks({k: {kk: vv for kk, vv in v.items() if isinstance(vv, int)}
                                          for k, v in left.items()})
    if left and not (blocks or pins or inflight):
        inflight = 1                    # the router did not answer: nothing is known to be free
    unhealthy = sorted(n for n, s in doc.get("nodes", {}).items() if not s.get("healthy", True))
    return Leaks(not left, round(waited, 2), blocks, pins, inflight, left, unhealthy), doc
