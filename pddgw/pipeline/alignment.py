"""MD cache alignment: background work that keeps MD's prefix cache aligned with P's.

When RLD finished a P-RLD-MD request before MD got its prompt KV, MD still
needs the conversation cached or the next turn misses it all.  For each such
request (`Alignments.start`):
  1. P sends what is left of the KV as background traffic (`Demote`).
  2. Once MD has the prompt KV (Ready), MD extends the output tokens on hold
     and the request is released, leaving prompt and output in MD's cache.
  3. Superseded: when the conversation's next turn opens on the same MD
     first, the alignment is dropped and the turn's Submit names it
     (`supersedes`): MD frees it but keeps the blocks already arrived.
  4. Shed: the KV bytes alignments may still move over the WAN are bounded
     (`policy.alignment_max_backlog_bytes`); past the bound the oldest are
     cancelled like superseded ones, so background KV never piles up.
  5. Tied to its nodes (`depends`): the failure of any ends it at once and
     its cleanup frees what the request holds on the nodes still reachable.
Each alignment is one task owned by the registry; `drain` waits for all,
`abandon` ends all while the links are still up.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from pddgw.net.errors import LinkError
from pddgw.net.link import Link
from pddgw import messages as m
from pddgw.pipeline.events import Event, KvReady, NodeFailed

log = structlog.get_logger(__name__)


class _NodeGone(Exception):
    """A node the alignment depends on failed (step 5)."""


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
    wan_bytes: int = 0          # KV bytes it may still move over the WAN (step 4)
    started: bool = False       # its task runs its body (a task cancelled before that never would)
    dropped: bool = False       # superseded or shed: it ends at once, releasing the request
    task: asyncio.Task[None] = field(init=False)


class Alignments:
    def __init__(self, timeout: float, control_timeout: float, max_backlog_bytes: int = 16 << 30) -> None:
        self.timeout = timeout
        self.control_timeout = control_timeout
        self.max_backlog_bytes = max_backlog_bytes
        # Insertion-ordered: the oldest alignment is shed first.
        self._pending: dict[str, _Pending] = {}
        self.counts = {"started": 0, "completed": 0, "superseded": 0, "failed": 0, "shed": 0}

    def __len__(self) -> int:
        return len(self._pending)

    @property
    def backlog_bytes(self) -> int:
        """KV bytes the pending alignments may still move over the WAN."""
        return sum(p.wan_bytes for p in self._pending.values() if not p.task.done())

    def start(self, rid: str, key: AlignKey | None, p: Link | None, md: Link, md_node: object,
              ready: bool, output_ids: tuple[int, ...], next_event: Callable[[], Awaitable[Event]],
              cleanup: Callable[[], Awaitable[None]], wan_bytes: int = 0,
              depends: tuple[object, ...] = ()) -> asyncio.Task[None]:
        """Steps 1-2 for one request, in the background, then step 4 over all.
        `next_event` yields the request's remaining events; `cleanup` (always
        awaited last) releases it; `wan_bytes`: the KV it may still move over
        the WAN (0 when MD has the prompt KV already); `depends`: the nodes
        (as the events name them) whose failure ends it (step 5; MD always)."""
        pend = _Pending(rid, key, 0 if ready else wan_bytes)
        deps = (md_node, *(d for d in depends if d is not md_node))
        pend.task = asyncio.create_task(self._run(pend, p, md, md_node, ready, output_ids, next_event, cleanup,
                                                  deps), name=f"align-{rid}")
        self._pending[rid] = pend
        pend.task.add_done_callback(lambda _: self._pending.pop(rid, None))
        self.counts["started"] += 1
        self._shed()
        return pend.task

    def _shed(self) -> None:
        """Step 4: oldest first, drop alignments until the backlog fits the bound."""
        backlog = self.backlog_bytes
        for pend in list(self._pending.values()):
            if backlog <= self.max_backlog_bytes:
                return
            if pend.task.done() or pend.dropped or not pend.wan_bytes:
                continue
            backlog -= pend.wan_bytes
            log.warning("md_alignment_shed", request_id=pend.rid, wan_bytes=pend.wan_bytes,
                        backlog_bytes=backlog + pend.wan_bytes,
                        max_backlog_bytes=self.max_backlog_bytes)
            pend.wan_bytes = 0
            self._drop(pend)
            self.counts["shed"] += 1

    @staticmethod
    def _drop(pend: _Pending) -> None:
        """End one alignment now; its cleanup still runs (a task not yet started checks `dropped`)."""
        pend.dropped = True
        if pend.started:
            pend.task.cancel()

    def supersede(self, md: str, hashes: Callable[[int], tuple[int, ...]]) -> tuple[str, ...]:
        """Step 3: drop every alignment on `md` whose first missing block the new
        prompt holds (`hashes(block_size)`: its chained block hashes); -> their ids."""
        dropped = []
        for pend in list(self._pending.values()):
            k = pend.key
            if k is None or k.md != md or pend.task.done() or pend.dropped:
                continue
            h = hashes(k.block_size)
            if k.index < len(h) and h[k.index] == k.block_hash:
                log.info("md_alignment_superseded", request_id=pend.rid)
                self._drop(pend)
                self.counts["superseded"] += 1
                dropped.append(pend.rid)
        return tuple(dropped)

    async def abandon(self) -> int:
        """The router is stopping without a drain: end every pending alignment now (each one's
        cleanup still runs, on links that are still up) instead of letting the links' closing
        fail them one by one as lost nodes; -> how many were ended."""
        pending = [p for p in self._pending.values() if not p.task.done()]
        for pend in pending:
            self._drop(pend)
        await asyncio.gather(*(p.task for p in pending), return_exceptions=True)
        if pending:
            log.info("md_alignments_abandoned", count=len(pending))
        return len(pending)

    async def drain(self) -> None:
        while self._pending:
            await asyncio.gather(*(p.task for p in list(self._pending.values())), return_exceptions=True)

    async def _run(self, pend: _Pending, p: Link | None, md: Link, md_node: object, ready: bool,
                   output_ids: tuple[int, ...], next_event: Callable[[], Awaitable[Event]],
                   cleanup: Callable[[], Awaitable[None]], depends: tuple[object, ...]) -> None:
        rid = pend.rid
        pend.started = True
        try:
            if pend.dropped:
                return
            async with asyncio.timeout(self.timeout):
                if p is not None:
                    try:
                        await p.send(m.Demote(rid), timeout=self.control_timeout)
                    except LinkError as e:
                        # P is unreachable: what it had not sent is lost with it (step 5).
                        raise _NodeGone(f"P: Demote failed: {e}") from None
                while not ready:
                    ev = await next_event()
                    if isinstance(ev, KvReady) and ev.node is md_node:
                        ready = True
                        pend.wan_bytes = 0          # the KV is on MD: nothing left to shed
                    elif isinstance(ev, NodeFailed) and any(ev.node is d for d in depends):
                        raise _NodeGone(f"{getattr(ev.node, 'name', ev.node)}: {ev.why}")
                if len(output_ids) > 1:
                    # Position 0 (P's token) is on MD already.
                    await md.request(m.Extend(rid, 1, False, output_ids[1:]), timeout=self.control_timeout)
                self.counts["completed"] += 1
        except _NodeGone as e:
            self.counts["failed"] += 1
            log.warning("md_alignment_failed", request_id=rid, error=f"node lost: {e}")
        except (LinkError, TimeoutError) as e:
            self.counts["failed"] += 1
            log.info("md_alignment_failed", request_id=rid, error=str(e) or type(e).__name__)
        finally:
            await asyncio.shield(cleanup())
