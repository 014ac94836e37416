"""A worker node (prefill, rld or md): its engine, its workers and its message handler.

The node never decides anything: it does what the router's messages say and
reports back.  Links arrive from the router (control, token streams), from P
(KV) and from RLD (handoffs); the node dials P -> decoders and RLD -> MD
itself through `connect`.  Every inbound message is decoded and validated at
the edge (net) and dispatched here by type; an error becomes an `Error` reply
naming the problem, and the node keeps serving.  Metrics
(`WorkerNode.metrics`) are read at scrape time.

Drain (`drain`, on SIGTERM): no new request is taken (Error "draining") and
every known router is told (`m.Draining`); what is in flight gets
`DRAIN_FINISH_SHARE` of the bound to finish; what is left is moved (Error
"draining" to its router, which re-drives it) or, if its router cannot be
told, dropped and counted.  The steps in detail: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import structlog

from pddgw import messages as m
from pddgw.core.roles import Role
from pddgw.core.tokens import TokenLogprobs, TokenRun
from pddgw.engines.async_engine import AsyncEngine
from pddgw.engines.base import Engine
from pddgw.engines.compute_thread import Turn
from pddgw.engines.types import CapacityError, KVChunk, KVSpan, RequestError
from pddgw.metrics import NodeMetrics
from pddgw.net.errors import LinkError
from pddgw.net.link import Link, LinkState
from pddgw.pipeline.decode import DecodeWorker
from pddgw.pipeline.handoff import relay_handoff, round_sender
from pddgw.pipeline.prefill import FirstSink, KVTarget, PrefillWorker

log = structlog.get_logger(__name__)

Connect = Callable[[str], Awaitable[Link]]
_CANCELLED_KEPT = 4096
# Messages nobody waits a reply for: their failures are reported to the request's router.
_ONE_WAY = (KVChunk, m.KvDone, m.Logprobs)
# Share of the drain bound in-flight requests get to finish before the rest is moved.
DRAIN_FINISH_SHARE = 0.75


class NodeDraining(RequestError):
    """This node drains (SIGTERM): it takes no new request / stopped this one (code "draining")."""


@dataclass(frozen=True, slots=True)
class DrainReport:
    """What a drain did with the requests in flight at its start or accepted during it."""

    inflight: int          # at the start
    finished: int          # ended here on their own
    moved: int             # ended with Error "draining": their router re-drives them elsewhere
    dropped: int           # their router could not be told


@dataclass(slots=True)
class _Open:
    """A request open on this decode node: who to report to."""

    router: Link


# Who steps first on a shared compute thread (engines/compute_thread.py): a prompt waiting on P
# holds a first token; a relay covers a request's first tokens.
_TURNS = {Role.PREFILL: Turn.PREFILL, Role.RLD: Turn.RELAY, Role.MD: Turn.DECODE}


class WorkerNode:
    def __init__(self, name: str, role: Role, engine: Engine, connect: Connect,
                 kv_chunk_bytes: int = 1 << 20, stream_interval: int = 1, relay: bool = False):
        self.name = name
        self.role = role
        # A relaying P (`NodeConfig.relay`): one engine prefills and relays the requests it
        # prefills; their relay is a target named after this node (`_local_target`).
        self.relay = relay
        self.aeng = AsyncEngine(engine, name, _TURNS[role])
        self.engine = engine
        self._connect = connect
        self.metrics = NodeMetrics(name, role, lambda: self.aeng.call(self.engine.stats), self.kv_sent)
        self.prefill = (PrefillWorker(self.aeng, kv_chunk_bytes, self.metrics.transfer, "/prefill" if relay else "")
                        if role == Role.PREFILL else None)
        self.decode = (DecodeWorker(self.aeng, self._emit, self._emit_many, self._emit_now, stream_interval,
                                    engine_runs=role == Role.MD) if role in (Role.RLD, Role.MD) or relay else None)
        self._open: dict[str, _Open] = {}
        self._pins: dict[str, Link] = {}          # prefix pins, by request, with the asking link
        self._watched: dict[Link, asyncio.Task[None]] = {}
        self._peers: dict[str, Link] = {}
        self._prefills: dict[str, asyncio.Task[m.PrefillDone]] = {}
        # P's first-token logprobs, from their Logprobs message until the KvDone right behind it.
        self._first_logprobs: dict[str, TokenLogprobs] = {}
        self.kv_bytes_in_flight = 0
        # Requests cancelled here lately (oldest first): their late KV frames are dropped quietly.
        self._cancelled: dict[str, None] = {}
        # KV bytes sent by links to peers since replaced (a reconnect dials a new one), by class.
        self._kv_sent_before: dict[str, tuple[int, int]] = {}
        # Links that poll this node's load: its routers (only a router polls), told of a drain.
        self._routers: set[Link] = set()
        # Drain (SIGTERM): its bound while it runs, and the requests being moved.
        self.drain_timeout_s: float | None = None
        self._moving: set[str] = set()
        # Requests whose tokens are being sent to the router now (a finished one is no longer
        # open, but its last tokens are still on their way: a drain waits for them).
        self._sending: dict[str, int] = {}
        self._moved: set[str] = set()
        self._dropped: set[str] = set()

    # ---- lifecycle -----------------------------------------------------------------
    async def stop(self) -> None:
        for task in list(self._watched.values()):
            task.cancel()
        for prefill in list(self._prefills.values()):
            prefill.cancel()
        for rid in list(self._open):
            await self._cancel(rid)
        await asyncio.gather(*(link.close() for link in self._peers.values()))
        await self.aeng.stop()

    async def peer(self, name: str) -> Link:
        link = self._peers.get(name)
        if link is None or link.state == LinkState.CLOSED:
            if link is not None:
                self._kv_sent_before[name] = self._kv_sent_by(name, link)
            link = self._peers[name] = await self._connect(name)
        return link

    def _kv_sent_by(self, name: str, link: Link) -> tuple[int, int]:
        fg, bg = self._kv_sent_before.get(name, (0, 0))
        return fg + link.stats.kv_bytes_sent_foreground, bg + link.stats.kv_bytes_sent_background

    def kv_sent(self) -> dict[str, tuple[int, int]]:
        """KV payload bytes this node sent to each peer (foreground, background), ever."""
        out = dict(self._kv_sent_before)
        for name, link in self._peers.items():
            out[name] = self._kv_sent_by(name, link)
        return out

    # ---- state for /health and /debug/state -------------------------------------
    async def state(self) -> m.NodeState:
        st = await self.aeng.call(self.engine.stats)
        sessions = len(self.decode.sessions) if self.decode is not None else 0
        return m.NodeState(self.name, self.role, st.used_blocks, st.num_blocks, st.cached_blocks,
                            st.running + st.waiting + st.importing + st.retained, len(self._prefills),
                            max(sessions, len(self._open)), st.pins, self.aeng.pending, st.prefix_hit_tokens,
                            st.prefix_query_tokens)

    async def load(self) -> m.LoadReport:
        st = await self.aeng.call(self.engine.stats)
        return m.LoadReport(self.name, st.running, st.waiting + st.importing,
                            st.free_blocks + st.cached_blocks, st.num_blocks, self.kv_bytes_in_flight)

    # ---- inbound ---------------------------------------------------------------------
    async def handle(self, link: Link, msg: m.Message) -> m.Message | None:
        """The link handler: one dispatch per message type."""
        try:
            return await self._dispatch(link, msg)
        except (RequestError, CapacityError, LinkError) as e:
            rid = getattr(msg, "request_id", "")
            code = "capacity" if isinstance(e, CapacityError) else "link" if isinstance(e, LinkError) else "request"
            if isinstance(e, NodeDraining):
                code = "draining"
            # A full pool is back-pressure (the router queues the request), not a failure; nor is
            # a request its router ended meanwhile (a relay's handoff racing the request's end).
            report = log.info if isinstance(e, CapacityError) or rid in self._cancelled else log.warning
            report("node_full" if isinstance(e, CapacityError) else "node_request_failed", node=self.name,
                   request_id=rid, kind=type(msg).__name__, error=str(e))
            err = m.Error(rid, code, str(e)[:4000])
            if isinstance(msg, _ONE_WAY):
                # Nobody waits for a reply to P's KV: the request's router hears it at once.
                await self._fail_open(rid, err)
            return err

    async def _fail_open(self, rid: str, err: m.Error) -> None:
        """The request open here failed outside any reply: tell its router, free it here."""
        op = self._open.get(rid)
        if op is None:
            return
        await self._cancel(rid)          # freed before the router hears: it may re-drive at once
        with contextlib.suppress(LinkError):
            await op.router.send(err)

    def _tombstone(self, rid: str) -> None:
        """Remember a cancel: P's frames still in flight are dropped, and an open or pin that
        was in progress when it arrived is undone when it completes."""
        self._cancelled[rid] = None
        while len(self._cancelled) > _CANCELLED_KEPT:
            del self._cancelled[next(iter(self._cancelled))]

    async def _dispatch(self, link: Link, msg: m.Message) -> m.Message | None:
        match msg:
            case m.LoadReport():
                self._routers = {r for r in self._routers if r.state != LinkState.CLOSED}
                self._routers.add(link)
                if self.drain_timeout_s is not None:      # a router that missed it hears it now
                    with contextlib.suppress(LinkError):
                        await link.send(m.Draining(self.name, self.drain_timeout_s))
                return await self.load()
            case m.StateQuery():
                return await self.state()
            case m.PrefixQuery(request_id=rid, hashes=hashes):
                self._refuse_new(rid)
                self._cancelled.pop(rid, None)      # asked again (a re-drive)
                held = await self.aeng.call(self.engine.match_prefix, hashes, rid)
                self._pins[rid] = link
                self._watch(link)
                if rid in self._cancelled:          # cancelled while matching: the pin goes now
                    await self._unpin(rid)
                    raise RequestError(f"request {rid!r} was cancelled")
                return m.PrefixAnswer(rid, held)
            case m.Submit():
                self._refuse_new(msg.request_id)
                return await self._submit(link, msg)
            case m.Prefill():
                self._refuse_new(msg.request_id)
                return await self._run_prefill(link, msg)
            case KVChunk(span=KVSpan(request_id=rid)):
                if rid in self._cancelled or (self.decode is not None and self.decode.past_import(rid)):
                    # P's frames still in flight when the request was cancelled here, or from an
                    # earlier attempt of a request re-driven here since (it computes its prompt
                    # itself, or has all its KV): dropped, a payload that landed in the pool
                    # gives its blocks back.
                    if self.decode is not None:
                        self.decode.drop_kv(msg)
                    return None
                await self._decoder().import_kv(msg)
                return None
            case m.KvDone(request_id=rid) if rid in self._cancelled or self._past_import(rid):
                # P's frames still in flight when the request was cancelled here, or from an
                # earlier attempt of a request re-driven here since (like its KVChunks): taken
                # as this attempt's, it failed the re-driven request ("not importing").
                return None
            case m.KvDone(request_id=rid, first_token=first, hold=hold):
                await self._kv_done(rid, first, hold)
                return None
            case m.Logprobs(request_id=rid) if rid in self._cancelled or self._past_import(rid):
                return None        # in flight when the request was cancelled here, like its KvDone
            case m.Logprobs(request_id=rid, position=0, logprobs=(_,)) if rid in self._open:
                self._first_logprobs[rid] = msg.entries()[0]      # P's first token; KvDone follows
                return None
            case m.Demote(request_id=rid):
                if self.prefill is not None:
                    self.prefill.demote(rid)
                return None
            case m.Extend(request_id=rid, start=start, ids=ids, final=final):
                await self._decoder().extend(rid, start, ids, final)
                return m.Ack(rid, start + len(ids))
            case m.HandOff():
                return await self._hand_off(msg)
            case m.Cancel(request_id=rid):
                await self._cancel(rid)
                return None
            case m.PromptLogprobsQuery():
                return (self.prefill or self._decoder()).scored.piece(msg)
        raise RequestError(f"{self.role} node {self.name} does not handle {type(msg).__name__}")

    def _past_import(self, rid: str) -> bool:
        return self.decode is not None and self.decode.past_import(rid)

    def kv_sink(self, span: KVSpan) -> memoryview | None:
        """The KV sink of this node's links (`net.link.KvSink`), on the loop, before a payload.

        For a request importing here: where the payload should land, ideally
        its block in the engine's pool (see `Engine.import_buffer`), so that
        the import only commits it.  None (not a decoder, unknown, cancelled
        or not importing, a span that does not fit): the link allocates and
        the import reports what is wrong.
        """
        if self.decode is None or span.virtual or span.request_id in self._cancelled:
            return None
        return self.decode.kv_destination(span)

    def _decoder(self) -> DecodeWorker:
        if self.decode is None:
            raise RequestError(f"{self.role} node {self.name} does not decode")
        return self.decode

    async def _unpin(self, rid: str) -> None:
        if self._pins.pop(rid, None) is not None:
            await self.aeng.call(self.engine.unpin, rid)

    async def _submit(self, link: Link, msg: m.Submit) -> m.Opened:
        dec = self._decoder()
        rid = msg.request_id
        for old in msg.supersedes:
            if old in self._open:
                await self._cancel(old)
        self._cancelled.pop(rid, None)          # opened again (a re-drive): its frames count
        if msg.kv == "local":
            if not self.relay:
                raise RequestError(f"{self.role} node {self.name} does not relay what it prefills "
                                   "(kv 'local' needs [[nodes]] relay = true)")
            # P's prefix pin (the router's choice of P) stays until the prefill takes its blocks.
            cached = dec.open_local(rid, msg.prompt, msg.sampling)
        else:
            try:
                if msg.kv == "import":
                    cached = await dec.open(rid, msg.prompt, msg.sampling)
                else:
                    cached = await dec.open_compute(rid, msg.prompt, msg.sampling, hold=msg.hold)
            finally:
                # The request now holds its cached blocks itself (or failed): the pin has done its job.
                await self._unpin(rid)
        if rid in self._cancelled:
            # The router gave up on it while it opened (its Cancel found nothing yet): undo.
            await dec.cancel(rid)
            raise RequestError(f"request {rid!r} was cancelled while opening")
        self._open[rid] = _Open(link)
        self._watch(link)
        return m.Opened(rid, cached)

    def _watch(self, link: Link) -> None:
        """When a router link closes for good, free what was opened or pinned through it."""
        if link not in self._watched:
            self._watched[link] = asyncio.create_task(self._orphans(link), name=f"watch-{link.peer}")

    async def _orphans(self, link: Link) -> None:
        await link.wait_closed()
        self._watched.pop(link, None)
        rids = [r for r, op in self._open.items() if op.router is link]
        rids += [r for r, pinned_by in self._pins.items() if pinned_by is link]
        for rid in rids:
            log.warning("orphaned_request_freed", node=self.name, request_id=rid, peer=link.peer)
            with contextlib.suppress(Exception):
                await self._cancel(rid)

    async def _kv_done(self, rid: str, first: int, hold: bool) -> None:
        first_lp = self._first_logprobs.pop(rid, None)
        op = self._open.get(rid)
        if op is None:
            raise RequestError(f"request {rid!r} is not open on {self.name}")
        await self._decoder().kv_done(rid, first, not hold, first_lp)
        if hold and self.drain_timeout_s is not None:
            # Draining MD: RLD still decodes the request and finishes it, no handoff here.
            await self._move(rid)
        elif hold:
            await op.router.send(m.Ready(rid, "kv"))

    async def _hand_off(self, msg: m.HandOff) -> m.HandedOff:
        rid = msg.request_id
        op = self._open.get(rid)
        if op is None:
            raise RequestError(f"request {rid!r} is not open on {self.name}")
        done = await relay_handoff(self._decoder(), msg, round_sender(rid, op.router, await self.peer(msg.target)))
        self._open.pop(rid, None)
        return done

    async def _run_prefill(self, router: Link, msg: m.Prefill) -> m.PrefillDone:
        if self.prefill is None:
            raise RequestError(f"{self.role} node {self.name} does not prefill")
        rid = msg.request_id
        self._cancelled.pop(rid, None)          # a re-drive asks again
        targets = []
        holds = msg.holds or (False,) * len(msg.targets)
        blocks = msg.blocks or (0,) * len(msg.targets)
        for name, start, hold, block in zip(msg.targets, msg.starts, holds, blocks):
            if name == self.name:
                targets.append(self._local_target(rid, start))
                continue
            link = await self.peer(name)
            targets.append(self._target(rid, name, start, hold, link, block))
        if rid in self._cancelled:              # cancelled while dialing: nothing to compute
            await self._unpin(rid)
            raise RequestError(f"request {rid!r} was cancelled")
        task = asyncio.current_task()
        assert task is not None
        self._prefills[rid] = task
        try:
            res = await self.prefill.prefill(rid, msg.prompt, msg.sampling, targets,
                                             _first_sink(rid, router) if msg.first_to_router else None)
        except asyncio.CancelledError:
            if rid not in self._moving:
                raise
            task.uncancel()             # the drain's own cancel: the router hears why
            raise NodeDraining(f"prefill node {self.name} is draining: prefill of {rid!r} stopped, "
                               "prefill it elsewhere") from None
        finally:
            self._prefills.pop(rid, None)
            # A prefix query's pin (the router's choice of P) has done its job: the prompt's
            # blocks are computed and sent, and must not stay unevictable while MD decodes.
            await self._unpin(rid)
        ts = [res.targets[t.name] for t in targets]
        return m.PrefillDone(rid, res.first_token, res.cached_tokens,
                              tuple(t.sent_bytes for t in ts), tuple(t.error or "" for t in ts),
                              tuple(t.service_s for t in ts))

    def _target(self, rid: str, name: str, start: int, hold: bool, link: Link, block_size: int) -> KVTarget:
        seq = 0

        async def send(chunks: list[KVChunk]) -> float:
            nonlocal seq
            n = sum(c.nbytes for c in chunks)
            self.kv_bytes_in_flight += n
            try:
                # Read per frame: a Demote mid-transfer sends the rest as background.
                # The engine's chunks themselves go out, numbered within this transfer.
                service = await link.send_all([dataclasses.replace(c, seq=seq + i) for i, c in enumerate(chunks)],
                                              priority=lambda: target.priority)
            finally:
                self.kv_bytes_in_flight -= n
            seq += len(chunks)
            return service

        async def done(first_token: int, first_lp: TokenLogprobs | None) -> None:
            # In the KV's class: a background transfer's end must not overtake its last chunks.
            if first_lp is not None:
                # Right before KvDone, in its class: the decoder joins them (messages/logprobs.py).
                for piece in m.logprob_pieces(rid, 0, (first_lp,)):
                    await link.send(piece, priority=target.priority)
            await link.send(m.KvDone(rid, first_token, hold), priority=target.priority)

        target = KVTarget(name, start, send, done, block_size=block_size, buffer=link.kv_buffer)
        return target

    def _local_target(self, rid: str, start: int) -> KVTarget:
        """This node relays `rid` itself: its KV is already here, its first token starts the relay."""
        if self.decode is None or rid not in self._open:
            raise RequestError(f"request {rid!r} is not open for a relay on {self.name} (a Submit with kv "
                               "'local' comes before the Prefill that names this node)")
        decode = self.decode

        async def send(chunks: list[KVChunk]) -> float:
            raise RequestError(f"request {rid!r}: a local relay takes no KV over a link")

        return KVTarget(self.name, start, send, lambda first, lp: decode.adopt(rid, first, lp))

    async def _cancel(self, rid: str) -> None:
        for worker in (self.prefill, self.decode):
            if worker is not None:
                worker.scored.drop(rid)
        self._tombstone(rid)
        self._first_logprobs.pop(rid, None)
        task = self._prefills.get(rid)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # Done when P has let go of it: a re-drive's Prefill right after finds P clean.
            await asyncio.wait([task])
        if self.decode is not None:
            await self.decode.cancel(rid)
        self._open.pop(rid, None)
        await self._unpin(rid)

    # ---- drain (SIGTERM) ---------------------------------------------------------------
    def _inflight(self) -> set[str]:
        return set(self._open) | set(self._prefills) | set(self._pins) | set(self._sending)

    def _refuse_new(self, rid: str) -> None:
        """Draining: a request not already here (pinned, open) is refused."""
        if self.drain_timeout_s is not None and rid not in self._pins and rid not in self._open:
            raise NodeDraining(f"{self.role} node {self.name} is draining (shutting down): "
                               f"request {rid!r} must go to another node")

    async def drain(self, timeout_s: float) -> DrainReport:
        """Stop taking requests; let those in flight finish, move what is left; within `timeout_s`."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        self.drain_timeout_s = timeout_s
        seen = self._inflight()
        at_start = len(seen)
        log.info("drain_started", node=self.name, role=self.role, inflight=at_start, timeout_s=timeout_s)
        sent = await asyncio.gather(*(link.send(m.Draining(self.name, timeout_s))      # all at once
                                      for link in self._routers if link.state == LinkState.OPEN),
                                    return_exceptions=True)
        for r in sent:
            if isinstance(r, BaseException) and not isinstance(r, LinkError):
                raise r
        finish_by = start + timeout_s * DRAIN_FINISH_SHARE
        # Polled, not signalled: requests end through many paths (emit, cancel, orphans, handoffs).
        while (left := self._inflight()) and loop.time() < finish_by:
            seen |= left
            await asyncio.sleep(0.05)
        for rid in list(self._open) + list(self._prefills):
            await self._move(rid)
        for rid in list(self._pins):
            await self._unpin(rid)
        seen |= self._moved | self._dropped
        rep = DrainReport(at_start, len(seen - self._moved - self._dropped), len(self._moved), len(self._dropped))
        log.info("drain_done", node=self.name, role=self.role, inflight=rep.inflight, finished=rep.finished,
                 moved=rep.moved, dropped=rep.dropped, seconds=round(loop.time() - start, 3))
        return rep

    async def _move(self, rid: str) -> None:
        """End `rid` here with Error "draining" to its router, which re-drives it elsewhere."""
        op = self._open.get(rid)
        self._moving.add(rid)
        try:
            await self._cancel(rid)      # freed before the router hears: it may re-drive at once
        finally:
            self._moving.discard(rid)
        if op is None:                   # a prefill: its Prefill request is answered "draining"
            self._moved.add(rid)
            return
        try:
            await op.router.send(m.Error(rid, "draining", f"{self.role} node {self.name} is draining "
                                         "(shutting down): the request moves to another node"))
            self._moved.add(rid)
        except LinkError:
            self._dropped.add(rid)

    # ---- outbound token stream -------------------------------------------------------
    async def _emit_many(self, runs: list[TokenRun]) -> None:
        """One engine step's runs: per router link, the tokens that carry no logprobs in one
        frame (a `TokenBatch`; a lone item as its TokenItem), the others one by one (`_emit`)."""
        if len(runs) == 1:
            await self._emit(runs[0])
            return
        by_link: dict[Link, list[TokenRun]] = {}
        for run in runs:
            if run.reason == "error" or run.logprobs:
                await self._emit(run)
                continue
            op = self._open.get(run.request_id)
            if op is None:
                continue
            if run.done:
                self._open.pop(run.request_id, None)
            by_link.setdefault(op.router, []).append(run)
        for link, rs in by_link.items():
            for part in _parts(rs):
                await self._send_part(link, part)

    def _emit_now(self, runs: list[TokenRun]) -> list[TokenRun]:
        """`_emit_many` within the call, where every frame goes out at once (`Link.send_nowait`)
        -> the runs not sent (in order: `_emit_many` sends them).  Those with logprobs or an
        error always go that way."""
        by_link: dict[Link, list[TokenRun]] = {}
        left: list[TokenRun] = []
        for run in runs:
            if run.reason == "error" or run.logprobs:
                left.append(run)
                continue
            op = self._open.get(run.request_id)
            if op is not None:
                by_link.setdefault(op.router, []).append(run)
        for link, rs in by_link.items():
            for part in _parts(rs):
                if link.send_nowait(_frame(part)):
                    for run in part:
                        if run.done:
                            self._open.pop(run.request_id, None)
                else:
                    left += part
        return left

    @contextlib.contextmanager
    def _in_flight(self, rids: list[str]) -> Iterator[None]:
        """These requests have frames on their way to the router (`in_use` counts them)."""
        sending = self._sending
        for rid in rids:
            sending[rid] = sending.get(rid, 0) + 1
        try:
            yield
        finally:
            for rid in rids:
                if sending[rid] == 1:
                    del sending[rid]
                else:
                    sending[rid] -= 1

    async def _router_lost(self, rid: str, e: LinkError) -> None:
        """The router is gone: nobody will read this request's tokens. Free it."""
        log.warning("router_link_lost", node=self.name, request_id=rid, error=str(e))
        with contextlib.suppress(Exception):
            await self._cancel(rid)

    async def _send_part(self, link: Link, part: list[TokenRun]) -> None:
        rids = [run.request_id for run in part]
        with self._in_flight(rids):
            try:
                await link.send(_frame(part))
            except LinkError as e:
                for rid in rids:
                    await self._router_lost(rid, e)

    async def _emit(self, run: TokenRun) -> None:
        op = self._open.get(run.request_id)
        if op is None:
            return
        if run.done:
            self._open.pop(run.request_id, None)
        with self._in_flight([run.request_id]):
            try:
                if run.reason == "error":
                    await op.router.send(m.Error(run.request_id, "decode", run.error[:4000]))
                else:
                    await _send_run(op.router, run)
            except LinkError as e:
                await self._router_lost(run.request_id, e)


async def _send_run(link: Link, run: TokenRun) -> None:
    """A run to the router: its logprobs first, on the same link (the router joins them at its
    edge, messages/logprobs.py), then its item."""
    for piece in m.logprob_pieces(run.request_id, run.position, run.logprobs):
        await link.send(piece)
    await link.send(_item(run))


def _first_sink(rid: str, router: Link) -> FirstSink:
    """P's first token to the router as it is sampled: a run at position 0."""
    async def send(token: int, lp: TokenLogprobs | None) -> None:
        await _send_run(router, TokenRun(rid, 0, (token,), logprobs=() if lp is None else (lp,)))
    return send


def _item(run: TokenRun) -> m.TokenItem:
    """The one place a run becomes a wire item (the router's stream edge turns it back, `events.StreamReader`);
    the role does not travel (the router knows whom it hears from), the logprobs go before it."""
    return m.TokenItem(run.request_id, run.position, run.ids, run.done, run.reason)


def _frame(part: list[TokenRun]) -> m.TokenItem | m.TokenBatch:
    """One frame of a part: a lone run as its TokenItem, more as one TokenBatch."""
    return _item(part[0]) if len(part) == 1 else m.TokenBatch(tuple(_item(run) for run in part))


def _parts(runs: list[TokenRun]) -> list[list[TokenRun]]:
    """`runs` cut into parts that each fit one TokenBatch (item count and ids)."""
    if len(runs) == 1:
        return [runs]
    parts: list[list[TokenRun]] = [[]]
    ids = 0
    for run in runs:
        if parts[-1] and (len(parts[-1]) == m.MAX_BATCH_ITEMS or ids + len(run.ids) > m.MAX_TOKEN_IDS):
            parts.append([])
            ids = 0
        parts[-1].append(run)
        ids += len(run.ids)
    return parts
