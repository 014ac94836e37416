"""The roofline's verdict on a candidate at a rate: which side cannot keep up, without simulating.

A probe's `Demand` is what each request of `pddgw sim`'s goodput probe asks, counted as low as
it can be (infinite caches, answers to max_tokens), with the earliest and latest it can
arrive.  A candidate's capacity per side (prefill, decode, kv, wan, relay, latency) is
counted as high as it can be from the engines' own roofline (`roofline.step_cost`).

Invariant: every bound here is an upper bound, so pruning never drops a candidate or probe
the simulation would pass.  `capacity` is the steady state the tables print;
`attainment_bound` is what prunes a probe (below the attainment target: not simulated).
Derivation: docs/simulator.md.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from pddgw.sim.costmodel_engine import parallel
from pddgw.sim.plan_space import Candidate, Kind, Plan
from pddgw.sim.profiles import HardwareProfile, ModelProfile, as_run, hardware
from pddgw.sim.roofline import SeqWork, step_cost
from pddgw.sim.scenario import DeploymentSpec, NodeGroup, Scenario, group_fit
from pddgw.sim.probe import probe_workload
from pddgw.sim.workload import Conversation


@dataclass(frozen=True, slots=True)
class Demand:
    """What one probe's workload asks, per request in arrival order.  `uncached`: prompt tokens in
    no earlier request's blocks.  A request arrives at the earliest at its conversation's start
    plus the think times before it, at the latest that plus each earlier turn's whole SLO
    budget; it is surely in the window when both lie in it, maybe when they straddle it.
    """

    uncached: tuple[int, ...]        # prompt tokens P computes, and a prefix-caching MD lacks
    prompt: tuple[int, ...]          # prompt tokens (naive: all of them cross)
    output: tuple[int, ...]          # output tokens
    earliest: tuple[float, ...]      # the earliest each can arrive
    latest: tuple[float, ...]        # the latest, every earlier turn of its conversation within SLO
    start_s: float                   # the probe's window of measured arrivals [start_s, end_s)
    end_s: float
    # The think time before its conversation's next turn (0: none follows): how long P's cache
    # must keep its prompt beyond its answer for that turn to hit it (`capacity`'s p_kv side).
    think_next: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.prompt)
        if not (len(self.uncached) == len(self.output) == len(self.earliest) == len(self.latest) == n):
            raise ValueError("Demand: one entry per request in every field")
        if self.think_next and len(self.think_next) != n:
            raise ValueError("Demand: one think_next per request")
        if not self.end_s > self.start_s:
            raise ValueError(f"Demand: empty window [{self.start_s}, {self.end_s})")

    @property
    def requests(self) -> int:
        return len(self.prompt)

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s

    @property
    def maybe(self) -> tuple[int, ...]:
        """Requests that can arrive in the window."""
        return tuple(i for i, (e, late) in enumerate(zip(self.earliest, self.latest))
                     if e < self.end_s and late >= self.start_s)

    @property
    def surely(self) -> int:
        """How many requests arrive in the window whenever every earlier turn met its SLO."""
        return sum(self.start_s <= e and late < self.end_s for e, late in zip(self.earliest, self.latest))

    def mean(self, xs: tuple[int, ...]) -> float:
        return sum(xs) / len(xs)


@dataclass(frozen=True, slots=True)
class Bound:
    """A candidate's roofline: requests per second each side can carry, and the least of them."""

    sides: dict[str, float]

    @property
    def rate(self) -> float:
        return min(self.sides.values())

    @property
    def side(self) -> str:
        return min(self.sides, key=lambda k: (self.sides[k], k))


# ---- the probe's workload --------------------------------------------------------------------------

def _trace_misses(convs: list[Conversation], block: int) -> list[int]:
    """Per request, the prompt tokens in no earlier request's whole blocks (infinite prefix cache)."""
    seen: set[int] = set()
    out = []
    for c in convs:
        p = c.turns[0].prompt
        h, cached, hitting = 0, 0, True
        for i in range(len(p) // block):
            h = hash((h, p[i * block:(i + 1) * block]))
            if hitting and h in seen:
                cached += block
            else:
                hitting = False
            seen.add(h)
        out.append(len(p) - cached)
    return out


def _turn_budget_s(sc: Scenario, out: int) -> float:
    """The longest a turn that meets every SLO can take (inf when a bound is unset)."""
    slo = sc.slo
    bounds = []
    if slo.ttft_s and slo.tpot_ms:
        bounds.append(slo.ttft_s + slo.tpot_ms / 1000.0 * max(0, out - 1))
    if slo.e2e_s:
        bounds.append(slo.e2e_s)
    return min(bounds) if bounds else math.inf


def demand(sc: Scenario, rate: float) -> Demand:
    """The demand of `pddgw sim`'s goodput probe at `rate` (`probe.probe_workload`)."""
    pw = probe_workload(sc, rate)
    convs = list(pw.conversations)
    early: list[float] = []
    late: list[float] = []
    ctx: list[int] = []
    miss: list[int] = []
    outs: list[int] = []
    think_next: list[float] = []
    if sc.workload.kind == "trace":
        miss = _trace_misses(convs, sc.block_size)
        for c in convs:
            early.append(c.start_s)
            late.append(c.start_s)
            ctx.append(len(c.turns[0].prompt))
            outs.append(c.turns[0].max_tokens)
    else:
        for c in convs:
            lo = hi = c.start_s
            for k, turn in enumerate(c.turns):
                if k:
                    hi += _turn_budget_s(sc, c.turns[k - 1].max_tokens)
                lo += turn.think_s
                hi += turn.think_s
                early.append(lo)
                late.append(hi)
                ctx.append(turn.context)
                outs.append(turn.max_tokens)
                kept = min(len(pw.prefix), turn.context) if k == 0 else math.floor(turn.hit * turn.context)
                miss.append(turn.context - kept)
                think_next.append(c.turns[k + 1].think_s if k + 1 < len(c.turns) else 0.0)
    return Demand(uncached=tuple(miss), prompt=tuple(ctx), output=tuple(outs), earliest=tuple(early),
                  latest=tuple(late), start_s=pw.start_s, end_s=pw.end_s, think_next=tuple(think_next))


# ---- the candidate's capacity ----------------------------------------------------------------------

# The capacities are pure functions of (model, group) and the planner asks them per candidate
# and probe rate: cached (a 64K-token chunk is 65,536 SeqWork items to price).
@functools.lru_cache(maxsize=1024)
def _kv_tokens(prof: ModelProfile, g: NodeGroup) -> int:
    return group_fit(prof, g).kv_tokens


@functools.lru_cache(maxsize=1024)
def prefill_tokens_per_s(prof: ModelProfile, g: NodeGroup) -> float:
    """The most prompt tokens per second one instance computes: full steps of
    max_num_batched_tokens tokens on each DP rank with the least attention a prefill does.
    Two-token prompts, not single tokens: the roofline prices a step of single tokens as a
    decode step (its efficiency, its dispatch mode); the half pair of attention a token
    more is ~1e-5 of its weight FLOPs."""
    n = g.max_num_batched_tokens * g.data_parallel // 2
    return 2 * n / step_cost(*_as_run(prof, g), parallel(g.costmodel()), [SeqWork(2, 0)] * n).seconds


@functools.lru_cache(maxsize=4096)
def decode_step_s(prof: ModelProfile, g: NodeGroup, batch: int, context: int) -> float:
    return step_cost(*_as_run(prof, g), parallel(g.costmodel()), [SeqWork(1, context)] * batch).seconds


def _as_run(prof: ModelProfile, g: NodeGroup) -> tuple[ModelProfile, HardwareProfile]:
    """The model as the group's hardware serves it (`profiles.as_run`), and that hardware."""
    hw = hardware(g.hardware)
    return as_run(prof, hw, g.costmodel().fp4_on_non_native), hw


def decode_tokens_per_s(prof: ModelProfile, g: NodeGroup, context: int) -> float:
    """The most output tokens per second one instance decodes at `context` tokens a sequence:
    the largest batch its max_num_seqs and its KV pool allow (tokens per step grow faster than
    the step with the batch)."""
    n = max(1, min(g.seqs_per_instance, _kv_tokens(prof, g) // max(1, context + 1)))
    return n / decode_step_s(prof, g, n, context)


def wan_bytes_per_s(sc: Scenario, wan_gbps: float | None, cand: Candidate) -> float:
    link = next((s for s in sc.links if s.name == "wan"), None)
    if link is None:
        return math.inf
    gbps = wan_gbps if wan_gbps is not None else (link.gbps or (max(g for _, g in link.trace) if link.trace else 0))
    if not gbps:
        return math.inf                     # unshaped: no WAN limit to bound by
    pipes = 1 if link.shared else _count(cand, "prefill") * _count(cand, "md")
    return gbps * 1e9 / 8 * pipes


def _count(cand: Candidate, role: str) -> int:
    return sum(g.count for g in cand.groups if g.role == role)


@dataclass(frozen=True, slots=True)
class _Sides:
    """Per side: capacity per second, and each request's use of it."""

    prefill: tuple[float, list[float]]
    decode: tuple[float, list[float]]
    kv: tuple[float, list[float]]
    wan: tuple[float, list[float]] | None
    relay: tuple[float, float] | None    # (relay slots, seconds one holds) for PDD and a relaying P
    latency: bool                        # no request with >= 2 output tokens meets the TPOT SLO


@dataclass(frozen=True, slots=True)
class Setting:
    """What a bound reads besides the candidate: the scenario (links, SLOs), the WAN the
    candidate runs at (None: its links as configured) and each relay's slots (an RLD instance
    or a relaying P)."""

    scenario: Scenario
    wan_gbps: float | None
    rld_max_relays: int

    @staticmethod
    def of(plan: Plan, cand: Candidate) -> Setting:
        return Setting(plan.scenario, plan.wan_gbps, cand.policy(plan.spec).rld_max_relays)


def _sides(at: Setting, prof: ModelProfile, cand: Candidate, d: Demand) -> _Sides:
    # A planner's candidate has one group per role; a scenario's deployment may have several
    # (`deployment_bound`): each side sums its groups, and a relay lasts its fastest relay's steps.
    prefills = [g for g in cand.groups if g.role == "prefill"]
    # A relaying P counts twice: its whole prefill capacity (its relays' decodes are a small
    # share of its steps) and, among the decoders, its whole decode capacity and pool.  Both
    # are as if it did nothing else: each side stays an upper bound.
    decoders = _decoders(cand)
    ctx = min(d.prompt)
    fastest = min(decode_step_s(prof, g, 1, ctx) for g in decoders)
    wan = relay = None
    if cand.kind != "same-dc":
        missing = d.prompt if cand.kind == "naive-cross-dc" else d.uncached
        per_token = prof.kv_bytes_per_token
        wan = (wan_bytes_per_s(at.scenario, at.wan_gbps, cand), [m * per_token for m in missing])
        rlds = _relays(cand)
        if rlds:
            relay = (sum(g.count for g in rlds) * at.rld_max_relays,
                     (min(d.output) - 1) * min(decode_step_s(prof, g, 1, ctx) for g in rlds))
    tpot = at.scenario.slo.tpot_ms
    return _Sides(
        prefill=(sum(g.count * prefill_tokens_per_s(prof, g) for g in prefills), [float(x) for x in d.uncached]),
        decode=(sum(g.count * decode_tokens_per_s(prof, g, ctx) for g in decoders), [o - 1.0 for o in d.output]),
        kv=(sum(g.count * _kv_tokens(prof, g) for g in decoders),
            [c * (o - 1) * fastest for c, o in zip(d.prompt, d.output)]),
        wan=wan, relay=relay,
        latency=bool(tpot) and min(d.output) >= 2 and fastest * 1000.0 > tpot)


def _decoders(cand: Candidate) -> list[NodeGroup]:
    """The groups that decode: MD, RLD and a relaying P."""
    return [g for g in cand.groups if g.role in ("md", "rld") or g.relay]


def _relays(cand: Candidate) -> list[NodeGroup]:
    """The groups that relay (each instance `rld_max_relays` at a time): RLD and a relaying P.
    A relaying P's decode step is priced alone, without the prefill chunks it shares steps
    with: it holds a relay no longer than that, and the bound stays above the truth."""
    return [g for g in cand.groups if g.role == "rld" or g.relay]


def capacity(at: Setting, prof: ModelProfile, cand: Candidate, d: Demand) -> Bound:
    """Requests per second each side of `cand` carries in the steady state for the workload of `d`.

    Adds `p_kv`, an estimate the bounds leave out: the rate at which P's pools keep each prompt
    until its conversation's next turn.  Above it P recomputes what the prefill side counts as
    cached (four DP16 H100 V4-Pro instances measured ~3 req/s with ~8 s first tokens, against
    ~41 req/s on the prefill side); `pddgw plan` orders its candidates by it too.
    """
    s = _sides(at, prof, cand, d)

    def rate(side: tuple[float, list[float]]) -> float:
        per = sum(side[1]) / len(side[1])
        return side[0] / per if per > 0 else math.inf

    sides = {"prefill": rate(s.prefill), "decode": rate(s.decode), "kv": rate(s.kv)}
    if d.think_next:
        prefills = [g for g in cand.groups if g.role == "prefill"]
        decoders = _decoders(cand)
        fastest = min(decode_step_s(prof, g, 1, min(d.prompt)) for g in decoders)
        sides["p_kv"] = rate((sum(g.count * _kv_tokens(prof, g) for g in prefills),
                              [c * ((o - 1) * fastest + t) for c, o, t in zip(d.prompt, d.output, d.think_next)]))
    if s.wan is not None:
        relays = s.relay[0] / s.relay[1] if s.relay and s.relay[1] > 0 else (math.inf if s.relay else 0.0)
        sides["wan"] = rate(s.wan) + relays
    if s.latency:
        sides["latency"] = 0.0
    return Bound(sides)


def _fit(budget: float, uses: list[float]) -> int:
    """How many of the requests fit in `budget`, smallest first."""
    n, total = 0, 0.0
    for u in sorted(uses):
        total += u
        if total > budget * (1 + 1e-9):
            break
        n += 1
    return n


def met_bound(at: Setting, prof: ModelProfile, cand: Candidate, d: Demand) -> int:
    """The most of the window's requests that can meet every SLO: those maybe in the window fit,
    smallest first, into each side's capacity x (window + SLO budget); the least count wins.
    """
    s = _sides(at, prof, cand, d)
    if s.latency:
        return 0
    sc = at.scenario
    slo = sc.slo
    idx = d.maybe
    if not idx:
        return 0
    first = d.seconds + (slo.ttft_s or slo.e2e_s or math.inf)
    whole = d.seconds + _turn_budget_s(sc, max(d.output[i] for i in idx))

    def fit(budget: float, uses: list[float]) -> int:
        return _fit(budget, [uses[i] for i in idx])

    counts = [fit(s.prefill[0] * first, s.prefill[1]), fit(s.decode[0] * whole, s.decode[1]),
              fit(s.kv[0] * whole, s.kv[1])]
    if s.wan is not None:
        if s.relay is None:       # P-MD: the KV is at MD before its first token
            counts.append(fit(s.wan[0] * first, s.wan[1]))
        else:                     # PDD: across by the answer's end, or relayed whole
            slots = s.relay[0] * whole / s.relay[1] if s.relay[1] > 0 else math.inf
            counts.append(int(min(len(idx), fit(s.wan[0] * whole, s.wan[1]) + slots)))
    return min(min(counts), len(idx))


def attainment_bound(at: Setting, prof: ModelProfile, cand: Candidate, d: Demand) -> float:
    """An upper bound on the share of the window's requests that can meet every SLO: met_bound
    over the requests surely in the window (1.0 when none surely is: nothing to bound by)."""
    surely = d.surely
    return 1.0 if not surely else min(1.0, met_bound(at, prof, cand, d) / surely)


def slo_rps_bound(at: Setting, prof: ModelProfile, cand: Candidate, d: Demand) -> float:
    """An upper bound on the probe's requests per second within SLO (its goodput)."""
    return met_bound(at, prof, cand, d) / d.seconds


def deployment_bound(sc: Scenario, dep: DeploymentSpec, wan_gbps: float | None) -> Candidate | None:
    """A scenario's deployment as a candidate the bounds can read (`pddgw sim` prunes its goodput
    probes with them, as `pddgw plan` does); None where the bounds do not hold for it: a
    deployment from a config file, roles beyond prefill/md/rld, or a forced pipeline other than
    the one its kind runs (the bounds count P-MD for same-DC and naive, relays for PDD and a
    relaying P)."""
    roles = {g.role for g in dep.nodes}
    if dep.config or not {"prefill", "md"} <= roles or roles - {"prefill", "md", "rld"}:
        return None
    cross = sc.uses_wan(dep)
    relaying = any(g.relay for g in dep.nodes)
    if "rld" in roles or relaying:
        # `_sides` counts every relay, an RLD group's and a relaying P's alike.
        kind: Kind = "pdd" if "rld" in roles else "pdd-relay-on-p"
        return Candidate(kind, dep.nodes) if cross and dep.policy.pipeline == "auto" else None
    if dep.policy.pipeline not in ("auto", "P-MD"):
        return None                         # forced onto an RLD it does not have
    if not cross:
        return Candidate("same-dc", dep.nodes)
    # P-MD across the WAN: naive counts every prompt's KV across; an MD with a prefix cache lacks
    # only the uncached tokens (read as PDD without relays).
    naive = not any(g.prefix_cache for g in dep.nodes if g.role == "md")
    return Candidate("naive-cross-dc" if naive else "pdd", dep.nodes)
