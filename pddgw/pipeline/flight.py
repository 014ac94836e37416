"""One request in flight on the router: its state, and what it holds on nodes as reservations.

A `Flight` is the router's record of one request across its attempts.  What
the request counts on shared counters (a node's `inflight`, `prefills`,
`relays`, `relay_tokens`, `prefill_backlog`; the router's `wan_backlog`) it
holds as `Reservation`s in its `Ledger`: each adds its amounts when taken and
takes them back on `release`, at most once.  Invariants:
  * a key is held at most once (taking a held key again is a no-op), so a
    node involved twice counts once;
  * every exit of a request (and of each failed attempt) ends in
    `Ledger.release_all`, in `Router.release`, so no path can leave a counter
    raised; releasing early (a prefill done, a handoff ended) is only ever
    sooner, never instead.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from pddgw.core.roles import Pipeline, Role
from pddgw.core.sampling import SamplingParams
from pddgw.core.tokens import TokenLogprobs, TokenRun
from pddgw.engines.prompt_hashes import prompt_hashes
from pddgw.metrics import RouterMetrics
from pddgw.pipeline.events import StreamReader
from pddgw.pipeline.ordering import StreamMerger
from pddgw.pipeline.state import HandoffMode, RequestState, RequestTracker

Emit = Callable[[TokenRun], Awaitable[None]]


class Reservation:
    """`amounts` added to the named int attributes of `owner` until `release` (idempotent)."""

    __slots__ = ("amounts", "owner", "released")

    def __init__(self, owner: Any, amounts: dict[str, int]) -> None:
        self.owner = owner
        self.amounts = amounts
        self.released = False
        for name, n in amounts.items():
            setattr(owner, name, getattr(owner, name) + n)

    def release(self) -> bool:
        """Take the amounts back; -> False when they were taken back already."""
        if self.released:
            return False
        self.released = True
        for name, n in self.amounts.items():
            setattr(self.owner, name, getattr(self.owner, name) - n)
        return True


class Ledger:
    """One request's reservations by key, in the order taken (see the module docstring)."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: dict[Hashable, Reservation] = {}

    def take(self, key: Hashable, owner: Any, **amounts: int) -> Reservation:
        held = self._held.get(key)
        if held is not None and not held.released:
            return held
        self._held.pop(key, None)          # a new one goes last: the order is the order taken
        held = self._held[key] = Reservation(owner, amounts)
        return held

    def holder(self, key: Hashable) -> Any:
        """The owner of the live reservation `key` (None: not held)."""
        held = self._held.get(key)
        return None if held is None or held.released else held.owner

    def release(self, key: Hashable) -> bool:
        """Release `key`; -> whether it was held."""
        held = self._held.pop(key, None)
        return held is not None and held.release()

    def owners(self, kind: str) -> list[Any]:
        """Owners of the live reservations keyed `(kind, ...)`, in the order taken."""
        return [r.owner for k, r in self._held.items()
                if isinstance(k, tuple) and k[0] == kind and not r.released]

    def release_all(self) -> None:
        held, self._held = self._held, {}
        for r in held.values():
            r.release()


@dataclass(slots=True)
class Flight:
    """Everything of one request in flight on the router."""

    rid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    tracker: RequestTracker
    merger: StreamMerger
    emit: Emit
    ledger: Ledger = field(default_factory=Ledger)
    # Nodes this request lost, by name, with their link's reconnect count then: a link that
    # reconnected since reaches the restarted process, which may take the request again.
    lost: dict[str, int] = field(default_factory=dict)
    finish_reason: str = ""
    cached_tokens: int = 0
    # Work that outlives the response (MD cache alignment); it releases the request.
    background: asyncio.Task[None] | None = None
    # Per-request overrides of the policy (None = decide).
    force_pipeline: Pipeline | None = None
    force_handoff: HandoffMode | None = None
    # The prompt's chained block hashes, per block size.
    hashes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Prompt tokens the chosen P caches (what it need not compute).
    p_cached_tokens: int = 0
    # A decoder opened it (holds KV for it): its release frees room others may wait for.
    holds_room: bool = False
    # Seconds it waited in the room queue (all its waits).
    queue_s: float = 0.0
    # The node that last computed the prompt (P; a re-drive's decoder): it keeps the prompt
    # logprobs of a request asking for them until the Cancel.
    scorer: Any = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    def block_hashes(self, block_size: int) -> tuple[int, ...]:
        if block_size not in self.hashes:
            self.hashes[block_size] = prompt_hashes(self.prompt, block_size)
        return self.hashes[block_size]

    def exclude(self, node: Any) -> None:
        """`node` failed this request: no attempt goes there again until its link reconnects."""
        self.lost[node.name] = node.link.stats.reconnects

    def excludes(self, node: Any) -> bool:
        return self.lost.get(node.name) == node.link.stats.reconnects

    def involve(self, node: Any) -> None:
        """`node` holds something of the request (counted in its `inflight` once) until the Cancel."""
        self.ledger.take(("node", node.name), node, inflight=1)

    @property
    def involved(self) -> list[Any]:
        """The nodes involved, in the order they were (the final Cancels go in this order)."""
        return self.ledger.owners("node")

    def reader(self, node: Any, role: Role, vocab_size: int) -> StreamReader:
        """The edge of a decoder's stream (its tokens credited to `role`): the logprobs it must
        carry (k, or none)."""
        k = self.sampling.logprobs
        return StreamReader(node, role, None if k is None else min(k, vocab_size))

    async def deliver(self, got: TokenRun, metrics: RouterMetrics) -> None:
        """A decoder's run (or P's first token): merged by position, each run now in order
        emitted and counted."""
        tr = self.tracker
        if got.ids:
            state = tr.state
            if state == RequestState.PREFILLING and got.role != Role.PREFILL:   # not P's first token
                tr.advance(RequestState.MD_DECODING if got.role == Role.MD else RequestState.RLD_DECODING)
            elif got.role == Role.MD and state == RequestState.HANDING_OFF:
                tr.advance(RequestState.MD_DECODING)
            for run in self.merger.push(got):
                prev = tr.last_emission_t
                count, role = len(run.ids), run.role
                assert role is not None               # the merger's runs name their decoder
                now = tr.tokens_emitted(run.position, count, role)
                metrics.emitted(role, count, now, prev, tr.t0, len(self.prompt))
                await self.emit(run)
        if got.done and got.reason in ("stop", "length"):
            self.merger.seal(got.end)
            self.finish_reason = got.reason


class NodeLost(Exception):
    def __init__(self, node: Any, why: str):
        super().__init__(f"{node.role} {node.name}: {why}")
        self.node = node


class NoRoom(Exception):
    """A node refused the request for lack of room (KV, or prefill slots): not a failure."""


async def both(a: Awaitable[Any], b: Awaitable[Any]) -> tuple[Any, Any]:
    """Both results; when one fails, the other is cancelled (and awaited) before the error
    propagates, so nothing it does runs on after the request released what it held."""
    ta, tb = asyncio.ensure_future(a), asyncio.ensure_future(b)
    try:
        return await ta, await tb
    finally:
        await cancel_all([t for t in (ta, tb) if not t.done()])


async def cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
