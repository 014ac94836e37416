"""Placement: which nodes a request goes to, and which pipeline it takes.

`NodeHandle` is the router's view of one worker node: its link, its last
load report, and the counters this router's requests hold on it (taken and
given back only as a request's reservations, flight.py).  `Placement`
answers the router's questions for one request:
  * `pick_md`: the MD to open on (prefix affinity, else load);
  * `pick_prefill`: the P (asked for its prefix hit in parallel when there
    are several), its prefill slot taken before anything is awaited since its
    room was seen; every P full -> NoRoom (the request waits for room);
  * `decide`: the pipeline from MD's hit, the missing KV, the measured WAN
    and the loads (`policy.decide_pipeline`), logged with its inputs;
  * `await_node`: a healthy node of a role, waiting for one restarting.
Invariant: a P runs at most three quarters of `net.max_inflight_requests`
prefills from this router (`prefill_limit`); the rest of P's request slots
are kept for the short control requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Set
from dataclasses import dataclass

import structlog

from pddgw import messages as m
from pddgw.config import Config, NodeConfig
from pddgw.core.roles import Role
from pddgw.net.errors import LinkClosed, LinkError, RemoteError
from pddgw.net.link import Link, LinkState
from pddgw.pipeline.affinity import PrefixIndex
from pddgw.pipeline.estimator import LinkEstimator
from pddgw.pipeline.flight import Flight, NoRoom
from pddgw.pipeline.policy import (InstanceLoad, PipelineDecision, PipelineInputs, SingularLimiter, decide_pipeline,
                                   pick_cached, pick_instance, prefill_wait_tokens, relay_pressure)

log = structlog.get_logger("pddgw.pipeline.router")


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
    # P: prefills this router runs there now, from the pick on.
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
    def role(self) -> Role:
        return self.cfg.role

    @property
    def relay_here(self) -> bool:
        """A prefill node that relays the requests it prefills (`NodeConfig.relay`)."""
        return self.cfg.relay

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

    def note_draining(self, e: LinkError) -> None:
        """What `e` says of the node: a refusal "draining" is its drain."""
        if isinstance(e, RemoteError) and e.code == "draining":
            self.heard_draining()

    def up(self) -> None:
        """A node whose link is down now is lost for this attempt: a request sent on a
        reconnecting link would wait for it (a dead node: the whole request timeout)."""
        if not self.healthy:
            raise LinkClosed(f"link to {self.name} is {self.link.state.name}")

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the node's pool holds (0 until its first load report)."""
        return self.load.total_blocks * self.block_size if self.load is not None else 0

    def report(self) -> InstanceLoad:
        """The policy's view of this node's last load report (idle until one arrived)."""
        ld = self.load or m.LoadReport(self.name, 0, 0, 1, 1)
        return InstanceLoad(self.name, self.role, max(ld.running, self.inflight), ld.waiting,
                            self.max_num_seqs, ld.total_blocks - ld.free_blocks, ld.total_blocks, self.routable)

    async def cancel(self, rid: str, why: str, timeout: float) -> None:
        """Tell the node to drop `rid` (one-way; a lost link has dropped it anyway)."""
        with contextlib.suppress(LinkError):
            await self.link.send(m.Cancel(rid, why), timeout=timeout)


class Placement:
    """The router's choices of nodes and pipeline (see the module docstring)."""

    def __init__(self, cfg: Config, nodes: dict[str, NodeHandle], kv_bytes_per_token: int,
                 wan: LinkEstimator) -> None:
        self.cfg = cfg
        self.nodes = nodes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.wan = wan
        self.limiter = SingularLimiter.from_config(cfg.policy)
        self.control_timeout = cfg.net.request_timeout_s
        # Which MD holds which prompt blocks, for `pick_md`; None where it never picks by it (one
        # MD, or affinity off: the set of nodes is fixed), which spares a 64K-token request a
        # thousand LRU moves in a table of millions.
        affine = cfg.policy.prefix_affinity and sum(n.role == Role.MD for n in nodes.values()) > 1
        self.md_index = PrefixIndex() if affine else None

    def open_to(self, fl: Flight, *roles: Role) -> list[NodeHandle]:
        """The nodes of `roles` that may take `fl` now: routable, and not lost by it (a lost
        node counts again once its link reconnects: the restarted process)."""
        return [n for n in self.nodes.values() if n.role in roles and n.routable and not fl.excludes(n)]

    def pick(self, role: Role, fl: Flight, skip: Set[str] = frozenset()) -> NodeHandle | None:
        lost = {n.name for n in self.nodes.values() if fl.excludes(n)}
        choice = pick_instance([n.report() for n in self.nodes.values() if n.role == role],
                               role, exclude=lost | skip)
        return None if choice is None else self.nodes[choice.instance]

    def prefill_limit(self) -> int:
        """Prefills this router runs on one P at once: three quarters of the requests P serves
        at once (`net.max_inflight_requests`, the rest refused `overloaded`), a quarter kept
        for the short control requests (prefix queries, pins, cancels)."""
        cap = self.cfg.net.max_inflight_requests
        return max(1, cap - cap // 4)

    def prefills_full(self, limit: int) -> NoRoom:
        return NoRoom(f"every prefill node runs {limit} prefills for this router (three quarters of "
                      f"net.max_inflight_requests = {self.cfg.net.max_inflight_requests})")

    def relay_pressure(self, rld: NodeHandle, extra_tokens: int | None = None) -> float:
        """RLD's fill as a relay; with `extra_tokens`, if it took one more request of that size."""
        more = extra_tokens is not None
        return relay_pressure(rld.relays + more, rld.relay_tokens + (extra_tokens or 0), rld.kv_tokens,
                              self.cfg.policy)

    async def ask_prefix(self, node: NodeHandle, fl: Flight) -> int | None:
        """Blocks of the prompt `node` caches (now pinned for this request); None if unreachable."""
        try:
            ans = await node.link.request(m.PrefixQuery(fl.rid, fl.block_hashes(node.block_size)),
                                          timeout=self.control_timeout)
        except LinkError as e:
            node.note_draining(e)
            log.warning("prefix_query_failed", request_id=fl.rid, node=node.name, error=str(e))
            fl.exclude(node)
            return None
        return ans.held if isinstance(ans, m.PrefixAnswer) else 0

    async def pick_prefill(self, fl: Flight) -> tuple[NodeHandle | None, int]:
        """The P for this request, its prefill slot taken, and the prompt blocks it caches (pinned).

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
        limit = self.prefill_limit()
        routable = self.open_to(fl, Role.PREFILL)
        full = {n.name for n in routable if n.prefills >= limit}
        if routable and len(full) == len(routable):
            raise self.prefills_full(limit)
        cands = [n for n in routable if n.name not in full]
        if not (pol.prefix_affinity and len(cands) > 1):
            node = self.pick(Role.PREFILL, fl, full)
            if node is not None:
                fl.involve(node)               # counted at once: concurrent picks spread out
                fl.ledger.take("prefill", node, prefills=1)
            return node, 0
        for n in cands:
            fl.involve(n)                  # each now holds a pin: released by the request's end if we fail here
        answers = await asyncio.gather(*(self.ask_prefix(n, fl) for n in cands))
        # Others may have filled a P meanwhile.
        asked = [(n, h) for n, h in zip(cands, answers) if h is not None and n.prefills < limit]
        if not asked and any(h is not None for h in answers):
            raise self.prefills_full(limit)
        roomy = [a for a in asked if a[0].report().load < pol.affinity_max_load] or asked

        def cost(a: tuple[NodeHandle, int]) -> tuple[float, float, str]:
            node, held = a
            wait = prefill_wait_tokens(node.prefill_backlog, node.dp_ranks, len(fl.prompt) - held * node.block_size)
            return wait, node.report().load, node.name

        choice = min(roomy, key=cost, default=None)
        if choice is not None:
            fl.ledger.take("prefill", choice[0], prefills=1)
        for n in cands:
            if choice is None or n is not choice[0]:
                await n.cancel(fl.rid, "not on this path", self.control_timeout)    # frees its pin
                fl.ledger.release(("node", n.name))
        return choice if choice is not None else (None, 0)

    def pick_md(self, fl: Flight) -> NodeHandle | None:
        """The MD to open on: with `prefix_affinity`, the one holding the longest prefix the
        router remembers (`policy.pick_cached`); else the least loaded."""
        pol = self.cfg.policy
        cands = self.open_to(fl, Role.MD)
        if not (pol.prefix_affinity and len(cands) > 1):
            return self.pick(Role.MD, fl)
        assert self.md_index is not None                 # several MD and affinity on
        held = {n.name: self.md_index.match(n.name, fl.block_hashes(n.block_size)) * n.block_size for n in cands}
        name = pick_cached([n.report() for n in cands], held, len(fl.prompt), pol)
        return self.pick(Role.MD, fl) if name is None else self.nodes[name]

    def decide(self, fl: Flight, p: NodeHandle, md: NodeHandle | None, md_cached: int,
               rld: NodeHandle | None, wan_backlog: int) -> PipelineDecision:
        """The policy's pipeline for this request, logged with its inputs (NoInstanceError ->
        the caller's RouterError)."""
        # Without an MD nothing is held: any block size gives the same missing bytes.
        md_bs = md.block_size if md else p.block_size
        missing = len(fl.prompt) - md_cached
        est = self.wan.estimate()
        inputs = PipelineInputs(
            prompt_tokens=len(fl.prompt), block_size=md_bs, md_hit_blocks=md_cached // md_bs,
            missing_kv_bytes=missing * self.kv_bytes_per_token, max_output_tokens=fl.sampling.max_tokens,
            bandwidth_bytes_per_s=est.bandwidth_bytes_per_s, rtt_ms=est.rtt_ms,
            rld_load=self.relay_pressure(rld, len(fl.prompt)) if rld else None,
            md_load=md.report().load if md else None, wan_backlog_bytes=max(0, wan_backlog))
        policy = self.cfg.policy
        if fl.force_pipeline:
            policy = dataclasses.replace(policy, pipeline=fl.force_pipeline)
        decision = decide_pipeline(inputs, policy, self.limiter)
        log.info("pipeline_decision", request_id=fl.rid, p=p.name, md=md and md.name, rld=rld and rld.name,
                 **decision.as_log())
        return decision

    async def await_node(self, fl: Flight, roles: tuple[Role, ...], wait_s: float) -> bool:
        """A healthy node of one of `roles` for this request, waiting up to `wait_s` (a node
        restarting: its link redials); -> whether one is there."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        if not any(n.role in roles for n in self.nodes.values()):
            return False

        def there() -> bool:
            return bool(self.open_to(fl, *roles))

        if not there():
            log.info("waiting_for_node", request_id=fl.rid, roles=roles, wait_s=wait_s)
        while not there():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(min(0.1, deadline - loop.time()))
        return True

