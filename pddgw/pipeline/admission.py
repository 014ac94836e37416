"""Back-pressure: requests wait, in order, for KV room on a full decoder (or a P with room).

A decoder refuses to open an import it cannot hold (`capacity`): that is a
full node, not a lost one (so is a P running the most prefills the router
gives it: router.py).  The router then frees what the request holds and
queues it here; the queue is FIFO and bounded (`server.max_queued_requests`,
`server.max_queue_wait_s`), and only a request past a bound is refused, with
an `overloaded` error that names the bound.

Wake-ups go one at a time, so a freed slot does not send every waiter to the
decoder at once: each request the router releases wakes the head of the
queue; a head that opens wakes the next one (there may be room for more), a
head that is refused again goes back to the front.  Room can also free where
the router does not see it (background alignments, another router), so an
unwoken head retries after `retry_s` on the loop's clock.

Lifecycle of a waiter: queued -> woken (its future set) -> gone (it returned,
was refused, timed out or was cancelled: `wait`'s `finally` removes it).
"""

from __future__ import annotations

import asyncio
from collections import deque

import structlog

log = structlog.get_logger(__name__)


class Overloaded(Exception):
    """The queue's bound was hit; the message names it."""


class RoomQueue:
    def __init__(self, max_waiting: int, max_wait_s: float, retry_s: float = 0.5) -> None:
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self.retry_s = retry_s
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.refused = 0          # requests refused at a bound
        self.waited = 0           # waits that ended with a retry

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, rid: str, why: str, *, front: bool = False) -> None:
        """Wait for a turn to retry; `front`: a head refused again keeps its place.

        Raises Overloaded when the queue is full or the wait passes its bound.
        """
        if not front and len(self._waiters) >= self.max_waiting:
            self.refused += 1
            raise Overloaded(f"{len(self._waiters)} requests already wait for KV room "
                             f"(server.max_queued_requests = {self.max_waiting})")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        if front:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        # Once per request: a head refused again is still the same wait.
        (log.debug if front else log.info)("request_queued", request_id=rid, waiting=len(self._waiters), why=why)
        deadline = loop.time() + self.max_wait_s
        try:
            while not fut.done():
                left = deadline - loop.time()
                if left <= 0:
                    self.refused += 1
                    raise Overloaded(f"no KV room within {self.max_wait_s:g} s "
                                     f"(server.max_queue_wait_s): {why}")
                await asyncio.wait([fut], timeout=min(left, self.retry_s))
                if self._waiters[0] is fut and loop.time() < deadline:
                    break       # the head retries on its own when nothing woke it
        finally:
            self._remove(fut)
        self.waited += 1

    def wake(self) -> None:
        """Room may have freed: the head of the queue retries."""
        # A woken head leaves the queue as soon as it runs: until then it is the one retrying.
        if self._waiters and not self._waiters[0].done():
            self._waiters[0].set_result(None)

    def _remove(self, fut: asyncio.Future[None]) -> None:
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass
