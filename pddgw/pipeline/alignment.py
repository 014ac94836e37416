"""MD cache alignment: background work that keeps MD's prefix cache aligned with P's.

When RLD finished a P-RLD-MD request before MD got its prompt KV, nobody
waits for that KV any more, but MD still needs the conversation in its
prefix cache or the next turn misses it all.  For each such request
(`Alignments.start`), in order:
  1. P is told to send what is left of the request's KV as background
     traffic (`Demote`): live requests' transfers overtake it on the WAN.
  2. Once MD has the prompt KV (its Ready), MD extends the output tokens on
     hold (their KV is computed, nothing sampled) and the request is
     released, leaving prompt and output in MD's cache.
  3. Superseded: when the same conversation's next turn opens on the same
     MD first (its prompt holds the first block this alignment moves), the
     alignment is dropped - that turn's prefill sends MD what it lacks
     anyway.  The turn's Submit names the dropped request (`supersedes`), so
     MD frees it before matching the turn's prefix and keeps the blocks that
     already arrived (`Engine.abort`): the turn finds them cached.
Each alignment runs as one task owned by the registry; `drain` waits for all.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from pddgw.net.errors import LinkError
from pddgw.net.link import Link
from pddgw.pipeline import protocol as pm
from pddgw.pipeline.events import Event, KvReady, NodeFailed

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class AlignKey:
    """The first prompt block MD lacked: (the MD, its block size, block index, chained hash)."""

    md: str
    block_size: int
    index: int
    block_hash: int


@dataclass(slots=True)
class _Pending:
    rid: str
    key: AlignKey | None
    task: asyncio.Task[None]


class Alignments:
    def __init__(self, timeout: float, control_timeout: float) -> None:
        self.timeout = timeout
        self.control_timeout = control_timeout
        self._pending: dict[str, _Pending] = {}
        self.counts = {"started": 0, "completed": 0, "superseded": 0, "failed": 0}

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, rid: str, key: AlignKey | None, p: Link | None, md: Link, md_node: object,
              ready: bool, output_ids: tuple[int, ...], next_event: Callable[[], Awaitable[Event]],
              cleanup: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Steps 1-2 for one request, in the background.  `next_event` yields the
        request's remaining events; `cleanup` (always awaited last) releases it."""
        task = asyncio.create_task(self._run(rid, p, md, md_node, ready, output_ids, next_event, cleanup),
                                   name=f"align-{rid}")
        self._pending[rid] = _Pending(rid, key, task)
        task.add_done_callback(lambda _: self._pending.pop(rid, None))
        self.counts["started"] += 1
        return task

    def supersede(self, md: str, hashes: Callable[[int], tuple[int, ...]]) -> tuple[str, ...]:
        """Step 3: drop every alignment on `md` whose first missing block the new
        prompt holds (`hashes(block_size)`: its chained block hashes); -> their ids."""
        dropped = []
        for pend in list(self._pending.values()):
            k = pend.key
            if k is None or k.md != md or pend.task.done():
                continue
            h = hashes(k.block_size)
            if k.index < len(h) and h[k.index] == k.block_hash:
                log.info("md_alignment_superseded", request_id=pend.rid)
                pend.task.cancel()
                self.counts["superseded"] += 1
                dropped.append(pend.rid)
        return tuple(dropped)

    async def drain(self) -> None:
        while self._pending:
            await asyncio.gather(*(p.task for p in list(self._pending.values())), return_exceptions=True)

    async def _run(self, rid: str, p: Link | None, md: Link, md_node: object, ready: bool,
                   output_ids: tuple[int, ...], next_event: Callable[[], Awaitable[Event]],
                   cleanup: Callable[[], Awaitable[None]]) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                if p is not None:
                    with contextlib.suppress(LinkError):
                        await p.send(pm.Demote(rid), timeout=self.control_timeout)
                while not ready:
                    ev = await next_event()
                    if isinstance(ev, KvReady) and ev.node is md_node:
                        ready = True
                    elif isinstance(ev, NodeFailed) and ev.node is md_node:
                        self.counts["failed"] += 1
                        return
                if len(output_ids) > 1:
                    # Position 0 (P's token) is on MD already.
                    await md.request(pm.Extend(rid, 1, False, output_ids[1:]), timeout=self.control_timeout)
                self.counts["completed"] += 1
        except (LinkError, TimeoutError) as e:
            self.counts["failed"] += 1
            log.info("md_alignment_failed", request_id=rid, error=str(e))
        finally:
            await asyncio.shield(cleanup())
