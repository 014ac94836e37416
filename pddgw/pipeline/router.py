"""The router: one request's journey across the clusters, and the merge back to the user.

For each request (`Router.run`), in order:
  1. Drop background MD alignments this request supersedes (alignment.py).
     Pick MD by the prefix the router remembers there (`PrefixIndex`) and
     by load, and open the request on it (Submit, holding): MD's answer is
     its authoritative prefix hit.  Meanwhile P is picked (local prefix
     queries).  One WAN round trip before prefill.
  2. Choose the pipeline from MD's hit, the missing KV bytes, the measured
     WAN (bandwidth and RTT), the foreground bytes queued ahead, RLD's relay
     pressure and MD's load (`policy.decide_pipeline`); log it with its inputs.
  3. P-RLD-MD / P-RLD: open the request on RLD (local fabric); RLD full ->
     P-MD.  Cancel it on whichever opened decoder the path does not use.
  4. Ask P to prefill and stream each decoder only the KV it misses; P says
     per target whether it decodes at once (RLD, MD in P-MD) or holds (MD
     in P-RLD-MD), and reports bytes and wire seconds per target (the WAN
     estimator's samples).
  5. Merge the decoders' token streams by position (each position once, in
     order) and pass every run to the caller as soon as it is in order; each
     decoder's stream pushes its messages, turned into typed events at the
     edge (events.py), into the request's event queue (no task per stream;
     tokens that arrive while the queue is empty and the request's loop waits
     on it are merged and emitted right there, without the queue's hop),
     joining each token piece with its logprobs when the request asked for
     them (P's first token's come through the decoder that emits position 0).
  6. P-RLD-MD: when MD reports the prompt KV in, hand off by token IDs
     (handoff.py); RLD's relay slot is free when the handoff ends.
  7. Finish when a decoder ends the sequence and every position before the
     end was emitted.  RLD finished before MD got the KV -> MD cache
     alignment goes on in the background (alignment.py).  Finally, Cancel
     on every node involved: it frees whatever is left.
Failures re-drive: MD or the WAN lost while RLD still decodes -> RLD finishes
alone; RLD lost before the handoff while MD still imports P's KV -> MD takes
over from the tokens already emitted once that KV is in (the router sends
them as the final handoff round), so the transfer in flight is reused, never
started again; a decoder lost after the handoff, or P lost -> the request restarts
on a healthy node from the tokens already emitted (their KV recomputed
there); sampling is position-keyed, so the user sees the same tokens.  P is
depended on until every decoder confirmed its KV (its first token, MD's
Ready), not only until PrefillDone (which says P's transport took the
bytes): P's link is watched until then (`_watch_link`), and its loss is P's
failure (MD's alone, when RLD already decodes: RLD finishes).  A re-drive
that finds its decoder full waits for room; it is not a lost node.  When
no path is left the caller gets a RouterError that says why.
A full decoder is not a failure: the request frees what it holds and waits
in the room queue for KV room (admission.py; `overloaded` past its bounds).
Nor is a busy node: a P runs at most three quarters of the requests it
serves at once (`net.max_inflight_requests`; it refuses the rest) as
prefills from this router, and when every P has that many a new request
waits in the same queue, woken as prefills end; a decoder that refuses a
Submit for that bound (`overloaded`) is full too (before, either refusal
counted as the node lost and re-drove).
A role with no healthy node (one restarting) is waited for, up to
`server.node_wait_s`.
A draining node (SIGTERM: its `pm.Draining`, or a Submit / Prefill it refused
with code "draining") gets no new request until its link reconnects (the
restarted process); what it ends with Error "draining" re-drives like a lost
node's.
Metrics (`Router.metrics`, pddgw/metrics.py): each run of tokens sent (step 5)
and each request's end feed its Prometheus series; `counts`, the room queue
and `live` are read at scrape time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Set
from dataclasses import dataclass, field
from typing import Any

import structlog

from pddgw.config import Config, NodeConfig
from pddgw.engines.model_spec import ModelSpec
from pddgw.engines.prompt_hashes import prompt_hashes
from pddgw.core.sampling import SamplingParams
from pddgw.core.tokens import TokenLogprobs, TokenRun
from pddgw.metrics import RouterCounts, RouterMetrics
from pddgw.net import messages as m
from pddgw.net.errors import LinkClosed, LinkError, LinkTimeout, RemoteError
from pddgw.net.link import Link, LinkState, Resumed
from pddgw.pipeline import protocol as pm
from pddgw.pipeline.admission import Overloaded, RoomQueue
from pddgw.pipeline.affinity import PrefixIndex
from pddgw.pipeline.alignment import AlignKey, Alignments
from pddgw.pipeline.estimator import LinkEstimator
from pddgw.pipeline.events import (Event, HandoffEnded, KvReady, NodeFailed, PrefillFinished, RoundSent,
                                   StreamError, StreamReader, Tokens)
from pddgw.pipeline.handoff import drive_handoff
from pddgw.pipeline.ordering import StreamMerger
from pddgw.pipeline.recovery import Paths, Recovery, Who
from pddgw.pipeline.policy import (InstanceLoad, NoInstanceError, PipelineDecision, PipelineInputs,
                                   SingularLimiter, decide_pipeline, pick_cached, pick_instance,
                                   prefill_wait_tokens, relay_pressure)
from pddgw.pipeline.state import RequestRecord, RequestState, RequestTracker, Role

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
class NodeHandle:
    """The router's view of one worker node."""

    cfg: NodeConfig
    link: Link
    block_size: int
    max_num_seqs: int
    load: m.LoadReport | None = None
    dp_ranks: int = 1                  # its engine's attention-DP ranks (EngineConfig.dp_ranks)
    # Requests this router has on the node now: counts at once, where polled
    # load reports lag (a burst would otherwise all go to one instance).
    inflight: int = 0
    # Prompt tokens this router has asked the node to prefill and not yet seen done
    # (beyond the node's prefix hits): the prefill queue a new request would wait behind.
    prefill_backlog: int = 0
    # P: prefills this router runs there now, from the pick on (`Router._start_prefill`).
    prefills: int = 0
    # RLD: sequences this router relays on it now, and their prompt tokens (its KV).
    relays: int = 0
    relay_tokens: int = 0
    # Heartbeat round trips of the link already fed to the WAN estimator.
    pongs_seen: int = 0
    # The link's reconnect count when the node said it drains (None: it does not): a
    # reconnect is the restarted process, which takes requests again.
    draining_epoch: int | None = None

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def role(self) -> str:
        return self.cfg.role

    @property
    def healthy(self) -> bool:
        return self.link.state == LinkState.OPEN

    @property
    def draining(self) -> bool:
        return self.draining_epoch is not None and self.draining_epoch == self.link.stats.reconnects

    @property
    def routable(self) -> bool:
        """Healthy and not draining: a new request may go here."""
        return self.healthy and not self.draining

    def heard_draining(self) -> None:
        if not self.draining:
            log.info("node_draining", node=self.name, role=self.role, inflight=self.inflight)
        self.draining_epoch = self.link.stats.reconnects

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the node's pool holds (0 until its first load report)."""
        return self.load.total_blocks * self.block_size if self.load is not None else 0

    def report(self) -> InstanceLoad:
        """The policy's view of this node's last load report (idle until one arrived)."""
        ld = self.load or m.LoadReport(self.name, 0, 0, 1, 1)
        return InstanceLoad(self.name, self.role, max(ld.running, self.inflight), ld.waiting,  # type: ignore[arg-type]
                            self.max_num_seqs, ld.total_blocks - ld.free_blocks, ld.total_blocks, self.routable)


@dataclass(slots=True)
class Outcome:
    """How a request ended: the record for `response.completed` and the usage counts."""

    record: RequestRecord
    output_ids: tuple[int, ...]
    finish_reason: str
    cached_tokens: int
    # Prompt tokens 1..n-1's logprobs when the request asked for them (else empty).
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


Emit = Callable[[TokenRun], Awaitable[None]]


@dataclass(slots=True)
class _Flight:
    """Everything of one request in flight on the router."""

    rid: str
    prompt: tuple[int, ...]
    sampling: SamplingParams
    tracker: RequestTracker
    merger: StreamMerger
    emit: Emit
    # Insertion-ordered (not a set): the order of the final Cancels must not
    # depend on string hashing, so runs on a virtual clock are reproducible.
    involved: dict[str, None] = field(default_factory=dict)
    excluded: set[str] = field(default_factory=set)
    finish_reason: str = ""
    cached_tokens: int = 0
    # Work that outlives the response (MD cache alignment); it releases the request.
    background: asyncio.Task[None] | None = None
    # Per-request overrides of the policy (None = decide).
    force_pipeline: str | None = None
    force_handoff: str | None = None
    # The prompt's chained block hashes, per block size.
    hashes: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # Prompt tokens the chosen P caches (what it need not compute).
    p_cached_tokens: int = 0
    # The RLD relaying this request (its slot and KV are counted there) while it does.
    relay: NodeHandle | None = None
    # The P whose prefill slot it holds (counted in NodeHandle.prefills) until the prefill ends.
    prefill_on: NodeHandle | None = None
    # Foreground WAN bytes this request has queued (counted in Router.wan_backlog).
    wan_queued: int = 0
    # A decoder opened it (holds KV for it): its release frees room others may wait for.
    holds_room: bool = False
    # Seconds it waited in the room queue (all its waits).
    queue_s: float = 0.0
    # The node that last computed the prompt (P; a re-drive's decoder): it keeps the prompt
    # logprobs of a request asking for them until the Cancel.
    scorer: NodeHandle | None = None
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    def block_hashes(self, block_size: int) -> tuple[int, ...]:
        if block_size not in self.hashes:
            self.hashes[block_size] = prompt_hashes(self.prompt, block_size)
        return self.hashes[block_size]


class _NodeLost(Exception):
    def __init__(self, node: NodeHandle, why: str):
        super().__init__(f"{node.role} {node.name}: {why}")
        self.node = node


class _NoRoom(Exception):
    """A decoder refused to open the request for lack of KV room (not a failure)."""


class Router:
    def __init__(self, cfg: Config, spec: ModelSpec, nodes: list[NodeHandle], kv_bytes_per_token: int):
        self.cfg = cfg
        self.spec = spec
        self.nodes = {n.name: n for n in nodes}
        self.kv_bytes_per_token = kv_bytes_per_token
        self.limiter = SingularLimiter.from_config(cfg.policy)
        self.wan = LinkEstimator.from_config(cfg.policy)
        self.timeout = cfg.server.request_timeout_s
        self.control_timeout = cfg.net.request_timeout_s
        self.counts = RouterCounts()
        self.alignments = Alignments(self.timeout, self.control_timeout, cfg.policy.alignment_max_backlog_bytes)
        # Which MD holds which prompt blocks, for `_pick_md`; None where it never picks by it (one
        # MD, or affinity off: the set of nodes is fixed), which spares a 64K-token request a
        # thousand LRU moves in a table of millions.
        affine = cfg.policy.prefix_affinity and sum(n.role == "md" for n in nodes) > 1
        self.md_index = PrefixIndex() if affine else None
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
        if isinstance(msg, pm.Draining):
            for node in self.nodes.values():
                if node.link is link:
                    node.heard_draining()
        return None

    @staticmethod
    def _note_draining(node: NodeHandle, e: LinkError) -> None:
        if isinstance(e, RemoteError) and e.code == "draining":
            node.heard_draining()

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
        if node.role == "md" and stats.pongs > node.pongs_seen:
            # Each heartbeat round trip once: re-feeding the last one would weigh it many times.
            node.pongs_seen = stats.pongs
            self.wan.observe_rtt(stats.rtt_s * 1000.0)

    def _pick(self, role: str, fl: _Flight, skip: Set[str] = frozenset()) -> NodeHandle | None:
        choice = pick_instance([n.report() for n in self.nodes.values() if n.role == role],
                               role, exclude=fl.excluded | skip if skip else fl.excluded)  # type: ignore[arg-type]
        return None if choice is None else self.nodes[choice.instance]

    def _prefill_limit(self) -> int:
        """Prefills this router runs on one P at once: three quarters of the requests P serves
        at once (`net.max_inflight_requests`, the rest refused `overloaded`), a quarter kept
        for the short control requests (prefix queries, pins, cancels)."""
        cap = self.cfg.net.max_inflight_requests
        return max(1, cap - cap // 4)

    def _prefills_full(self, limit: int) -> _NoRoom:
        return _NoRoom(f"every prefill node runs {limit} prefills for this router (three quarters of "
                       f"net.max_inflight_requests = {self.cfg.net.max_inflight_requests})")

    def _start_prefill(self, fl: _Flight, node: NodeHandle) -> None:
        """The request's prefill slot on `node`, taken where P is picked (nothing awaited since
        its room was seen), given back by `_end_prefill`."""
        node.prefills += 1
        fl.prefill_on = node

    def _end_prefill(self, fl: _Flight, wake: bool = True) -> None:
        """The prefill ended, or the request let go of P before it ran (idempotent); `wake`: see
        `_release`."""
        if fl.prefill_on is not None:
            fl.prefill_on.prefills -= 1
            fl.prefill_on = None
            if wake and len(self.room):
                self.room.wake()     # a request waiting for a P with room may go now

    def _relay_pressure(self, rld: NodeHandle, extra_tokens: int | None = None) -> float:
        """RLD's fill as a relay; with `extra_tokens`, if it took one more request of that size."""
        more = extra_tokens is not None
        return relay_pressure(rld.relays + more, rld.relay_tokens + (extra_tokens or 0), rld.kv_tokens,
                              self.cfg.policy)

    # ---- one request ----------------------------------------------------------------
    async def run(self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams, emit: Emit,
                  pipeline: str | None = None, handoff_mode: str | None = None) -> Outcome:
        """Serve one request; `pipeline` / `handoff_mode` override the policy for it.  `emit`
        raising StopRequest ends it early, finished (see there)."""
        tracker = RequestTracker(rid, clock=asyncio.get_running_loop().time)
        fl = _Flight(rid, prompt, sampling, tracker, StreamMerger(rid), emit,
                     force_pipeline=pipeline, force_handoff=handoff_mode)
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
            raise RouterError(f"request {rid} did not complete within {self.timeout:.0f} s", "timeout")
        except RouterError as e:
            if not fl.tracker.terminal:
                fl.tracker.fail(str(e))
            raise
        finally:
            self.live -= 1
            self._end_prefill(fl)             # (already given back, unless P was picked and never asked)
            record = fl.tracker.record()
            self.metrics.ended(record, fl.queue_s)
            if fl.background is None:
                await asyncio.shield(self._release(fl))
            log.info("request_done", request_id=rid, state=fl.tracker.state.name,
                     pipeline=fl.tracker.pipeline, emitted=fl.merger.next_position)
        return Outcome(record, fl.merger.emitted_tokens, fl.finish_reason, fl.cached_tokens,
                       fl.prompt_logprobs)

    async def _fetch_prompt_logprobs(self, fl: _Flight) -> tuple[TokenLogprobs, ...]:
        """The prompt logprobs from the node that computed the prompt, piece by piece
        (protocol.py); before the Cancels, which drop them there."""
        node, n = fl.scorer, len(fl.prompt) - 1
        k = min(fl.sampling.prompt_logprobs or 0, self.spec.vocab_size)
        out: list[TokenLogprobs] = []
        while len(out) < n:
            if node is None:
                raise RouterError(f"request {fl.rid}: no node computed its prompt logprobs")
            start = len(out) + 1
            try:
                piece = await node.link.request(pm.PromptLogprobsQuery(fl.rid, start), timeout=self.control_timeout)
            except LinkError as e:
                raise RouterError(f"request {fl.rid}: its prompt logprobs were lost with "
                                  f"{node.role} {node.name}: {e}", "unavailable") from None
            if (not isinstance(piece, pm.Logprobs) or piece.position != start or piece.top_n != k
                    or len(piece.logprobs) > n - len(out)):
                raise RouterError(f"request {fl.rid}: {node.role} {node.name} answered its prompt "
                                  f"logprobs query from {start} with {type(piece).__name__} "
                                  f"{getattr(piece, 'position', '')}")
            out += piece.entries()
        return tuple(out)

    async def _release(self, fl: _Flight, wake: bool = True) -> None:
        """Cancel on every node involved and wait for each to confirm (it frees everything).

        `wake`: the room it frees wakes the head of the room queue.  Not for a request refused
        for room: what it frees it took in that same attempt, when it was free to the others
        already, and a woken head refused in turn would wake it back: two requests waking each
        other without end while neither fits.
        """

        async def cancel(node: NodeHandle) -> None:
            with contextlib.suppress(LinkError):
                await node.link.request(m.Cancel(fl.rid, "request ended"), timeout=self.control_timeout)

        self._unqueue_wan(fl)
        self._end_prefill(fl, wake)
        await asyncio.gather(*(cancel(self.nodes[n]) for n in fl.involved if self.nodes[n].healthy))
        for n in fl.involved:
            self.nodes[n].inflight -= 1
        fl.involved.clear()
        self._end_relay(fl)
        if fl.holds_room:
            fl.holds_room = False
            if wake:
                self.room.wake()    # its blocks are free: a request waiting for room may fit now

    @staticmethod
    def _involve(fl: _Flight, node: NodeHandle) -> None:
        if node.name not in fl.involved:
            fl.involved[node.name] = None
            node.inflight += 1

    @staticmethod
    def _end_relay(fl: _Flight) -> None:
        """RLD no longer holds the request (handed off, finished, failed or cancelled)."""
        if fl.relay is not None:
            fl.relay.relays -= 1
            fl.relay.relay_tokens -= len(fl.prompt)
            fl.relay = None

    def _unqueue_wan(self, fl: _Flight) -> None:
        self.wan_backlog -= fl.wan_queued
        fl.wan_queued = 0

    async def _ask_prefix(self, node: NodeHandle, fl: _Flight) -> int | None:
        """Blocks of the prompt `node` caches (now pinned for this request); None if unreachable."""
        try:
            ans = await node.link.request(m.PrefixQuery(fl.rid, fl.block_hashes(node.block_size)),
                                          timeout=self.control_timeout)
        except LinkError as e:
            self._note_draining(node, e)
            log.warning("prefix_query_failed", request_id=fl.rid, node=node.name, error=str(e))
            fl.excluded.add(node.name)
            return None
        return ans.held if isinstance(ans, m.PrefixAnswer) else 0

    async def _pick_prefill(self, fl: _Flight) -> tuple[NodeHandle | None, int]:
        """The P for this request, and the prompt blocks it caches (pinned).

        With `policy.prefix_affinity` and several P instances, each is asked
        (in parallel, over the local fabric) and, among those below
        `affinity_max_load`, the one that would keep this request's first
        token waiting least is chosen (`policy.prefill_wait_tokens`: its
        prefill backlog over its DP ranks, plus the prompt past its hit; a
        shared system prompt must not send every request to one P); ties go
        to the least loaded, then the name.  The others' pins are released
        at once.  Otherwise the least-loaded P.
        """
        pol = self.cfg.policy
        limit = self._prefill_limit()
        routable = [n for n in self.nodes.values()
                    if n.role == "prefill" and n.routable and n.name not in fl.excluded]
        full = {n.name for n in routable if n.prefills >= limit}
        if routable and len(full) == len(routable):
            raise self._prefills_full(limit)
        cands = [n for n in routable if n.name not in full]
        if not (pol.prefix_affinity and len(cands) > 1):
            node = self._pick("prefill", fl, full)
            if node is not None:
                self._involve(fl, node)        # counted at once: concurrent picks spread out
                self._start_prefill(fl, node)
            return node, 0
        for n in cands:
            self._involve(fl, n)           # each now holds a pin: released by _release if we fail here
        answers = await asyncio.gather(*(self._ask_prefix(n, fl) for n in cands))
        # Others may have filled a P meanwhile.
        asked = [(n, h) for n, h in zip(cands, answers) if h is not None and n.prefills < limit]
        if not asked and any(h is not None for h in answers):
            raise self._prefills_full(limit)
        roomy = [a for a in asked if a[0].report().load < pol.affinity_max_load] or asked

        def cost(a: tuple[NodeHandle, int]) -> tuple[float, float, str]:
            node, held = a
            wait = prefill_wait_tokens(node.prefill_backlog, node.dp_ranks, len(fl.prompt) - held * node.block_size)
            return wait, node.report().load, node.name

        choice = min(roomy, key=cost, default=None)
        if choice is not None:
            self._start_prefill(fl, choice[0])
        for n in cands:
            if choice is None or n is not choice[0]:
                await self._cancel_on(n, fl.rid)     # frees its pin
                del fl.involved[n.name]
                n.inflight -= 1
        return choice if choice is not None else (None, 0)

    def _pick_md(self, fl: _Flight) -> NodeHandle | None:
        """The MD to open on: with `prefix_affinity`, the one holding the longest prefix the
        router remembers (`policy.pick_cached`); else the least loaded."""
        pol = self.cfg.policy
        cands = [n for n in self.nodes.values() if n.role == "md" and n.routable and n.name not in fl.excluded]
        if not (pol.prefix_affinity and len(cands) > 1):
            return self._pick("md", fl)
        assert self.md_index is not None                 # several MD and affinity on
        held = {n.name: self.md_index.match(n.name, fl.block_hashes(n.block_size)) * n.block_size for n in cands}
        name = pick_cached([n.report() for n in cands], held, len(fl.prompt), pol)
        return self._pick("md", fl) if name is None else self.nodes[name]

    async def _drive(self, fl: _Flight) -> None:
        attempt = 0
        queued = False
        if len(self.room):
            # Others wait for KV room: no overtaking them.
            queued = await self._queue(fl, "requests ahead are waiting for KV room")
        while True:
            try:
                # Nothing emitted yet and a P left: the full PDD path again (another P / decoder).
                if attempt == 0 or (fl.merger.next_position == 0 and self._pick("prefill", fl)):
                    await self._pdd(fl)
                else:
                    await self._redrive(fl)
                return
            except _NoRoom as e:
                # A full decoder, not a lost one: free what the request holds and wait in line.
                await self._release(fl, wake=False)
                queued = await self._queue(fl, str(e), front=queued)
            except _NodeLost as e:
                fl.excluded.add(e.node.name)
                log.warning("node_lost", request_id=fl.rid, node=e.node.name, error=str(e),
                            emitted=fl.merger.next_position)
                # Old paths must be gone before the request opens again somewhere.
                await self._release(fl)
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

    async def _queue(self, fl: _Flight, why: str, front: bool = False) -> bool:
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

    async def _await_node(self, fl: _Flight, roles: tuple[str, ...]) -> bool:
        """A healthy node of one of `roles` for this request, waiting up to `node_wait_s`
        (a node restarting: its link redials); -> whether one is there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.node_wait_s
        # Nodes this request already lost are not waited for.
        cands = [n for n in self.nodes.values() if n.role in roles and n.name not in fl.excluded]

        def there() -> bool:
            return any(n.routable for n in cands)

        if not cands:
            return False
        if not there():
            log.info("waiting_for_node", request_id=fl.rid, roles=roles, wait_s=self.node_wait_s)
        while not there():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(0.1, deadline - loop.time()))
        return True

    async def _pdd(self, fl: _Flight) -> None:
        rid, prompt = fl.rid, fl.prompt
        if not await self._await_node(fl, ("prefill",)):
            raise RouterError(f"no healthy prefill node for this request (a down one is waited for "
                              f"up to server.node_wait_s = {self.node_wait_s:g} s)",
                              "unavailable")
        if not await self._await_node(fl, ("md", "rld")):
            raise RouterError(f"no healthy MD or RLD node for this request (a down one is waited for "
                              f"up to server.node_wait_s = {self.node_wait_s:g} s)",
                              "unavailable")
        md = self._pick_md(fl)
        supersedes = self.alignments.supersede(md.name, fl.block_hashes) if md is not None else ()
        streams = {}
        if md is not None:
            streams[md.name] = md.link.stream(rid, timeout=self.timeout)
        try:
            # Step 1: one WAN round trip - MD's open is its prefix answer; P is picked meanwhile.
            (p, p_held), md_cached = await _both(self._pick_prefill(fl), self._open_md(md, fl, supersedes))
            if p is None:
                raise RouterError("no healthy prefill node", "unavailable")
            fl.p_cached_tokens = min(len(prompt), p_held * p.block_size)
            rld = self._pick("rld", fl)
            decision = self._decide(fl, p, md, md_cached, rld)
            pipeline = decision.pipeline
            use_md = md if pipeline in ("P-MD", "P-RLD-MD") else None
            use_rld = rld if pipeline in ("P-RLD-MD", "P-RLD") else None
            if decision.reason == "rld_full":
                self.counts.rld_full += 1
            if use_rld is not None:
                # The relay slot is taken before the first await: concurrent decisions see it.
                fl.relay = use_rld
                use_rld.relays += 1
                use_rld.relay_tokens += len(prompt)
                streams[use_rld.name] = use_rld.link.stream(rid, timeout=self.timeout)
                try:
                    rld_cached = await self._open(use_rld, fl, hold=False)
                except _NoRoom as e:
                    self._end_relay(fl)
                    if use_md is None:
                        raise
                    # RLD is full after all (its pool, not this router's count): wait for the WAN.
                    log.info("rld_full", request_id=rid, rld=use_rld.name, error=str(e))
                    self.counts.rld_full += 1
                    streams.pop(use_rld.name).close()
                    pipeline, use_rld = "P-MD", None
            if md is not None and use_md is None:
                await self._cancel_on(md, rid)
                streams.pop(md.name).close()
            if use_md is not None and self.md_index is not None:
                self.md_index.record(use_md.name, fl.block_hashes(use_md.block_size))
            if fl.tracker.state == RequestState.RECEIVED:
                fl.tracker.route(pipeline, decision.reason)
            self.counts.add_pipeline(pipeline)
            starts = {}
            holds = []
            if use_rld is not None:
                starts[use_rld.name] = rld_cached
                holds.append(False)
            if use_md is not None:
                starts[use_md.name] = md_cached
                holds.append(pipeline == "P-RLD-MD")
            fl.cached_tokens = md_cached if use_md is not None else 0
            fl.tracker.advance(RequestState.PREFILLING, f"P {p.name}")
            await self._run_streams(fl, p, starts, tuple(holds), use_rld, use_md, streams)
        finally:
            if fl.background is None:
                for st in streams.values():
                    st.close()

    def _decide(self, fl: _Flight, p: NodeHandle, md: NodeHandle | None, md_cached: int,
                rld: NodeHandle | None) -> PipelineDecision:
        """Step 2: the policy's pipeline for this request, logged with its inputs."""
        # Without an MD nothing is held: any block size gives the same missing bytes.
        md_bs = md.block_size if md else p.block_size
        missing = len(fl.prompt) - md_cached
        est = self.wan.estimate()
        inputs = PipelineInputs(
            prompt_tokens=len(fl.prompt), block_size=md_bs, md_hit_blocks=md_cached // md_bs,
            missing_kv_bytes=missing * self.kv_bytes_per_token, max_output_tokens=fl.sampling.max_tokens,
            bandwidth_bytes_per_s=est.bandwidth_bytes_per_s, rtt_ms=est.rtt_ms,
            rld_load=self._relay_pressure(rld, len(fl.prompt)) if rld else None,
            md_load=md.report().load if md else None, wan_backlog_bytes=max(0, self.wan_backlog))
        policy = self.cfg.policy
        if fl.force_pipeline:
            policy = dataclasses.replace(policy, pipeline=fl.force_pipeline)
        try:
            decision = decide_pipeline(inputs, policy, self.limiter)
        except NoInstanceError as e:
            raise RouterError(str(e), "unavailable") from None
        log.info("pipeline_decision", request_id=fl.rid, p=p.name, md=md and md.name, rld=rld and rld.name,
                 **decision.as_log())
        return decision

    async def _open(self, node: NodeHandle, fl: _Flight, hold: bool, supersedes: tuple[str, ...] = ()) -> int:
        """Open the request on a decoder for P's KV; -> the prompt tokens it caches."""
        self._involve(fl, node)
        return await self._submit(node, fl, "import", hold, supersedes)

    async def _open_md(self, md: NodeHandle | None, fl: _Flight, supersedes: tuple[str, ...]) -> int:
        """Open on MD, holding until P says otherwise (_NoRoom: MD is full)."""
        if md is None:
            return 0
        cached = await self._open(md, fl, True, supersedes)
        if len(self.room):
            self.room.wake()      # it fit: the next one in line may too
        return cached

    async def _submit(self, node: NodeHandle, fl: _Flight, kv: str, hold: bool,
                      supersedes: tuple[str, ...] = ()) -> int:
        msg = pm.Submit(request_id=fl.rid, kv=kv, hold=hold, prompt=fl.prompt,  # type: ignore[arg-type]
                        supersedes=supersedes, sampling=fl.sampling)
        try:
            _up(node)
            reply = await node.link.request(msg, timeout=self.control_timeout)
        except RemoteError as e:
            # No KV room, or the link already carries all the requests the node serves at
            # once: a busy node, not a lost one.
            if e.code in ("capacity", "overloaded"):
                raise _NoRoom(f"{node.role} {node.name}: {e}") from None
            self._note_draining(node, e)
            raise _NodeLost(node, f"refused the request: {e}") from None
        except LinkError as e:
            raise _NodeLost(node, f"unreachable: {e}") from None
        assert isinstance(reply, pm.Opened), reply
        fl.holds_room = True
        return reply.cached_tokens

    async def _cancel_on(self, node: NodeHandle, rid: str) -> None:
        with contextlib.suppress(LinkError):
            await node.link.send(m.Cancel(rid, "not on this path"), timeout=self.control_timeout)

    async def _run_streams(self, fl: _Flight, p: NodeHandle, starts: dict[str, int], holds: tuple[bool, ...],
                           rld: NodeHandle | None, md: NodeHandle | None, streams) -> None:
        """Steps 4-7: prefill, merge, hand off, fall back."""
        rid = fl.rid
        events: asyncio.Queue[Event | _Resume | _Raised | _Wake] = asyncio.Queue()
        # The loop below waits in events.get(): a decoder's tokens arriving while nothing is
        # queued are handled where they arrive (`tokens_now`), not queued for the loop.
        parked = False

        def pump(node: NodeHandle) -> None:
            """The decoder's stream pushes into `events` (no task per stream: `LinkStream.push`)."""
            reader = self._reader(node, fl, "rld" if node is rld else "md")
            failed = False

            def push(msg: m.Message | LinkError) -> None:
                nonlocal failed
                if failed:
                    return
                try:
                    if isinstance(msg, LinkError):
                        raise msg
                    ev = reader.event(msg)
                except Exception as e:   # never lose a failure silently
                    failed = True
                    events.put_nowait(NodeFailed(node, str(e) if isinstance(e, LinkError) else repr(e)))
                    return
                if ev is None:
                    return
                if parked and type(ev) is Tokens and events.empty():
                    tokens_now(ev)
                else:
                    events.put_nowait(ev)

            streams[node.name].push(push)

        def tokens_now(ev: Tokens) -> None:
            """A decoder's tokens while the loop waits with nothing queued: what the loop's
            Tokens cases do, here, without the queue's hop and the task switch.  The caller's
            `emit` runs eagerly; if it suspends (a client's write waiting for the socket),
            the rest of it goes to the loop (`_Resume`), which awaits it as it would have
            awaited `_on_tokens`; what it raises goes to the loop too (`_Raised`); a finished
            merge wakes the loop to end (`_Wake`).  Anything queued meanwhile (by what `emit`
            set off, or arriving later) waits behind it, in order."""
            nonlocal parked
            if not admit(ev):
                return
            parked = False
            try:
                coro = self._on_tokens(fl, ev)
                try:
                    waiting = coro.send(None)
                except StopIteration:
                    pass
                else:
                    events.put_nowait(_Resume(coro, waiting, ev))
                    return
                relayed(ev)
                if fl.merger.complete:
                    events.put_nowait(_WAKE)
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:
                events.put_nowait(_Raised(e))
            finally:
                parked = True

        async def prefill() -> None:
            msg = pm.Prefill(request_id=rid, targets=tuple(starts), starts=tuple(starts.values()),  # type: ignore[arg-type]
                             prompt=fl.prompt, holds=holds, sampling=fl.sampling)
            fl.wan_queued = sum((len(fl.prompt) - start) * self.kv_bytes_per_token
                                for name, start in starts.items() if self._crosses_wan(p, name))
            self.wan_backlog += fl.wan_queued
            fl.scorer = p
            work = len(fl.prompt) - fl.p_cached_tokens
            p.prefill_backlog += work
            try:
                _up(p)
                done = await p.link.request(msg, timeout=self.timeout)
                assert isinstance(done, pm.PrefillDone), done
                events.put_nowait(PrefillFinished(p, done))
            except LinkError as e:
                self._note_draining(p, e)
                events.put_nowait(NodeFailed(p, str(e)))
            finally:
                self._unqueue_wan(fl)
                self._end_prefill(fl)
                p.prefill_backlog -= work

        tasks: list[asyncio.Task] = []
        for n in (rld, md):
            if n is not None:
                pump(n)
        # P's KV is on its way until each decoder confirms it (its first token, or MD's
        # Ready): P's PrefillDone only says P's transport took the bytes, so a P lost
        # after it still loses what its wire had not delivered (the decoder would wait
        # for it until the request timeout).  Its link's loss is watched until then.
        role_of = {n.name: ("rld" if n is rld else "md") for n in (rld, md) if n is not None}
        paths = Paths(has_rld=rld is not None, has_md=md is not None,
                      awaiting_kv={role_of[name] for name in starts})
        p_watch = _watch_link(p, rid, self.timeout, events)
        if p_watch is not None:
            tasks.append(p_watch)
        prefill_task = asyncio.create_task(prefill())
        tasks.append(prefill_task)
        handoff: asyncio.Task | None = None

        def who(node: NodeHandle) -> Who:
            return "p" if node is p else role_of[node.name]

        def kv_confirmed(node: NodeHandle) -> None:
            paths.awaiting_kv.discard(role_of[node.name])
            if not paths.awaiting_kv and p_watch is not None:
                p_watch.cancel()

        def admit(ev: Tokens) -> bool:
            """A decoder's tokens confirm its KV arrived; a lost RLD's are dropped (MD took over)."""
            if role_of[ev.node.name] in paths.awaiting_kv:
                kv_confirmed(ev.node)
            return ev.node is not rld or paths.rld_alive

        def relayed(ev: Tokens) -> None:
            """After a decoder's tokens: RLD's last frees its relay slot."""
            if ev.node is rld and ev.run.done:
                self._end_relay(fl)

        try:
            while not fl.merger.complete:
                parked = True
                try:
                    ev = await events.get()
                finally:
                    parked = False
                match ev:
                    case _Resume(coro=coro, waiting=waiting, tokens=tokens):
                        await Resumed(coro, waiting)
                        relayed(tokens)
                        continue
                    case _Raised(error=error):
                        raise error
                    case _Wake():
                        continue
                if type(ev) is KvReady and role_of[ev.node.name] in paths.awaiting_kv:
                    kv_confirmed(ev.node)
                match ev:
                    case Tokens() if not admit(ev):
                        continue
                    case NodeFailed(node=node, why=why):
                        recovery = paths.lost(who(node), fl.tracker.state, fl.merger.next_position)
                        if recovery is Recovery.MOOT:
                            continue
                        if recovery is Recovery.MD_FAILS_WITH_P:
                            events.put_nowait(NodeFailed(md, f"its KV was lost with P {p.name}: {why}"))
                            continue
                        if recovery is Recovery.MD_TAKES_OVER:
                            # MD takes over from the emitted tokens once the KV is in (KvReady below).
                            self._end_relay(fl)
                            fl.excluded.add(node.name)
                            self.counts.redrives += 1
                            fl.tracker.redrive(f"RLD {node.name} lost: {why}; MD {md.name} takes over")
                            log.warning("node_lost", request_id=rid, node=node.name, error=why,
                                        emitted=fl.merger.next_position, takeover=md.name)
                            continue
                        if recovery is Recovery.RLD_FINISHES:
                            self.counts.fallbacks += 1
                            if fl.tracker.state == RequestState.PREFILLING:
                                fl.tracker.advance(RequestState.RLD_DECODING, "RLD decodes")
                            fl.tracker.fall_back_to_rld(f"MD {node.name} lost: {why}")
                            fl.excluded.add(node.name)
                            if handoff is not None:
                                handoff.cancel()
                            continue
                        if node is p:
                            waiting = sorted(n for n, r in role_of.items() if r in paths.awaiting_kv)
                            raise _NodeLost(p, f"prefill failed: {why}" if not prefill_task.done() else
                                            f"lost before {', '.join(waiting)} had its KV: {why}")
                        raise _NodeLost(node, why)
                    case PrefillFinished(done=done):
                        self._on_prefill_done(fl, done, p, list(starts))
                        for name, err in zip(starts, done.errors):
                            if err and rld is not None and name == rld.name:
                                if paths.rld_alive:   # lost: MD may take over (above), else a re-drive
                                    events.put_nowait(NodeFailed(rld, f"KV transfer failed: {err}"))
                            elif (err and md is not None and name == md.name
                                  and paths.rld_alive and paths.md_alive):
                                events.put_nowait(NodeFailed(md, f"KV transfer failed: {err}"))
                            elif err:
                                raise _NodeLost(self.nodes[name], f"KV transfer failed: {err}")
                    case Tokens():
                        await self._on_tokens(fl, ev)
                        relayed(ev)
                    case KvReady(node=node) if (node is md and paths.md_alive and rld is not None
                                                and not paths.rld_alive):
                        paths.md_ready = paths.handoff = True
                        fl.tracker.md_ready("RLD lost: MD takes over", held=1)   # P's first token is there
                        handoff = asyncio.create_task(self._take_over(fl, md, events))
                    case KvReady(node=node) if node is md and paths.md_alive and rld is not None:
                        paths.md_ready = True
                        if fl.tracker.state == RequestState.PREFILLING:
                            fl.tracker.advance(RequestState.RLD_DECODING, "RLD decodes")
                        if fl.tracker.state == RequestState.RLD_DECODING:
                            fl.tracker.md_ready(held=1)   # P's first token went with the KV
                            paths.handoff = True
                            handoff = asyncio.create_task(self._hand_off(fl, rld, md, events))
                    case RoundSent(round=r):
                        if fl.tracker.state in (RequestState.HANDOFF_PENDING, RequestState.CATCHING_UP):
                            fl.tracker.handoff_round(r.start, r.end, r.final)
                    case HandoffEnded():
                        self._end_relay(fl)
            if md is not None and paths.md_alive and paths.rld_alive and handoff is None:
                self._align_md(fl, p, md, paths.md_ready, starts, prefill_task, events, tasks, streams)
        finally:
            if fl.background is None:
                # An emit handed to the loop and never resumed (the loop ended first): closed,
                # as a cancelled await of it would have ended it.
                while not events.empty():
                    left = events.get_nowait()
                    if isinstance(left, _Resume):
                        left.coro.close()
                await _cancel_all(tasks + ([handoff] if handoff else []))
            elif handoff is not None:
                await _cancel_all([handoff])

    def _crosses_wan(self, p: NodeHandle, target: str) -> bool:
        return self.nodes[target].cfg.cluster != p.cfg.cluster

    def _align_md(self, fl: _Flight, p: NodeHandle, md: NodeHandle, ready: bool, starts: dict[str, int],
                  prefill_task: asyncio.Task, events: asyncio.Queue[Event], tasks: list[asyncio.Task],
                  streams) -> None:
        """RLD finished before MD got the KV: MD takes the conversation into its
        prefix cache in the background (alignment.py); nobody waits for it, so
        its bytes leave the foreground backlog.  It depends on MD and, until MD
        has the KV, on P: the request's pumps and P's link watch go on feeding
        it their events, and P's report of a failed transfer to MD is MD's
        failure for it."""
        md_start = starts[md.name]
        hashes = fl.block_hashes(md.block_size)
        idx = md_start // md.block_size
        key = AlignKey(md.name, md.block_size, idx, hashes[idx]) if idx < len(hashes) else None
        self._unqueue_wan(fl)

        async def cleanup() -> None:
            await _cancel_all(tasks)
            for st in streams.values():
                st.close()
            await self._release(fl)

        # What it may still move over the WAN: MD's missing range, unless P has sent it all.
        wan_bytes = 0 if prefill_task.done() else (len(fl.prompt) - md_start) * self.kv_bytes_per_token
        async def next_event() -> Event:
            ev = await events.get()
            if isinstance(ev, PrefillFinished):
                self._on_prefill_done(fl, ev.done, p, list(starts))
                err = dict(zip(starts, ev.done.errors)).get(md.name)
                if err:
                    return NodeFailed(md, f"KV transfer failed: {err}")
            return ev

        fl.background = self.alignments.start(
            fl.rid, key, None if prefill_task.done() else p.link, md.link, md, ready,
            fl.merger.emitted_tokens, next_event, cleanup, wan_bytes, depends=(md, p))

    async def _take_over(self, fl: _Flight, md: NodeHandle, events: asyncio.Queue[Event]) -> None:
        """RLD was lost before the handoff and MD now holds the prompt KV: the router
        hands MD the tokens already emitted itself (a final one-shot round), and MD
        decodes from there."""
        emitted = fl.merger.emitted_tokens
        fl.tracker.handoff_round(1, len(emitted), True)
        try:
            await md.link.request(pm.Extend(fl.rid, 1, True, emitted[1:]), timeout=self.control_timeout)
        except LinkError as e:
            events.put_nowait(NodeFailed(md, f"takeover refused: {e}"))

    async def _hand_off(self, fl: _Flight, rld: NodeHandle, md: NodeHandle, events: asyncio.Queue[Event]) -> None:
        try:
            handed = await drive_handoff(fl.rid, rld.link, md.name, self.cfg.policy, fl.merger.next_position,
                                         self._relay_pressure(rld), md.report().load,
                                         self.wan.estimate().rtt_ms, self.timeout, fl.force_handoff)
            events.put_nowait(HandoffEnded(rld, handed))
        except LinkError as e:
            events.put_nowait(NodeFailed(rld, str(e)))

    def _on_prefill_done(self, fl: _Flight, ev: pm.PrefillDone, p: NodeHandle, targets: list[str]) -> None:
        """Count the KV bytes that crossed the WAN, and feed the estimator the wire's rate."""
        seconds = ev.send_seconds or (0.0,) * len(targets)
        for name, sent, secs in zip(targets, ev.sent_bytes, seconds):
            if self._crosses_wan(p, name):
                fl.tracker.add_wan_kv_bytes(sent)
                self.metrics.wan_kv_bytes.inc(sent)
                self.wan.observe_transfer(sent, secs)

    def _reader(self, node: NodeHandle, fl: _Flight, role: Role) -> StreamReader:
        """The edge of a decoder's stream (its tokens credited to `role`): the logprobs it must
        carry (k, or none)."""
        k = fl.sampling.logprobs
        return StreamReader(node, role, None if k is None else min(k, self.spec.vocab_size))

    async def _on_tokens(self, fl: _Flight, tokens: Tokens) -> None:
        tr = fl.tracker
        got = tokens.run
        if got.ids:
            state = tr.state
            if state == RequestState.PREFILLING:
                tr.advance(RequestState.MD_DECODING if got.role == "md" else RequestState.RLD_DECODING)
            elif got.role == "md" and state == RequestState.HANDING_OFF:
                tr.advance(RequestState.MD_DECODING)
            for run in fl.merger.push(got):
                prev = tr.last_emission_t
                count = len(run.ids)
                now = tr.tokens_emitted(run.position, count, run.role)
                self.metrics.emitted(run.role, count, now, prev, tr.t0, len(fl.prompt))
                await fl.emit(run)
        if got.done and got.reason in ("stop", "length"):
            fl.merger.seal(got.end)
            fl.finish_reason = got.reason

    async def _redrive(self, fl: _Flight) -> None:
        """Restart from the emitted tokens on a healthy decoder (MD first), recomputing their KV."""
        node = self._pick("md", fl) or self._pick("rld", fl)
        if node is None:
            raise RouterError(f"request {fl.rid}: no healthy decode node left", "unavailable")
        emitted = fl.merger.emitted_tokens
        stream = node.link.stream(fl.rid, timeout=self.timeout)
        reader = self._reader(node, fl, "md" if node.role == "md" else "rld")
        self._involve(fl, node)
        fl.scorer = node
        try:
            # A full decoder (_NoRoom) is not lost: the request waits for room in the queue
            # and re-drives after (taken as lost, a WAN cut failed at once every re-drive
            # that found RLD full: "no healthy decode node left").
            await self._submit(node, fl, "compute", bool(emitted))
            if emitted:
                try:
                    await node.link.request(pm.Extend(fl.rid, 0, True, emitted), timeout=self.control_timeout)
                except LinkError as e:
                    raise _NodeLost(node, f"re-drive refused: {e}") from None
            fl.tracker.advance(RequestState.PREFILLING, f"re-drive on {node.name}")
            try:
                async for msg in stream:
                    ev = reader.event(msg)
                    if isinstance(ev, Tokens):
                        await self._on_tokens(fl, ev)
                        if fl.merger.complete:
                            return
            except (LinkError, StreamError) as e:
                raise _NodeLost(node, str(e)) from None
            raise _NodeLost(node, "stream ended before the request finished")
        finally:
            stream.close()


@dataclass(frozen=True, slots=True)
class _Resume:
    """The rest of a token run's handling (`Router._on_tokens`) that suspended in `emit`
    on `waiting` (what it awaits) while handled where the tokens arrived: the loop awaits it."""

    coro: Coroutine[Any, Any, None]
    waiting: Any
    tokens: Tokens


@dataclass(frozen=True, slots=True)
class _Raised:
    """What a token run's handling raised where the tokens arrived: the loop raises it."""

    error: BaseException


class _Wake:
    """Nothing to do: the loop looks at the request again (its merge may be complete)."""

    __slots__ = ()


_WAKE = _Wake()


def _watch_link(node: NodeHandle, rid: str, timeout: float, events: asyncio.Queue[Event]) -> asyncio.Task | None:
    """Report `node`'s link lost (NodeFailed) while the task runs, at once: a stream of `rid`
    on the link (the node sends nothing on it) fails the moment the connection drops.
    None when the link has a stream of `rid` already (that one reports the loss)."""
    try:
        st = node.link.stream(rid, timeout=timeout)
    except ValueError:
        return None
    except LinkError as e:
        events.put_nowait(NodeFailed(node, str(e)))
        return None

    async def watch() -> None:
        try:
            async for _ in st:
                pass
        except LinkTimeout:
            pass                # the request's own timeout governs
        except LinkError as e:
            events.put_nowait(NodeFailed(node, str(e)))
        finally:
            st.close()

    return asyncio.create_task(watch(), name=f"watch-{node.name}-{rid}")


def _up(node: NodeHandle) -> None:
    """A node whose link is down now is lost for this attempt: a request sent on a
    reconnecting link would wait for it (a dead node: the whole request timeout)."""
    if not node.healthy:
        raise LinkClosed(f"link to {node.name} is {node.link.state.name}")


async def _both(a: Awaitable[Any], b: Awaitable[Any]) -> tuple[Any, Any]:
    """Both results; when one fails, the other is cancelled (and awaited) before the error
    propagates, so nothing it does runs on after the request released what it held."""
    ta, tb = asyncio.ensure_future(a), asyncio.ensure_future(b)
    try:
        return await ta, await tb
    finally:
        await _cancel_all([t for t in (ta, tb) if not t.done()])


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


def new_request_id() -> str:
    return "resp_" + secrets.token_hex(12)
