"""One request's PDD attempt from the Prefill on: prefill, merge, hand off, fall back.

A `RequestDriver` holds what the attempt knows in fields and has one method
per event (events.py): `on_tokens`, `on_node_failed`, `on_kv_ready`,
`on_prefill_done`, `on_round_sent`, `on_handoff_ended`, `on_stream_error`.
The decoders' streams (and P's, unless P relays the request: its first token
as sampled) push their messages, turned into events at the edge, into the
attempt's one queue; `run` takes them in order until the merge is complete
(every position once, in order).  Invariants:
  * P is depended on until every decoder confirmed its KV (its first token,
    MD's Ready), not only until PrefillDone: P's stream, whose link's loss
    it reports, stays open until then.
  * What a node's loss means is `recovery.Paths.lost`'s answer alone; the
    driver only carries it out.  A loss no path survives raises `NodeLost`
    (the router re-drives).
  * The attempt's tasks (prefill, handoff) are cancelled and
    awaited when it ends, unless MD cache alignment takes the request over
    (alignment.py): then its cleanup ends them and releases the request.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Protocol

import structlog

from pddgw import messages as m
from pddgw.config import Config
from pddgw.engines.model_spec import ModelSpec
from pddgw.metrics import RouterCounts, RouterMetrics
from pddgw.core.roles import Role
from pddgw.net.errors import LinkError, LinkTimeout
from pddgw.net.link import LinkStream
from pddgw.pipeline.alignment import AlignKey, Alignments
from pddgw.pipeline.events import (Event, HandoffEnded, KvReady, NodeFailed, PrefillFinished, RoundSent, StreamReader,
                                   Tokens)
from pddgw.pipeline.flight import Flight, NodeLost, cancel_all
from pddgw.pipeline.handoff import drive_handoff
from pddgw.pipeline.estimator import LinkEstimator
from pddgw.pipeline.placement import NodeHandle, Placement
from pddgw.pipeline.recovery import Paths, Recovery
from pddgw.pipeline.state import RequestState

log = structlog.get_logger("pddgw.pipeline.router")


class RouterSide(Protocol):
    """What a driver uses of the router that runs it (pipeline/router.py's `Router`)."""

    cfg: Config
    spec: ModelSpec
    nodes: dict[str, NodeHandle]
    place: Placement
    wan: LinkEstimator
    metrics: RouterMetrics
    counts: RouterCounts
    alignments: Alignments
    timeout: float
    control_timeout: float
    kv_bytes_per_token: int
    wan_backlog: int

    def crosses_wan(self, p: NodeHandle, target: str) -> bool: ...
    def end_prefill(self, fl: Flight, wake: bool = True) -> None: ...
    async def release(self, fl: Flight, wake: bool = True) -> None: ...


class RequestDriver:
    """One PDD attempt of one request (see the module docstring)."""

    def __init__(self, router: RouterSide, fl: Flight, p: NodeHandle, starts: dict[str, int],
                 holds: tuple[bool, ...], rld: NodeHandle | None, md: NodeHandle | None,
                 streams: dict[str, LinkStream]) -> None:
        self.router, self.fl, self.p, self.rld, self.md = router, fl, p, rld, md
        self.starts, self.holds, self.streams = starts, holds, streams
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.role_of: dict[str, Role] = {n.name: (Role.RLD if n is rld else Role.MD)
                                         for n in (rld, md) if n is not None}
        self.paths = Paths(has_rld=rld is not None, has_md=md is not None,
                           awaiting_kv={self.role_of[name] for name in starts})
        self.readers: dict[str, StreamReader] = {}
        self.broken: set[str] = set()          # decoders whose stream reported its failure
        self.tasks: list[asyncio.Task] = []
        self.prefill_task: asyncio.Task | None = None
        self.handoff: asyncio.Task | None = None
        self.p_relays = p is rld            # else the router holds a stream of its own on P's link

    async def run(self) -> None:
        for node in (self.rld, self.md):
            if node is not None:
                self._listen(node, self.role_of[node.name])
        if not self.p_relays:
            # P's stream of the request: its first token as sampled, and the loss of its link.  P's
            # PrefillDone only says P's transport took the bytes: a P lost after it still loses what
            # its wire had not delivered, so the stream stays until every decoder has its KV.  (A
            # relaying P's loss is its relay stream's.)
            try:
                self.streams[self.p.name] = self.p.link.stream(self.fl.rid, timeout=self.router.timeout)
            except LinkError as e:        # its link is closed already: P is lost
                self.events.put_nowait(NodeFailed(self.p, str(e)))
            else:
                self._listen(self.p, Role.PREFILL)
        self.prefill_task = asyncio.create_task(self._prefill())
        self.tasks.append(self.prefill_task)
        try:
            while not self.fl.merger.complete:
                await self.on_event(await self.events.get())
            if self.md is not None and self.paths.md_alive and self.paths.rld_alive and self.handoff is None:
                self._align_md(self.md)
        finally:
            if self.fl.background is None:
                await cancel_all(self.tasks + ([self.handoff] if self.handoff else []))
            elif self.handoff is not None:
                await cancel_all([self.handoff])

    def _listen(self, node: NodeHandle, role: Role) -> None:
        """`node`'s stream of the request (in `streams`) pushes to `on_stream_message`, read as `role`'s."""
        self.readers[node.name] = self.fl.reader(node, role, self.router.spec.vocab_size)
        self.streams[node.name].push(functools.partial(self.on_stream_message, node))

    async def on_event(self, ev: Event) -> None:
        match ev:
            case Tokens():
                await self.on_tokens(ev)
            case NodeFailed(node=node, why=why):
                self.on_node_failed(node, why)
            case PrefillFinished(done=done):
                self.on_prefill_done(done)
            case KvReady(node=node):
                self.on_kv_ready(node)
            case RoundSent(round=r):
                self.on_round_sent(r)
            case HandoffEnded():
                self.on_handoff_ended()

    def on_stream_message(self, node: NodeHandle, msg: m.Message | LinkError) -> None:
        """A decoder's stream message, or what ended its stream -> its event, queued."""
        if node.name in self.broken:
            return
        if isinstance(msg, LinkTimeout) and node is self.p and not self.p_relays:
            self._p_stream_done()         # P owes nothing on it: the request's own timeout governs
            return
        try:
            if isinstance(msg, LinkError):
                raise msg
            ev = self.readers[node.name].event(msg)
        except Exception as e:   # never lose a failure silently
            self.on_stream_error(node, e)
            return
        if ev is not None:
            self.events.put_nowait(ev)

    def on_stream_error(self, node: NodeHandle, e: Exception) -> None:
        """The decoder's stream failed (its link, or a protocol error): its only report."""
        self.broken.add(node.name)
        self.events.put_nowait(NodeFailed(node, str(e) if isinstance(e, LinkError) else repr(e)))

    async def on_tokens(self, ev: Tokens) -> None:
        """Tokens confirm their decoder's KV arrived; a lost RLD's are dropped (MD took over);
        RLD's last frees its relay slot.  P's first token confirms nothing: it only comes early."""
        if ev.run.role == Role.PREFILL:
            await self.fl.deliver(ev.run, self.router.metrics)
            return
        self._kv_confirmed(ev.node)
        if ev.node is self.rld and not self.paths.rld_alive:
            return
        await self.fl.deliver(ev.run, self.router.metrics)
        if ev.node is self.rld and ev.run.done:
            self.fl.ledger.release("relay")

    def on_node_failed(self, node: NodeHandle, why: str) -> None:
        fl = self.fl
        who = Role.PREFILL if node is self.p else self.role_of[node.name]
        if node is self.p and self.p_relays:
            # A relaying P lost: while a decoder still waits for KV from it, nothing it made
            # survives (a re-drive); after, it is the relay that is lost.
            assert self.prefill_task is not None
            if not self.prefill_task.done() or self.paths.awaiting_kv:
                raise NodeLost(node, f"relaying P lost: {why}")
            who = Role.RLD
        recovery = self.paths.lost(who, fl.tracker.state, fl.merger.next_position)
        if recovery is Recovery.MOOT:
            return
        if recovery is Recovery.MD_FAILS_WITH_P:
            assert self.md is not None
            self.events.put_nowait(NodeFailed(self.md, f"its KV was lost with P {self.p.name}: {why}"))
        elif recovery is Recovery.MD_TAKES_OVER:
            self._md_takes_over(node, why)
        elif recovery is Recovery.RLD_FINISHES:
            self._rld_finishes(node, why)
        elif node is self.p:
            assert self.prefill_task is not None
            waiting = sorted(n for n, r in self.role_of.items() if r in self.paths.awaiting_kv)
            raise NodeLost(node, f"prefill failed: {why}" if not self.prefill_task.done() else
                           f"lost before {', '.join(waiting)} had its KV: {why}")
        else:
            raise NodeLost(node, why)

    def _md_takes_over(self, rld: NodeHandle, why: str) -> None:
        """RLD lost before the handoff: MD takes over from the emitted tokens once its KV is in."""
        fl, md = self.fl, self.md
        assert md is not None
        fl.ledger.release("relay")
        fl.exclude(rld)
        self.router.counts.redrives += 1
        fl.tracker.redrive(f"RLD {rld.name} lost: {why}; MD {md.name} takes over")
        log.warning("node_lost", request_id=fl.rid, node=rld.name, error=why,
                    emitted=fl.merger.next_position, takeover=md.name)

    def _rld_finishes(self, md: NodeHandle, why: str) -> None:
        """MD (or the WAN) lost while RLD can finish alone."""
        tr = self.fl.tracker
        self.router.counts.fallbacks += 1
        if tr.state == RequestState.PREFILLING:
            tr.advance(RequestState.RLD_DECODING, "RLD decodes")
        tr.fall_back_to_rld(f"MD {md.name} lost: {why}")
        self.fl.exclude(md)
        if self.handoff is not None:
            self.handoff.cancel()

    def on_prefill_done(self, done: m.PrefillDone) -> None:
        """Count the WAN's bytes; a target P failed to serve is that decoder's failure."""
        self._count_wan(done)
        rld, md, paths = self.rld, self.md, self.paths
        for name, err in zip(self.starts, done.errors):
            if err and rld is not None and name == rld.name:
                if paths.rld_alive:   # lost: MD may take over, else a re-drive
                    self.events.put_nowait(NodeFailed(rld, f"KV transfer failed: {err}"))
            elif err and md is not None and name == md.name and paths.rld_alive and paths.md_alive:
                self.events.put_nowait(NodeFailed(md, f"KV transfer failed: {err}"))
            elif err:
                raise NodeLost(self.router.nodes[name], f"KV transfer failed: {err}")

    def on_kv_ready(self, node: NodeHandle) -> None:
        """MD holds the prompt KV: hand off from RLD, or take over from a lost RLD."""
        self._kv_confirmed(node)
        fl, paths, md, rld = self.fl, self.paths, self.md, self.rld
        if node is not md or not paths.md_alive or rld is None:
            return
        if not paths.rld_alive:
            paths.md_ready = paths.handoff = True
            fl.tracker.md_ready("RLD lost: MD takes over", held=1)   # P's first token is there
            self.handoff = asyncio.create_task(self._take_over(md))
            return
        paths.md_ready = True
        if fl.tracker.state == RequestState.PREFILLING:
            fl.tracker.advance(RequestState.RLD_DECODING, "RLD decodes")
        if fl.tracker.state == RequestState.RLD_DECODING:
            fl.tracker.md_ready(held=1)   # P's first token went with the KV
            paths.handoff = True
            self.handoff = asyncio.create_task(self._hand_off(rld, md))

    def on_round_sent(self, r: m.HandoffRound) -> None:
        if self.fl.tracker.state in (RequestState.HANDOFF_PENDING, RequestState.CATCHING_UP):
            self.fl.tracker.handoff_round(r.start, r.end, r.final)

    def on_handoff_ended(self) -> None:
        self.fl.ledger.release("relay")      # RLD no longer holds the request

    def _kv_confirmed(self, node: NodeHandle) -> None:
        """`node` has its prompt KV: once every decoder does, P is no longer depended on."""
        awaiting = self.paths.awaiting_kv
        if self.role_of[node.name] in awaiting:
            awaiting.discard(self.role_of[node.name])
            if not awaiting:
                self._p_stream_done()

    def _p_stream_done(self) -> None:
        """Nothing depends on P any more: its stream ends (its loss is no longer this request's)."""
        st = None if self.p_relays else self.streams.pop(self.p.name, None)
        if st is not None:
            st.close()

    async def _prefill(self) -> None:
        """Ask P to prefill; its reply (or failure) is an event.  Holds the WAN backlog the
        request queues and P's prefill backlog while it runs."""
        fl, p, r = self.fl, self.p, self.router
        early = r.cfg.policy.first_token_from_p and not self.p_relays      # a relaying P's relay emits it
        block_of = {n.name: n.block_size for n in (p, self.rld, self.md) if n is not None}
        msg = m.Prefill(request_id=fl.rid, targets=tuple(self.starts), starts=tuple(self.starts.values()),
                         prompt=fl.prompt, holds=self.holds, first_to_router=early,
                         blocks=tuple(block_of[name] for name in self.starts), sampling=fl.sampling)
        wan = fl.ledger.take("wan", r, wan_backlog=sum((len(fl.prompt) - start) * r.kv_bytes_per_token
                                                       for name, start in self.starts.items()
                                                       if r.crosses_wan(p, name)))
        backlog = fl.ledger.take("backlog", p, prefill_backlog=len(fl.prompt) - fl.p_cached_tokens)
        fl.scorer = p
        try:
            p.up()
            done = await p.link.request(msg, timeout=r.timeout)
            assert isinstance(done, m.PrefillDone), done
            self.events.put_nowait(PrefillFinished(p, done))
        except LinkError as e:
            p.note_draining(e)
            self.events.put_nowait(NodeFailed(p, str(e)))
        finally:
            wan.release()
            r.end_prefill(fl)
            backlog.release()

    def _count_wan(self, done: m.PrefillDone) -> None:
        """Count the KV bytes that crossed the WAN, and feed the estimator the wire's rate."""
        r = self.router
        seconds = done.send_seconds or (0.0,) * len(self.starts)
        for name, sent, secs in zip(self.starts, done.sent_bytes, seconds):
            if r.crosses_wan(self.p, name):
                self.fl.tracker.add_wan_kv_bytes(sent)
                r.metrics.wan_kv_bytes.inc(sent)
                r.wan.observe_transfer(sent, secs)

    async def _take_over(self, md: NodeHandle) -> None:
        """RLD was lost before the handoff and MD now holds the prompt KV: the router hands MD
        the tokens already emitted itself (a final one-shot round), and MD decodes from there."""
        fl = self.fl
        emitted = fl.merger.emitted_tokens
        fl.tracker.handoff_round(1, len(emitted), True)
        try:
            await md.link.request(m.Extend(fl.rid, 1, True, emitted[1:]), timeout=self.router.control_timeout)
        except LinkError as e:
            self.events.put_nowait(NodeFailed(md, f"takeover refused: {e}"))

    async def _hand_off(self, rld: NodeHandle, md: NodeHandle) -> None:
        r, fl = self.router, self.fl
        try:
            handed = await drive_handoff(fl.rid, rld.link, md.name, r.cfg.policy, fl.merger.next_position,
                                         r.place.relay_pressure(rld), md.report().load,
                                         r.wan.estimate().rtt_ms, r.timeout, fl.force_handoff)
            self.events.put_nowait(HandoffEnded(rld, handed))
        except LinkError as e:
            self.events.put_nowait(NodeFailed(rld, str(e)))

    def _align_md(self, md: NodeHandle) -> None:
        """RLD finished before MD got the KV: MD takes the conversation into its prefix cache in
        the background (alignment.py); nobody waits for it, so its bytes leave the foreground
        backlog.  It depends on MD and, until MD has the KV, on P: this attempt's pumps and P's
        link watch go on feeding it their events, and P's report of a failed transfer to MD is
        MD's failure for it."""
        fl, r, prefill_task = self.fl, self.router, self.prefill_task
        assert prefill_task is not None
        md_start = self.starts[md.name]
        hashes = fl.block_hashes(md.block_size)
        idx = md_start // md.block_size
        key = AlignKey(md.name, md.block_size, idx, hashes[idx]) if idx < len(hashes) else None
        fl.ledger.release("wan")
        # What it may still move over the WAN: MD's missing range, unless P has sent it all.
        wan_bytes = 0 if prefill_task.done() else (len(fl.prompt) - md_start) * r.kv_bytes_per_token
        fl.background = r.alignments.start(
            fl.rid, key, None if prefill_task.done() else self.p.link, md.link, md, self.paths.md_ready,
            fl.merger.emitted_tokens, self._alignment_event, self._cleanup, wan_bytes, depends=(md, self.p))

    async def _alignment_event(self) -> Event:
        """The next event, for the background alignment: P's failed transfer to MD is MD's failure."""
        ev = await self.events.get()
        if isinstance(ev, PrefillFinished):
            self._count_wan(ev.done)
            assert self.md is not None
            err = dict(zip(self.starts, ev.done.errors)).get(self.md.name)
            if err:
                return NodeFailed(self.md, f"KV transfer failed: {err}")
        return ev

    async def _cleanup(self) -> None:
        """The background alignment ended: this attempt's tasks and streams end, the request is released."""
        await cancel_all(self.tasks)
        for st in self.streams.values():
            st.close()
        await self.router.release(self.fl)
