"""The router: serves each request across the clusters and merges its tokens back to the user.

Contract (`Router.run`): one request in; its tokens out through `emit` in
order, each output position exactly once, whatever path produced them; an
`Outcome` at the end, or a `RouterError` that says why (its `code` is the
client's error code).  `emit` raising `StopRequest` ends the request early,
finished.  Invariants:
  * Every exit of a request releases what it holds in one place
    (`Router.release`): the Cancel on every node involved, then every
    reservation on the router's counters (flight.py); idle, `inflight()`
    reads all zero.
  * A lost node never silently drops a request: it re-drives on a new path
    from the tokens already emitted (sampling is position-keyed: the same
    tokens), at most MAX_ATTEMPTS times, or ends with a RouterError; the
    lost node gets no attempt of it again until its link reconnects.
  * A full node (no KV room, every P at its prefill limit) is not a lost
    one: the request frees what it holds and waits in the room queue
    (admission.py).  A role with no healthy node is waited for, up to
    `server.node_wait_s`; a draining node gets no new request until its
    link reconnects.
Where the parts are: placement and the pipeline choice, placement.py; one
attempt's events, request_driver.py; what a lost node means, recovery.py;
the handoff, handoff.py; MD cache alignment, alignment.py.
The request's lifecycle: docs/architecture.md
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from dataclasses import dataclass
from typing import Literal

import structlog

from pddgw import messages as m
from pddgw.config import Config
from pddgw.core.roles import Pipeline, Role
from pddgw.core.sampling import SamplingParams
from pddgw.core.tokens import TokenLogprobs
from pddgw.engines.model_spec import ModelSpec
from pddgw.metrics import RouterCounts, RouterMetrics
from pddgw.net.errors import LinkError, RemoteError
from pddgw.net.link import Link, LinkStream
from pddgw.pipeline.admission import Overloaded, RoomQueue
from pddgw.pipeline.alignment import Alignments
from pddgw.pipeline.estimator import LinkEstimator
from pddgw.pipeline.events import StreamError, Tokens
from pddgw.pipeline.flight import Emit, Flight, NodeLost, NoRoom, both
from pddgw.pipeline.ordering import StreamMerger
from pddgw.pipeline.placement import NodeHandle, Placement
from pddgw.pipeline.policy import NoInstanceError, PipelineDecision
from pddgw.pipeline.request_driver import RequestDriver
from pddgw.pipeline.state import HandoffMode, RequestRecord, RequestState, RequestTracker

__all__ = ["MAX_ATTEMPTS", "Emit", "NodeHandle", "Outcome", "Router", "RouterError", "StopRequest",
           "new_request_id"]

log = structlog.get_logger(__name__)

MAX_ATTEMPTS = 3


class RouterError(RuntimeError):
    """The request cannot complete; the message says why (sent as the client's error event)."""

    def __init__(self, message: str, code: str = "server_error"):
        super().__init__(message)
        self.code = code


class StopRequest(Exception):
    """Raised by a request's `emit` callback: the caller wants no more of its tokens (a stop
    string matched at the front door).  `Router.run` ends the request as finished with
    reason "stop" and, as for any end, cancels it on every node holding it (they free all
    of it at once); the Outcome's tokens are those emitted, the run that stopped included."""


@dataclass(slots=True)
class Outcome:
    """How a request ended: the record for `response.completed` and the usage counts."""

    record: RequestRecord
    output_ids: tuple[int, ...]
    finish_reason: str
    cached_tokens: int
    # Prompt tokens 1..n-1's logprobs when the request asked for them (else empty).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class Router:
    def __init__(self, cfg: Config, spec: ModelSpec, nodes: list[NodeHandle], kv_bytes_per_token: int):
        self.cfg = cfg
        self.spec = spec
        self.nodes = {n.name: n for n in nodes}
        self.kv_bytes_per_token = kv_bytes_per_token
        self.wan = LinkEstimator.from_config(cfg.policy)
        self.place = Placement(cfg, self.nodes, kv_bytes_per_token, self.wan)
        self.timeout = cfg.server.request_timeout_s
        self.control_timeout = cfg.net.request_timeout_s
        self.counts = RouterCounts()
        self.alignments = Alignments(self.timeout, self.control_timeout, cfg.policy.alignment_max_backlog_bytes)
        # Foreground KV bytes on their way to MD over the WAN (live requests between
        # Prefill and PrefillDone); background alignments are not counted.
        self.wan_backlog = 0
        self.live = 0                 # requests inside `run`
        self.room = RoomQueue(cfg.server.max_queued_requests, cfg.server.max_queue_wait_s)
        self.node_wait_s = cfg.server.node_wait_s
        # Prometheus series (its own registry; pddgw/metrics.py).
        self.metrics = RouterMetrics(self)

    def inflight(self) -> dict[str, int]:
        """What the router holds now: all zero when it is idle (the leak checks read this)."""
        return {"requests": self.live, "queued": len(self.room), "alignments": len(self.alignments),
                "relays": sum(n.relays for n in self.nodes.values()),
                "node_requests": sum(n.inflight for n in self.nodes.values()),
                "prefill_backlog": sum(n.prefill_backlog for n in self.nodes.values()),
                "wan_backlog_bytes": self.wan_backlog}

    async def drain(self) -> None:
        """Wait for work that outlives responses (MD cache alignment)."""
        await self.alignments.drain()

    async def on_link_message(self, link: Link, msg: m.Message) -> m.Message | None:
        """A worker's message outside any request stream: its drain; anything else (a late
        token of an ended request) is dropped."""
        if isinstance(msg, m.Draining):
            for node in self.nodes.values():
                if node.link is link:
                    node.heard_draining()
        return None

    def crosses_wan(self, p: NodeHandle, target: str) -> bool:
        return self.nodes[target].cfg.cluster != p.cfg.cluster

    # ---- loads ---------------------------------------------------------------------
    async def poll_loads(self, interval_s: float = 0.25) -> None:
        """Keep every node's load report fresh (runs for the router's lifetime)."""
        while True:
            await asyncio.gather(*(self._poll(n) for n in self.nodes.values()), return_exceptions=True)
            await asyncio.sleep(interval_s)

    async def _poll(self, node: NodeHandle) -> None:
        ask = m.LoadReport(node.name, 0, 0, 0, 0)
        reply = await node.link.request(ask, timeout=self.control_timeout)
        if isinstance(reply, m.LoadReport):
            node.load = reply
        stats = node.link.stats
        if node.role == Role.MD and stats.pongs > node.pongs_seen:
            # Each heartbeat round trip once: re-feeding the last one would weigh it many times.
            node.pongs_seen = stats.pongs
            self.wan.observe_rtt(stats.rtt_s * 1000.0)

    # ---- one request ----------------------------------------------------------------
    async def run(self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams, emit: Emit,
                  pipeline: Pipeline | str | None = None, handoff_mode: HandoffMode | None = None) -> Outcome:
        """Serve one request; `pipeline` / `handoff_mode` override the policy for it.  `emit`
        raising StopRequest ends it early, finished (see there)."""
        tracker = RequestTracker(rid, clock=asyncio.get_running_loop().time)
        fl = Flight(rid, prompt, sampling, tracker, StreamMerger(rid), emit,
                    force_pipeline=None if pipeline is None else Pipeline(pipeline), force_handoff=handoff_mode)
        self.live += 1
        try:
            async with asyncio.timeout(self.timeout):
                await self._drive(fl)
                if sampling.prompt_logprobs is not None and len(prompt) > 1:
                    fl.prompt_logprobs = await self._fetch_prompt_logprobs(fl)
            fl.tracker.finish(fl.finish_reason)
        except StopRequest:
            fl.finish_reason = "stop"
            if not fl.tracker.terminal:
                fl.tracker.finish("stop string")
        except asyncio.CancelledError:
            if not fl.tracker.terminal:
                fl.tracker.cancel("cancelled by the client")
            raise
        except TimeoutError:
            fl.tracker.fail(f"no completion within {self.timeout:.0f} s")
            raise RouterError(f"request {rid} did not complete within {self.timeout:.0f} s", "timeout") from None
        except RouterError as e:
            if not fl.tracker.terminal:
                fl.tracker.fail(str(e))
            raise
        finally:
            self.live -= 1
            # P's slot goes back with the response even when an alignment keeps the request.
            self.end_prefill(fl)
            record = fl.tracker.record()
            self.metrics.ended(record, fl.queue_s)
            if fl.background is None:
                await asyncio.shield(self.release(fl))
            log.info("request_done", request_id=rid, state=fl.tracker.state.name,
                     pipeline=fl.tracker.pipeline, emitted=fl.merger.next_position)
        return Outcome(record, fl.merger.emitted_tokens, fl.finish_reason, fl.cached_tokens,
                       fl.prompt_logprobs)

    async def _fetch_prompt_logprobs(self, fl: Flight) -> tuple[TokenLogprobs, ...]:
        """The prompt logprobs from the node that computed the prompt, piece by piece
        (pddgw/messages/logprobs.py); before the Cancels, which drop them there."""
        node, n = fl.scorer, len(fl.prompt) - 1
        k = min(fl.sampling.prompt_logprobs or 0, self.spec.vocab_size)
        out: list[TokenLogprobs] = []
        while len(out) < n:
            if node is None:
                raise RouterError(f"request {fl.rid}: no node computed its prompt logprobs")
            start = len(out) + 1
            try:
                piece = await node.link.request(m.PromptLogprobsQuery(fl.rid, start), timeout=self.control_timeout)
            except LinkError as e:
                raise RouterError(f"request {fl.rid}: its prompt logprobs were lost with "
                                  f"{node.role} {node.name}: {e}", "unavailable") from None
            if (not isinstance(piece, m.Logprobs) or piece.position != start or piece.top_n != k
                    or len(piece.logprobs) > n - len(out)):
                raise RouterError(f"request {fl.rid}: {node.role} {node.name} answered its prompt "
                                  f"logprobs query from {start} with {type(piece).__name__} "
                                  f"{getattr(piece, 'position', '')}")
            out += piece.entries()
        return tuple(out)

    async def release(self, fl: Flight, wake: bool = True) -> None:
        """The one exit of an attempt and of a request: Cancel on every node involved, wait for
        each to confirm (it frees everything), then give back every reservation.

        `wake`: the room it frees wakes the head of the room queue.  Not for a request refused
        for room: what it frees it took in that same attempt, when it was free to the others
        already, and a woken head refused in turn would wake it back: two requests waking each
        other without end while neither fits.
        """

        async def cancel(node: NodeHandle) -> None:
            with contextlib.suppress(LinkError):
                await node.link.request(m.Cancel(fl.rid, "request ended"), timeout=self.control_timeout)

        fl.ledger.release("wan")
        self.end_prefill(fl, wake)
        await asyncio.gather(*(cancel(n) for n in fl.involved if n.healthy))
        fl.ledger.release_all()
        if fl.holds_room:
            fl.holds_room = False
            if wake:
                self.room.wake()    # its blocks are free: a request waiting for room may fit now

    def end_prefill(self, fl: Flight, wake: bool = True) -> None:
        """The prefill ended, or the request let go of P before it ran (idempotent); `wake`: see
        `release`."""
        if fl.ledger.release("prefill") and wake and len(self.room):
            self.room.wake()     # a request waiting for a P with room may go now

    async def _drive(self, fl: Flight) -> None:
        attempt = 0
        queued = False
        if len(self.room):
            # Others wait for KV room: no overtaking them.
            queued = await self._queue(fl, "requests ahead are waiting for KV room")
        while True:
            try:
                # Nothing emitted yet and a P left: the full PDD path again (another P / decoder).
                if attempt == 0 or (fl.merger.next_position == 0 and self.place.pick(Role.PREFILL, fl)):
                    await self._pdd(fl)
                else:
                    await self._redrive(fl)
                return
            except NoRoom as e:
                # A full decoder, not a lost one: free what the request holds and wait in line.
                await self.release(fl, wake=False)
                queued = await self._queue(fl, str(e), front=queued)
            except NodeLost as e:
                fl.exclude(e.node)
                log.warning("node_lost", request_id=fl.rid, node=e.node.name, error=str(e),
                            emitted=fl.merger.next_position)
                # Old paths must be gone before the request opens again somewhere.
                await self.release(fl)
                # Lost before it was routed (MD's open is step 1): nothing to re-drive yet.
                if fl.tracker.state != RequestState.RECEIVED:
                    if fl.tracker.state == RequestState.ROUTED:
                        fl.tracker.advance(RequestState.PREFILLING, "opening failed")
                    if fl.tracker.state != RequestState.REDRIVING:
                        fl.tracker.redrive(str(e))
                self.counts.redrives += 1
                attempt += 1
                if attempt >= MAX_ATTEMPTS:
                    raise RouterError(f"request {fl.rid}: no healthy path left after {MAX_ATTEMPTS} attempts",
                                      "unavailable") from None

    async def _queue(self, fl: Flight, why: str, front: bool = False) -> bool:
        """Wait in the room queue (see admission.py); -> True (the request has queued)."""
        loop = asyncio.get_running_loop()
        since = loop.time()
        try:
            await self.room.wait(fl.rid, why, front=front)
        except Overloaded as e:
            raise RouterError(f"server overloaded: {e}", "overloaded") from None
        finally:
            fl.queue_s += loop.time() - since
        return True

    async def _pdd(self, fl: Flight) -> None:
        """The full PDD path: open it (`_open_path`), then drive it (request_driver.py)."""
        for roles, what in (((Role.PREFILL,), "prefill node"), ((Role.MD, Role.RLD), "MD or RLD node")):
            if not await self.place.await_node(fl, roles, self.node_wait_s):
                raise RouterError(f"no healthy {what} for this request (a down one is waited for "
                                  f"up to server.node_wait_s = {self.node_wait_s:g} s)", "unavailable")
        md = self.place.pick_md(fl)
        supersedes = self.alignments.supersede(md.name, fl.block_hashes) if md is not None else ()
        streams: dict[str, LinkStream] = {}
        if md is not None:
            streams[md.name] = md.link.stream(fl.rid, timeout=self.timeout)
        try:
            driver = await self._open_path(fl, md, supersedes, streams)
            await driver.run()
        finally:
            if fl.background is None:
                for st in streams.values():
                    st.close()

    async def _open_path(self, fl: Flight, md: NodeHandle | None, supersedes: tuple[str, ...],
                         streams: dict[str, LinkStream]) -> RequestDriver:
        """Open the request on MD (its answer is its prefix hit) while P is picked - one WAN
        round trip; choose the pipeline; open on RLD if it takes one; cancel on the opened
        decoder the path does not use.  -> the attempt's driver, P not yet asked."""
        (p, p_held), md_cached = await both(self.place.pick_prefill(fl), self._open_md(md, fl, supersedes))
        if p is None:
            raise RouterError("no healthy prefill node", "unavailable")
        fl.p_cached_tokens = min(len(fl.prompt), p_held * p.block_size)
        # A relaying P relays what it prefills (its KV is there); else an RLD instance.
        rld = p if p.relay_here else self.place.pick(Role.RLD, fl)
        decision = self._decide(fl, p, md, md_cached, rld)
        pipeline = decision.pipeline
        use_md = md if pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD) else None
        use_rld = rld if pipeline in (Pipeline.P_RLD_MD, Pipeline.P_RLD) else None
        if decision.reason == "rld_full":
            self.counts.rld_full += 1
        starts: dict[str, int] = {}
        holds: list[bool] = []
        if use_rld is not None:
            rld_cached = await self._open_rld(fl, use_rld, streams, md_after=use_md is not None,
                                              local=use_rld is p)
            if rld_cached is None:
                pipeline, use_rld = Pipeline.P_MD, None
            else:
                starts[use_rld.name] = rld_cached
                holds.append(False)
        if md is not None and use_md is None:
            await md.cancel(fl.rid, "not on this path", self.control_timeout)
            streams.pop(md.name).close()
        if use_md is not None:
            if self.place.md_index is not None:
                self.place.md_index.record(use_md.name, fl.block_hashes(use_md.block_size))
            starts[use_md.name] = md_cached
            holds.append(pipeline == Pipeline.P_RLD_MD)
        if fl.tracker.state == RequestState.RECEIVED:
            fl.tracker.route(pipeline, decision.reason)
        self.counts.add_pipeline(pipeline)
        fl.cached_tokens = md_cached if use_md is not None else 0
        fl.tracker.advance(RequestState.PREFILLING, f"P {p.name}")
        return RequestDriver(self, fl, p, starts, tuple(holds), use_rld, use_md, streams)

    def _decide(self, fl: Flight, p: NodeHandle, md: NodeHandle | None, md_cached: int,
                rld: NodeHandle | None) -> PipelineDecision:
        try:
            return self.place.decide(fl, p, md, md_cached, rld, self.wan_backlog)
        except NoInstanceError as e:
            raise RouterError(str(e), "unavailable") from None

    async def _open_rld(self, fl: Flight, rld: NodeHandle, streams: dict[str, LinkStream],
                        md_after: bool, local: bool) -> int | None:
        """Open on RLD, its relay slot taken before the first await (concurrent decisions see
        it); -> the prompt tokens it caches, or None: it is full and MD goes alone (P-MD).
        `local`: RLD is the request's P, relaying what it prefills (all its KV is there)."""
        fl.ledger.take("relay", rld, relays=1, relay_tokens=len(fl.prompt))
        streams[rld.name] = rld.link.stream(fl.rid, timeout=self.timeout)
        try:
            if local:
                return await self._submit(rld, fl, "local", False)
            return await self._open(rld, fl, hold=False)
        except NoRoom as e:
            fl.ledger.release("relay")
            if not md_after:
                raise
            # RLD is full after all (its pool, not this router's count): wait for the WAN.
            log.info("rld_full", request_id=fl.rid, rld=rld.name, error=str(e))
            self.counts.rld_full += 1
            streams.pop(rld.name).close()
            return None

    async def _open(self, node: NodeHandle, fl: Flight, hold: bool, supersedes: tuple[str, ...] = ()) -> int:
        """Open the request on a decoder for P's KV; -> the prompt tokens it caches."""
        fl.involve(node)
        return await self._submit(node, fl, "import", hold, supersedes)

    async def _open_md(self, md: NodeHandle | None, fl: Flight, supersedes: tuple[str, ...]) -> int:
        """Open on MD, holding until P says otherwise (NoRoom: MD is full)."""
        if md is None:
            return 0
        cached = await self._open(md, fl, True, supersedes)
        if len(self.room):
            self.room.wake()      # it fit: the next one in line may too
        return cached

    async def _submit(self, node: NodeHandle, fl: Flight, kv: Literal["import", "compute", "local"], hold: bool,
                      supersedes: tuple[str, ...] = ()) -> int:
        msg = m.Submit(request_id=fl.rid, kv=kv, hold=hold, prompt=fl.prompt,
                        supersedes=supersedes, sampling=fl.sampling)
        try:
            node.up()
            reply = await node.link.request(msg, timeout=self.control_timeout)
        except RemoteError as e:
            # No KV room, or the link already carries all the requests the node serves at
            # once: a busy node, not a lost one.
            if e.code in ("capacity", "overloaded"):
                raise NoRoom(f"{node.role} {node.name}: {e}") from None
            node.note_draining(e)
            raise NodeLost(node, f"refused the request: {e}") from None
        except LinkError as e:
            raise NodeLost(node, f"unreachable: {e}") from None
        assert isinstance(reply, m.Opened), reply
        fl.holds_room = True
        return reply.cached_tokens

    async def _redrive(self, fl: Flight) -> None:
        """Restart from the emitted tokens on a healthy decoder (MD first), recomputing their KV."""
        node = None
        if await self.place.await_node(fl, (Role.MD, Role.RLD), self.node_wait_s):
            node = self.place.pick(Role.MD, fl) or self.place.pick(Role.RLD, fl)
        if node is None:
            raise RouterError(f"request {fl.rid}: no healthy decode node left (a down one is waited "
                              f"for up to server.node_wait_s = {self.node_wait_s:g} s)", "unavailable")
        emitted = fl.merger.emitted_tokens
        stream = node.link.stream(fl.rid, timeout=self.timeout)
        reader = fl.reader(node, Role.MD if node.role == Role.MD else Role.RLD, self.spec.vocab_size)
        fl.involve(node)
        fl.scorer = node
        try:
            # A full decoder (NoRoom) is not lost: the request waits for room in the queue
            # and re-drives after (taken as lost, a WAN cut failed at once every re-drive
            # that found RLD full: "no healthy decode node left").
            await self._submit(node, fl, "compute", bool(emitted))
            if emitted:
                try:
                    await node.link.request(m.Extend(fl.rid, 0, True, emitted), timeout=self.control_timeout)
                except LinkError as e:
                    raise NodeLost(node, f"re-drive refused: {e}") from None
            fl.tracker.advance(RequestState.PREFILLING, f"re-drive on {node.name}")
            try:
                async for msg in stream:
                    ev = reader.event(msg)
                    if isinstance(ev, Tokens):
                        await fl.deliver(ev.run, self.metrics)
                        if fl.merger.complete:
                            return
            except (LinkError, StreamError) as e:
                raise NodeLost(node, str(e)) from None
            raise NodeLost(node, "stream ended before the request finished")
        finally:
            stream.close()


def new_request_id() -> str:
    return "resp_" + secrets.token_hex(12)
