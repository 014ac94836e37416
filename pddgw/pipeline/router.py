"""The router: one request's journey across the clusters, and the merge back to the user.

For each request (`Router.run`), in order:
  1. Ask MD which of the prompt's chained block hashes it holds (pinned).
  2. Choose the pipeline from MD's hit, the missing KV bytes, the WAN
     estimate and the loads (`policy.decide_pipeline`); log it with its inputs.
  3. Open the request on the decoders of that pipeline (RLD: import, decode
     at once; MD: import, decode at once in P-MD or hold for the handoff in
     P-RLD-MD) and learn how much of the prompt each already caches.
  4. Ask P to prefill and stream each decoder only the KV it misses.
  5. Merge the decoders' token streams by position (each position once, in
     order) and pass every run to the caller as soon as it is in order.
  6. P-RLD-MD: when MD reports the prompt KV in, pick one-shot or catch-up
     and tell RLD to hand off by token IDs; MD continues from there.
  7. Finish when a decoder ends the sequence and every position before the
     end was emitted.  Finally, Cancel on every node involved: it frees
     whatever is left (pins, held requests) and is harmless otherwise.
Failures re-drive: MD or the WAN lost while RLD still decodes -> RLD finishes
alone; a decoder lost after the handoff, or P lost -> the request restarts
on a healthy node from the tokens already emitted (their KV recomputed
there); sampling is position-keyed, so the user sees the same tokens.  When
no path is left the caller gets a RouterError that says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from pddgw.config import Config, NodeConfig
from pddgw.engines.block_manager import chain_hashes
from pddgw.engines.model_spec import ModelSpec
from pddgw.engines.types import SamplingParams
from pddgw.net import messages as m
from pddgw.net.errors import LinkError, RemoteError
from pddgw.net.link import Link, LinkState
from pddgw.pipeline import protocol as pm
from pddgw.pipeline.estimator import LinkEstimator
from pddgw.pipeline.ordering import StreamMerger, TokenRun
from pddgw.pipeline.policy import (HandoffInputs, LoadReport, NoInstanceError, PipelineInputs,
                                   SingularLimiter, choose_handoff_mode, decide_pipeline, pick_instance)
from pddgw.pipeline.state import RequestRecord, RequestState, RequestTracker, Role

log = structlog.get_logger(__name__)

MAX_ATTEMPTS = 3


class RouterError(RuntimeError):
    """The request cannot complete; the message says why (sent as the client's error event)."""

    def __init__(self, message: str, code: str = "server_error"):
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class NodeHandle:
    """The router's view of one worker node."""

    cfg: NodeConfig
    link: Link
    block_size: int
    max_num_seqs: int
    load: m.LoadReport | None = None
    # Requests this router has on the node now: counts at once, where polled
    # load reports lag (a burst would otherwise all go to one instance).
    inflight: int = 0
    # Prompt tokens this router has asked the node to prefill and not yet seen done
    # (beyond the node's prefix hits): the prefill queue a new request would wait behind.
    prefill_backlog: int = 0

    @property
    def name(self) -> str:
        return self.cfg.name

    @property
    def role(self) -> str:
        return self.cfg.role

    @property
    def healthy(self) -> bool:
        return self.link.state == LinkState.OPEN

    def report(self) -> LoadReport:
        """The policy's view of this node's last load report (idle until one arrived)."""
        ld = self.load or m.LoadReport(self.name, 0, 0, 1, 1)
        return LoadReport(self.name, self.role, max(ld.running, self.inflight), ld.waiting,  # type: ignore[arg-type]
                          self.max_num_seqs, ld.total_blocks - ld.free_blocks, ld.total_blocks, self.healthy)


@dataclass(slots=True)
class Outcome:
    """How a request ended: the record for `response.completed` and the usage counts."""

    record: RequestRecord
    output_ids: tuple[int, ...]
    finish_reason: str
    cached_tokens: int


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

    def block_hashes(self, block_size: int) -> tuple[int, ...]:
        if block_size not in self.hashes:
            self.hashes[block_size] = tuple(chain_hashes(self.prompt, block_size))
        return self.hashes[block_size]


class _NodeLost(Exception):
    def __init__(self, node: NodeHandle, why: str):
        super().__init__(f"{node.role} {node.name}: {why}")
        self.node = node


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
        self.counts = {"P-MD": 0, "P-RLD-MD": 0, "P-RLD": 0, "redrives": 0, "fallbacks": 0,
                       "md_alignments": 0}
        self.background: set[asyncio.Task[None]] = set()
        # KV bytes on their way to MD over the WAN (requests between Prefill and PrefillDone).
        self.wan_backlog = 0

    async def drain(self) -> None:
        """Wait for work that outlives responses (MD cache alignment)."""
        while self.background:
            await asyncio.gather(*list(self.background), return_exceptions=True)

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
        if node.role == "md" and node.link.stats.rtt_s > 0:
            self.wan.observe_rtt(node.link.stats.rtt_s * 1000.0)

    def _pick(self, role: str, fl: _Flight) -> NodeHandle | None:
        choice = pick_instance([n.report() for n in self.nodes.values() if n.role == role],
                               role, exclude=fl.excluded)  # type: ignore[arg-type]
        return None if choice is None else self.nodes[choice.instance]

    # ---- one request ----------------------------------------------------------------
    async def run(self, rid: str, prompt: tuple[int, ...], sampling: SamplingParams, emit: Emit,
                  pipeline: str | None = None, handoff_mode: str | None = None) -> Outcome:
        """Serve one request; `pipeline` / `handoff_mode` override the policy for it."""
        tracker = RequestTracker(rid, clock=asyncio.get_running_loop().time)
        fl = _Flight(rid, prompt, sampling, tracker, StreamMerger(rid), emit,
                     force_pipeline=pipeline, force_handoff=handoff_mode)
        try:
            async with asyncio.timeout(self.timeout):
                await self._drive(fl)
            fl.tracker.finish(fl.finish_reason)
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
            if fl.background is None:
                await asyncio.shield(self._release(fl))
            log.info("request_done", request_id=rid, state=fl.tracker.state.name,
                     pipeline=fl.tracker.pipeline, emitted=fl.merger.next_position)
        return Outcome(fl.tracker.record(), fl.merger.emitted_tokens, fl.finish_reason, fl.cached_tokens)

    async def _release(self, fl: _Flight) -> None:
        """Cancel on every node involved and wait for each to confirm (it frees everything)."""

        async def cancel(node: NodeHandle) -> None:
            with contextlib.suppress(LinkError):
                await node.link.request(m.Cancel(fl.rid, "request ended"), timeout=self.control_timeout)

        await asyncio.gather(*(cancel(self.nodes[n]) for n in fl.involved if self.nodes[n].healthy))
        for n in fl.involved:
            self.nodes[n].inflight -= 1
        fl.involved.clear()

    @staticmethod
    def _involve(fl: _Flight, node: NodeHandle) -> None:
        if node.name not in fl.involved:
            fl.involved[node.name] = None
            node.inflight += 1

    async def _ask_prefix(self, node: NodeHandle, fl: _Flight) -> int | None:
        """Blocks of the prompt `node` caches (now pinned for this request); None if unreachable."""
        try:
            ans = await node.link.request(m.PrefixQuery(fl.rid, fl.block_hashes(node.block_size)),
                                          timeout=self.control_timeout)
        except LinkError as e:
            log.warning("prefix_query_failed", request_id=fl.rid, node=node.name, error=str(e))
            fl.excluded.add(node.name)
            return None
        return ans.held if isinstance(ans, m.PrefixAnswer) else 0

    async def _pick_cached(self, role: str, fl: _Flight, need_hit: bool) -> tuple[NodeHandle | None, int]:
        """The instance of `role` for this request, and the prompt blocks it caches (pinned).

        With `policy.prefix_affinity` and several candidates, each is asked
        (in parallel) and, among those below `affinity_max_load`, a P is
        chosen by the tokens it would compute before this request's first
        token (its prefill backlog plus the prompt past its hit: a shared
        system prompt must not send every request to one P), an MD by the
        longest hit (its decode batch absorbs one more sequence); ties go to
        the least loaded, then the name.  The others' pins are released at
        once.  Otherwise the least-loaded instance, asked only when
        `need_hit` (MD: the policy weighs its hit).
        """
        pol = self.cfg.policy
        cands = [n for n in self.nodes.values() if n.role == role and n.healthy and n.name not in fl.excluded]
        if not (pol.prefix_affinity and len(cands) > 1):
            node = self._pick(role, fl)
            if node is None:
                return None, 0
            self._involve(fl, node)        # counted at once: concurrent picks spread out
            if not need_hit:
                return node, 0
            held = await self._ask_prefix(node, fl)
            return (None, 0) if held is None else (node, held)
        for n in cands:
            self._involve(fl, n)           # each now holds a pin: released by _release if we fail here
        answers = await asyncio.gather(*(self._ask_prefix(n, fl) for n in cands))
        asked = [(n, h) for n, h in zip(cands, answers) if h is not None]
        roomy = [a for a in asked if a[0].report().load < pol.affinity_max_load] or asked

        def cost(a: tuple[NodeHandle, int]) -> tuple[float, float, str]:
            node, held = a
            work = (node.prefill_backlog + len(fl.prompt) - held * node.block_size if role == "prefill"
                    else -held * node.block_size)
            return work, node.report().load, node.name

        choice = min(roomy, key=cost, default=None)
        for n in cands:
            if choice is None or n is not choice[0]:
                await self._cancel_on(n, fl.rid)     # frees its pin
                del fl.involved[n.name]
                n.inflight -= 1
        return choice if choice is not None else (None, 0)

    async def _drive(self, fl: _Flight) -> None:
        for attempt in range(MAX_ATTEMPTS):
            try:
                # Nothing emitted yet and a P left: the full PDD path again (another P / decoder).
                if attempt == 0 or (fl.merger.next_position == 0 and self._pick("prefill", fl)):
                    await self._pdd(fl)
                else:
                    await self._redrive(fl)
                return
            except _NodeLost as e:
                fl.excluded.add(e.node.name)
                log.warning("node_lost", request_id=fl.rid, node=e.node.name, error=str(e),
                            emitted=fl.merger.next_position)
                # Old paths must be gone before the request opens again somewhere.
                await self._release(fl)
                if fl.tracker.state == RequestState.ROUTED:
                    fl.tracker.advance(RequestState.PREFILLING, "opening failed")
                if fl.tracker.state != RequestState.REDRIVING:
                    fl.tracker.redrive(str(e))
                self.counts["redrives"] += 1
        raise RouterError(f"request {fl.rid}: no healthy path left after {MAX_ATTEMPTS} attempts",
                          "unavailable")

    async def _pdd(self, fl: _Flight) -> None:
        rid, prompt = fl.rid, fl.prompt
        # P and MD are chosen in parallel: one round trip for both prefix queries.
        (p, p_held), (md, held) = await asyncio.gather(self._pick_cached("prefill", fl, need_hit=False),
                                                       self._pick_cached("md", fl, need_hit=True))
        if p is None:
            raise RouterError("no healthy prefill node", "unavailable")
        fl.p_cached_tokens = min(len(prompt), p_held * p.block_size)
        rld = self._pick("rld", fl)
        if rld is not None:
            self._involve(fl, rld)
        # Without an MD nothing is held: any block size gives the same missing bytes.
        md_bs = md.block_size if md else p.block_size
        missing = len(prompt) - held * md_bs
        est = self.wan.estimate()
        inputs = PipelineInputs(
            prompt_tokens=len(prompt), block_size=md_bs, md_hit_blocks=held,
            missing_kv_bytes=missing * self.kv_bytes_per_token, max_output_tokens=fl.sampling.max_tokens,
            bandwidth_bytes_per_s=est.bandwidth_bytes_per_s, rtt_ms=est.rtt_ms,
            rld_load=rld.report().load if rld else None, md_load=md.report().load if md else None,
            wan_backlog_bytes=self.wan_backlog)
        policy = self.cfg.policy
        if fl.force_pipeline:
            policy = dataclasses.replace(policy, pipeline=fl.force_pipeline)
        try:
            decision = decide_pipeline(inputs, policy, self.limiter)
        except NoInstanceError as e:
            raise RouterError(str(e), "unavailable") from None
        log.info("pipeline_decision", request_id=rid, p=p.name, md=md and md.name, rld=rld and rld.name,
                 **decision.as_log())
        pipeline = decision.pipeline
        use_md = md if pipeline in ("P-MD", "P-RLD-MD") else None
        use_rld = rld if pipeline in ("P-RLD-MD", "P-RLD") else None
        if md is not None and use_md is None:
            await self._cancel_on(md, rid)
        if fl.tracker.state == RequestState.RECEIVED:
            fl.tracker.route(pipeline, decision.reason)
        self.counts[pipeline] += 1

        decoders = [(n, hold) for n, hold in ((use_rld, False), (use_md, pipeline == "P-RLD-MD")) if n]
        streams = {n.name: n.link.stream(rid, timeout=self.timeout) for n, _ in decoders}
        try:
            starts = {}
            for node, hold in decoders:
                self._involve(fl, node)
                starts[node.name] = await self._submit(node, fl, "import", hold)
            fl.cached_tokens = starts.get(use_md.name if use_md else "", 0)
            fl.tracker.advance(RequestState.PREFILLING, f"P {p.name}")
            self._involve(fl, p)
            await self._run_streams(fl, p, starts, use_rld, use_md, streams)
        finally:
            if fl.background is None:
                for s in streams.values():
                    s.close()

    async def _submit(self, node: NodeHandle, fl: _Flight, kv: str, hold: bool) -> int:
        msg = pm.Submit(request_id=fl.rid, kv=kv, hold=hold, prompt=fl.prompt,  # type: ignore[arg-type]
                        **pm.sampling_fields(fl.sampling))
        try:
            reply = await node.link.request(msg, timeout=self.control_timeout)
        except RemoteError as e:
            raise _NodeLost(node, f"refused the request: {e}") from None
        except LinkError as e:
            raise _NodeLost(node, f"unreachable: {e}") from None
        assert isinstance(reply, pm.Opened), reply
        return reply.cached_tokens

    async def _cancel_on(self, node: NodeHandle, rid: str) -> None:
        with contextlib.suppress(LinkError):
            await node.link.send(m.Cancel(rid, "not on this path"), timeout=self.control_timeout)

    async def _run_streams(self, fl: _Flight, p: NodeHandle, starts: dict[str, int],
                           rld: NodeHandle | None, md: NodeHandle | None, streams) -> None:
        """Steps 4-7: prefill, merge, hand off, fall back."""
        rid = fl.rid
        events: asyncio.Queue = asyncio.Queue()

        async def pump(node: NodeHandle) -> None:
            try:
                async for msg in streams[node.name]:
                    events.put_nowait((node, msg))
            except LinkError as e:
                events.put_nowait((node, e))
            except Exception as e:   # never lose a failure silently
                events.put_nowait((node, LinkError(repr(e))))

        async def prefill() -> None:
            msg = pm.Prefill(request_id=rid, targets=tuple(starts), starts=tuple(starts.values()),  # type: ignore[arg-type]
                             prompt=fl.prompt, **pm.sampling_fields(fl.sampling))
            wan = sum((len(fl.prompt) - start) * self.kv_bytes_per_token for name, start in starts.items()
                      if self.nodes[name].cfg.cluster != p.cfg.cluster)
            work = len(fl.prompt) - fl.p_cached_tokens
            self.wan_backlog += wan
            p.prefill_backlog += work
            try:
                events.put_nowait((p, await p.link.request(msg, timeout=self.timeout)))
            except LinkError as e:
                events.put_nowait((p, e))
            finally:
                self.wan_backlog -= wan
                p.prefill_backlog -= work

        tasks = [asyncio.create_task(pump(n)) for n in (rld, md) if n is not None]
        tasks.append(asyncio.create_task(prefill()))
        handoff: asyncio.Task | None = None
        md_alive = md is not None
        md_ready = False
        try:
            while not fl.merger.complete:
                node, ev = await events.get()
                if isinstance(ev, (LinkError, m.Error)):
                    why = ev.message if isinstance(ev, m.Error) else str(ev)
                    if node is p:
                        raise _NodeLost(p, f"prefill failed: {why}")
                    if node is md and md_alive and rld is not None and fl.tracker.state in (
                            RequestState.PREFILLING, RequestState.RLD_DECODING,
                            RequestState.HANDOFF_PENDING, RequestState.CATCHING_UP):
                        # RLD still holds the KV: it finishes the request alone.
                        md_alive = False
                        self.counts["fallbacks"] += 1
                        if fl.tracker.state == RequestState.PREFILLING:
                            fl.tracker.advance(RequestState.RLD_DECODING, "RLD decodes")
                        fl.tracker.fall_back_to_rld(f"MD {node.name} lost: {why}")
                        fl.excluded.add(node.name)
                        if handoff is not None:
                            handoff.cancel()
                        continue
                    raise _NodeLost(node, why)
                if isinstance(ev, pm.PrefillDone):
                    self._on_prefill_done(fl, ev, p, list(starts))
                    for name, err in zip(starts, ev.errors):
                        if err and name == (md.name if md else None) and rld is not None and md_alive:
                            events.put_nowait((md, LinkError(f"KV transfer failed: {err}")))
                        elif err:
                            raise _NodeLost(self.nodes[name], f"KV transfer failed: {err}")
                elif isinstance(ev, m.TokenItem):
                    role: Role = "rld" if node is rld else "md"
                    await self._on_tokens(fl, ev, role)
                elif isinstance(ev, m.Ready) and node is md and md_alive and rld is not None:
                    md_ready = True
                    if fl.tracker.state == RequestState.PREFILLING:
                        fl.tracker.advance(RequestState.RLD_DECODING, "RLD decodes")
                    if fl.tracker.state == RequestState.RLD_DECODING:
                        fl.tracker.md_ready(held=1)   # P's first token went with the KV
                        handoff = asyncio.create_task(self._hand_off(fl, rld, md, events))
                elif isinstance(ev, pm.HandoffRound):
                    if fl.tracker.state in (RequestState.HANDOFF_PENDING, RequestState.CATCHING_UP):
                        fl.tracker.handoff_round(ev.start, ev.end, ev.final)
                elif isinstance(ev, pm.HandedOff):
                    pass
            if md is not None and md_alive and rld is not None and handoff is None:
                # RLD finished before MD got the KV: MD still takes the
                # conversation into its prefix cache, after the response.
                fl.background = asyncio.create_task(
                    self._align_md(fl, md, md_ready, events, tasks, streams), name=f"align-{rid}")
                self.background.add(fl.background)
                fl.background.add_done_callback(self.background.discard)
                self.counts["md_alignments"] += 1
        finally:
            if fl.background is None:
                await _cancel_all(tasks + ([handoff] if handoff else []))
            elif handoff is not None:
                await _cancel_all([handoff])

    async def _align_md(self, fl: _Flight, md: NodeHandle, ready: bool, events: asyncio.Queue,
                        tasks: list[asyncio.Task], streams) -> None:
        """Keep MD's prefix cache aligned with P's when RLD served the whole request.

        The KV keeps crossing the WAN; once MD has it, MD extends the output
        tokens on hold (their KV is computed, nothing sampled) and the request
        is released, leaving prompt and output in MD's cache.
        """
        try:
            async with asyncio.timeout(self.timeout):
                while not ready:
                    node, ev = await events.get()
                    if node is md and isinstance(ev, m.Ready):
                        ready = True
                    elif node is md and isinstance(ev, (LinkError, m.Error)):
                        return
                out = fl.merger.emitted_tokens
                if len(out) > 1:
                    await md.link.request(pm.Extend(fl.rid, 1, False, out[1:]), timeout=self.control_timeout)
        except (LinkError, TimeoutError) as e:
            log.info("md_alignment_failed", request_id=fl.rid, error=str(e))
        finally:
            await _cancel_all(tasks)
            for s in streams.values():
                s.close()
            await self._release(fl)

    async def _hand_off(self, fl: _Flight, rld: NodeHandle, md: NodeHandle, events: asyncio.Queue) -> None:
        pol = self.cfg.policy
        if fl.force_handoff:
            pol = dataclasses.replace(pol, handoff_mode=fl.force_handoff)
        decision = choose_handoff_mode(HandoffInputs(fl.merger.next_position, rld.report().load,
                                                     md.report().load), pol)
        log.info("handoff_decision", request_id=fl.rid, **decision.as_log())
        msg = pm.HandOff(fl.rid, md.name, decision.mode, decision.threshold,
                         max(pol.catchup_max_chunk, decision.threshold), pol.catchup_max_rounds)
        try:
            events.put_nowait((rld, await rld.link.request(msg, timeout=self.timeout)))
        except RemoteError as e:
            # RLD already finished (or lost the request): nothing to hand off.
            log.info("handoff_skipped", request_id=fl.rid, reason=str(e))
        except LinkError as e:
            events.put_nowait((rld, e))

    def _on_prefill_done(self, fl: _Flight, ev: pm.PrefillDone, p: NodeHandle, targets: list[str]) -> None:
        """Count the KV bytes that crossed the WAN (targets in another cluster than P)."""
        for name, sent in zip(targets, ev.sent_bytes):
            if self.nodes[name].cfg.cluster != p.cfg.cluster:
                fl.tracker.add_wan_kv_bytes(sent)

    async def _on_tokens(self, fl: _Flight, ev: m.TokenItem, role: Role) -> None:
        tr = fl.tracker
        if ev.ids:
            if tr.state == RequestState.PREFILLING:
                tr.advance(RequestState.MD_DECODING if role == "md" else RequestState.RLD_DECODING)
            elif role == "md" and tr.state == RequestState.HANDING_OFF:
                tr.advance(RequestState.MD_DECODING)
            for run in fl.merger.push(ev.position, ev.ids, role):
                tr.tokens_emitted(run.position, len(run.token_ids), run.role)
                await fl.emit(run)
        if ev.done and ev.reason in ("stop", "length"):
            fl.merger.seal(ev.position + len(ev.ids))
            fl.finish_reason = ev.reason

    async def _redrive(self, fl: _Flight) -> None:
        """Restart from the emitted tokens on a healthy decoder (MD first), recomputing their KV."""
        node = self._pick("md", fl) or self._pick("rld", fl)
        if node is None:
            raise RouterError(f"request {fl.rid}: no healthy decode node left", "unavailable")
        emitted = fl.merger.emitted_tokens
        role: Role = "md" if node.role == "md" else "rld"
        stream = node.link.stream(fl.rid, timeout=self.timeout)
        self._involve(fl, node)
        try:
            await self._submit(node, fl, "compute", bool(emitted))
            if emitted:
                try:
                    await node.link.request(pm.Extend(fl.rid, 0, True, emitted), timeout=self.control_timeout)
                except LinkError as e:
                    raise _NodeLost(node, f"re-drive refused: {e}") from None
            fl.tracker.advance(RequestState.PREFILLING, f"re-drive on {node.name}")
            try:
                async for msg in stream:
                    if isinstance(msg, m.TokenItem):
                        await self._on_tokens(fl, msg, role)
                        if fl.merger.complete:
                            return
            except LinkError as e:
                raise _NodeLost(node, str(e)) from None
            raise _NodeLost(node, "stream ended before the request finished")
        finally:
            stream.close()


async def _cancel_all(tasks: list[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


def new_request_id() -> str:
    return "resp_" + secrets.token_hex(12)
