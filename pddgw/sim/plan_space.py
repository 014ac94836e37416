"""The search space of `pddgw plan`: a planner TOML decoded, and the candidate deployments it allows.

A plan names a scenario (`pddgw sim`'s format; the plan may replace its model, workload or
trace, SLOs, goodput search and WAN bandwidth) and the space: a hardware menu with prices per
cluster, GPU caps and USD budgets, and per role the instance counts and shapes allowed.
Decoded with `pddgw.config_build.build`: an unknown key or bad value names the file and dotted key.

Deployment kinds (docs/architecture.md, The regime PDD lives in):

  same-dc          P and decode in cluster A, P-MD forced (homogeneous PD)
  naive-cross-dc   P in A, MD in B without a prefix cache, P-MD forced (the whole prompt's KV crosses)
  cross-dc-cached  P in A, MD in B with its prefix cache, no RLD, P-MD forced (only the KV MD lacks
                   crosses; the router's prefix affinity as the plan's policy sets it, on by default)
  pdd              P and RLD in A, MD in B, the router's policy decides
  pdd-relay-on-p   P in A relaying what it prefills (`relay = true`, no RLD instance), MD in B
                   with its prefix cache, the router's policy decides (P-RLD-MD / P-RLD with
                   RLD = that P); its engines cap a decoding step's prefill tokens at
                   `[roles.prefill] mixed_step_tokens` (0: `config.RELAY_MIXED_STEP_TOKENS`)

`candidates(plan, sc, kind)` enumerates (hardware, shape, count) per role, drops the pairs
the model does not fit (as `pddgw sim` would) and keeps those within the budgets; none left
is a ConfigError naming the kind, the smallest deployment's needs and the budget.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pddgw.config import ConfigError, PolicyConfig
from pddgw.config_build import load_toml
from pddgw.core.errors import check as _check
from pddgw.sim.profiles import HARDWARE, ModelProfile, check_prices, price
from pddgw.sim.scenario import (DeploymentSpec, GoodputSpec, NodeGroup, Scenario, SloSpec, WorkloadSpec, group_fit,
                                load_scenario)

Kind = Literal["same-dc", "naive-cross-dc", "cross-dc-cached", "pdd", "pdd-relay-on-p"]
KINDS: tuple[Kind, ...] = ("same-dc", "naive-cross-dc", "cross-dc-cached", "pdd", "pdd-relay-on-p")
# The kinds whose router policy decides the pipeline (the others force P-MD).
POLICY_DECIDES: tuple[Kind, ...] = ("pdd", "pdd-relay-on-p")
ROLE_PREFIX = {"prefill": "P", "rld": "RLD", "md": "MD"}
# A relaying prefill group's label: one instance is P and RLD at once.
RELAY_PREFIX = "P+RLD"


@dataclass(frozen=True, slots=True)
class HardwareOption:
    """One entry of a cluster's hardware menu."""

    hardware: str
    price_per_gpu_hour: float = 0.0      # USD; 0 = the plan's [prices], the scenario's, prices.toml's
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        _check(self.hardware in HARDWARE, f"hardware {self.hardware!r} is not one of {sorted(HARDWARE)}")
        _check(self.price_per_gpu_hour >= 0, "price_per_gpu_hour must be >= 0")
        _check(self.gpus_per_node >= 1, "gpus_per_node must be >= 1")

    @property
    def price(self) -> float:
        """USD per GPU-hour (`load_plan` sets price_per_gpu_hour from the [prices] tables)."""
        return self.price_per_gpu_hour or price(self.hardware)


@dataclass(frozen=True, slots=True)
class ClusterSpace:
    """What one cluster offers: its hardware menu and its limits (0 = none)."""

    name: str
    hardware: tuple[HardwareOption, ...] = ()
    gpus: int = 0                        # at most this many GPUs in the cluster
    usd_per_hour: float = 0.0            # at most this much per hour for the cluster's GPUs

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        _check(bool(self.hardware), f"cluster {self.name!r}: the hardware menu is empty")
        _check(self.gpus >= 0 and self.usd_per_hour >= 0, "gpus and usd_per_hour must be >= 0")


@dataclass(frozen=True, slots=True)
class Shape:
    """One instance shape: tensor_parallel x data_parallel GPUs, experts over expert_parallel (0 = all)."""

    tensor_parallel: int = 1
    data_parallel: int = 1
    expert_parallel: int = 0

    def __post_init__(self) -> None:
        _check(self.tensor_parallel >= 1 and self.data_parallel >= 1, "tensor_parallel and data_parallel must be >= 1")
        gpus = self.tensor_parallel * self.data_parallel
        _check(self.expert_parallel >= 0 and (not self.expert_parallel or gpus % self.expert_parallel == 0),
               f"expert_parallel = {self.expert_parallel} must divide the shape's {gpus} GPUs, or be 0 (all)")

    @property
    def gpus(self) -> int:
        return self.tensor_parallel * self.data_parallel

    def label(self) -> str:
        s = f"tp{self.tensor_parallel}"
        if self.data_parallel > 1:
            s += f"xdp{self.data_parallel}"
        if self.expert_parallel:
            s += f" ep{self.expert_parallel}"
        return s


@dataclass(frozen=True, slots=True)
class RoleSpace:
    """Counts and shapes one role may take; every count from count_min to count_max;
    max_num_seqs, max_num_batched_tokens and mixed_step_tokens per DP rank (`scenario.NodeGroup`)."""

    count_min: int = 1
    count_max: int = 1
    shapes: tuple[Shape, ...] = (Shape(),)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # The role's engines' cap on a decoding step's other tokens (0 = the engine's default: none,
    # or a relaying P's `config.RELAY_MIXED_STEP_TOKENS`): it matters where P also decodes, the
    # relaying P of pdd-relay-on-p (other kinds' P never decode).
    mixed_step_tokens: int = 0

    def __post_init__(self) -> None:
        _check(1 <= self.count_min <= self.count_max, "need 1 <= count_min <= count_max")
        _check(bool(self.shapes), "shapes must not be empty")
        _check(self.max_num_seqs >= 1 and self.max_num_batched_tokens >= self.max_num_seqs,
               "need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        _check(self.mixed_step_tokens >= 0, "mixed_step_tokens must be >= 0")


@dataclass(frozen=True, slots=True)
class RolesSpace:
    prefill: RoleSpace = field(default_factory=RoleSpace)
    rld: RoleSpace = field(default_factory=RoleSpace)
    md: RoleSpace = field(default_factory=RoleSpace)


@dataclass(frozen=True, slots=True)
class SearchSpec:
    """How candidates are evaluated: `top` rows in each kind's table (the branch and bound
    proves these are the best; plan_search)."""

    top: int = 5

    def __post_init__(self) -> None:
        _check(self.top >= 1, "top must be >= 1")


@dataclass(frozen=True, slots=True)
class SweepSpec:
    """The payoff map's grid (`pddgw plan --sweep`, `plan_sweep`): cluster B's GPU-B parts, its
    price as ratios of GPU-A's (and `market`: its [prices] entry), WAN bandwidths and the
    agentic workload's prefix hit of follow-up turns (() = the workload's own buckets)."""

    gpu_b: tuple[str, ...] = ()
    price_ratios: tuple[float, ...] = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5)
    market: bool = True
    wan_gbps: tuple[float, ...] = (1.0, 10.0, 100.0)
    prefix_hits: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check(bool(self.gpu_b) and len(set(self.gpu_b)) == len(self.gpu_b), "gpu_b: name distinct parts")
        for hw in self.gpu_b:
            _check(hw in HARDWARE, f"gpu_b: hardware {hw!r} is not one of {sorted(HARDWARE)}")
        _check(all(r > 0 for r in self.price_ratios), "price_ratios must be > 0")
        _check(len(set(self.price_ratios)) == len(self.price_ratios), "price_ratios must be distinct")
        _check(bool(self.price_ratios) or self.market, "price_ratios: empty and market = false: no price to map")
        _check(bool(self.wan_gbps) and all(w > 0 for w in self.wan_gbps), "wan_gbps: name bandwidths > 0")
        _check(all(0 <= h <= 1 for h in self.prefix_hits), "prefix_hits must lie in [0, 1]")

    @property
    def ratios(self) -> tuple[float | None, ...]:
        """The price axis: each ratio, then None for `market`."""
        return self.price_ratios + ((None,) if self.market else ())

    @property
    def hits(self) -> tuple[float | None, ...]:
        """The prefix-hit axis; (None,): the workload's own hits."""
        return self.prefix_hits or (None,)


@dataclass(frozen=True, slots=True)
class PlanSpec:
    name: str = "plan"
    scenario: str = ""                   # scenario TOML, relative to the plan file
    model: str = ""                      # "" = the scenario's
    trace: str = ""                      # a Mooncake trace instead of the scenario's workload
    kinds: tuple[Kind, ...] = KINDS      # the kinds to search (`searched`)
    wan_gbps: float = 0.0                # 0 = the scenario's first WAN variant (or its links)
    usd_per_hour: float = 0.0            # total budget of a deployment (0 = none)
    clusters: tuple[ClusterSpace, ...] = ()
    roles: RolesSpace = field(default_factory=RolesSpace)
    # None = the scenario's; a [workload] table replaces it whole (its unset keys take their defaults).
    workload: WorkloadSpec | None = None
    slo: SloSpec | None = None           # None = the scenario's
    goodput: GoodputSpec | None = None   # None = the scenario's
    policy: PolicyConfig | None = None   # PDD's router policy; None = the default
    search: SearchSpec = field(default_factory=SearchSpec)
    # USD per GPU-hour by hardware name, over the scenario's [prices] and pddgw/sim/prices.toml.
    prices: dict[str, float] = field(default_factory=dict)
    sweep: SweepSpec | None = None       # the payoff map's grid (`pddgw plan --sweep`)

    def __post_init__(self) -> None:
        _check(bool(self.scenario), "scenario: name the scenario TOML (model, links, workload, SLOs)")
        check_prices(self.prices)
        _check(bool(self.kinds) and len(set(self.kinds)) == len(self.kinds), "kinds must be distinct and not empty")
        _check(self.wan_gbps >= 0 and self.usd_per_hour >= 0, "wan_gbps and usd_per_hour must be >= 0")
        names = [c.name for c in self.clusters]
        _check(len(set(names)) == len(names), "clusters: duplicate name")
        need = {"A"} | ({"B"} if any(k != "same-dc" for k in self.kinds) else set())
        missing = sorted(need - set(names))
        _check(not missing, f"clusters: no cluster named {', '.join(map(repr, missing))} (cluster A holds P, "
                            "RLD and same-DC decode, cluster B the cross-DC MD)")

    @property
    def searched(self) -> tuple[Kind, ...]:
        """The kinds to search: `kinds`."""
        return self.kinds

    def cluster(self, name: str) -> ClusterSpace:
        return next(c for c in self.clusters if c.name == name)


@dataclass(frozen=True, slots=True)
class Plan:
    """A loaded plan: its spec and the scenario with the plan's overrides applied."""

    spec: PlanSpec
    scenario: Scenario
    wan_gbps: float | None               # the WAN every cross-DC candidate runs at (None: links as configured)

    @property
    def slo(self) -> SloSpec:
        return self.scenario.slo

    @property
    def goodput(self) -> GoodputSpec:
        return self.scenario.goodput


def load_plan(path: str | Path, trace: str = "", wan_gbps: float = 0.0) -> Plan:
    p = Path(path)
    spec: PlanSpec = load_toml(p, PlanSpec, "plan")
    sc = load_scenario(p.parent / spec.scenario)
    model = spec.model
    if model and (p.parent / model).exists():
        model = str((p.parent / model).resolve())
    trace_path = trace or (str((p.parent / spec.trace).resolve()) if spec.trace else "")
    wl = spec.workload or sc.workload
    if spec.workload and wl.kind == "trace" and not trace_path:
        raise ConfigError(f"{p}: workload.trace.path: name the trace with the plan's `trace` key")
    if trace_path:
        wl = dataclasses.replace(wl, kind="trace", trace=dataclasses.replace(wl.trace, path=trace_path))
    sc = dataclasses.replace(sc, model=model or sc.model, workload=wl, slo=spec.slo or sc.slo,
                             goodput=spec.goodput or sc.goodput)
    prices = {**sc.prices, **spec.prices}
    clusters = []
    for cs in spec.clusters:
        menu = []
        for opt in cs.hardware:
            try:
                menu.append(dataclasses.replace(opt, price_per_gpu_hour=opt.price_per_gpu_hour
                                                or price(opt.hardware, prices)))
            except KeyError as e:
                raise ConfigError(f"{p}: {e.args[0]}") from None
        clusters.append(dataclasses.replace(cs, hardware=tuple(menu)))
    spec = dataclasses.replace(spec, clusters=tuple(clusters))
    wan = wan_gbps or spec.wan_gbps or (sc.wan_gbps[0] if sc.wan_gbps else None)
    if not any(s.name == "wan" for s in sc.links) and any(k != "same-dc" for k in spec.kinds):
        raise ConfigError(f"{p}: scenario {spec.scenario}: cross-DC kinds need a [[links]] entry named \"wan\"")
    return Plan(spec, sc, wan)


# ---- candidates ---------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Candidate:
    """One deployment the planner may pick: a kind and its node groups."""

    kind: Kind
    groups: tuple[NodeGroup, ...]

    @property
    def price(self) -> float:
        return sum(g.price for g in self.groups)

    @property
    def gpus(self) -> int:
        return sum(g.gpus for g in self.groups)

    def gpus_in(self, cluster: str) -> int:
        return sum(g.gpus for g in self.groups if g.cluster == cluster)

    def usd_in(self, cluster: str) -> float:
        return sum(g.price for g in self.groups if g.cluster == cluster)

    def group(self, role: str) -> NodeGroup | None:
        return next((g for g in self.groups if g.role == role), None)

    def label(self) -> str:
        """e.g. "P 2 x H100-SXM tp8 | MD 1 x H200-SXM tp8" (counts x hardware shape; a relaying P
        is "P+RLD")."""
        parts = []
        for g in self.groups:
            shape = Shape(g.tensor_parallel, g.data_parallel, g.expert_parallel).label()
            role = RELAY_PREFIX if g.relay else ROLE_PREFIX[g.role]
            parts.append(f"{role} {g.count} x {g.hardware} {shape}")
        return " | ".join(parts)

    def policy(self, plan: PlanSpec) -> PolicyConfig:
        if self.kind in POLICY_DECIDES:
            return plan.policy or PolicyConfig()
        return dataclasses.replace(plan.policy or PolicyConfig(), pipeline="P-MD")

    def deployment(self, plan: PlanSpec, name: str = "") -> DeploymentSpec:
        return DeploymentSpec(name=name or self.kind, nodes=self.groups, policy=self.policy(plan))


def _roles(kind: Kind) -> tuple[tuple[str, str], ...]:
    """(role, cluster) of each group of a kind, in the order a deployment lists them."""
    if kind == "same-dc":
        return ("prefill", "A"), ("md", "A")
    if kind in ("naive-cross-dc", "cross-dc-cached", "pdd-relay-on-p"):
        return ("prefill", "A"), ("md", "B")
    return ("prefill", "A"), ("rld", "A"), ("md", "B")


def role_options(plan: Plan, prof: ModelProfile, kind: Kind, role: str, cluster: str) -> list[NodeGroup]:
    """Every (hardware, shape, count) group of one role that fits the model; ConfigError when none does."""
    rs: RoleSpace = getattr(plan.spec.roles, role)
    cs = plan.spec.cluster(cluster)
    out, tried = [], []
    for opt in cs.hardware:
        for shape in rs.shapes:
            one = NodeGroup(role=role, count=1, cluster=cluster, hardware=opt.hardware,
                            tensor_parallel=shape.tensor_parallel, data_parallel=shape.data_parallel,
                            expert_parallel=shape.expert_parallel, gpus_per_node=opt.gpus_per_node,
                            max_num_seqs=rs.max_num_seqs, max_num_batched_tokens=rs.max_num_batched_tokens,
                            mixed_step_tokens=rs.mixed_step_tokens,
                            relay=kind == "pdd-relay-on-p" and role == "prefill",
                            prefix_cache=not (kind == "naive-cross-dc" and role == "md"),
                            price_per_gpu_hour=opt.price, fp4_on_non_native=plan.scenario.fp4_on_non_native)
            tried.append(f"{shape.gpus} x {opt.hardware} {shape.label()}")
            if group_fit(prof, one).kv_tokens < plan.scenario.block_size:     # what check_fit refuses
                continue
            out += [dataclasses.replace(one, count=n) for n in range(rs.count_min, rs.count_max + 1)]
    if not out:
        raise ConfigError(f"plan: {kind}: {prof.name} ({prof.weight_bytes / 1e9:.1f} GB of weights) fits no "
                          f"{role} shape of cluster {cluster} ({', '.join(tried)}): roles.{role}.shapes needs "
                          "more GPUs per instance")
    return out


def _within(plan: PlanSpec, c: Candidate) -> bool:
    if plan.usd_per_hour and c.price > plan.usd_per_hour + 1e-9:
        return False
    for cs in plan.clusters:
        if cs.gpus and c.gpus_in(cs.name) > cs.gpus:
            return False
        if cs.usd_per_hour and c.usd_in(cs.name) > cs.usd_per_hour + 1e-9:
            return False
    return True


def _budget_text(plan: PlanSpec, clusters: set[str]) -> str:
    parts = [f"cluster {cs.name}: {cs.gpus or 'any'} GPUs, "
             + (f"${cs.usd_per_hour:g}/h" if cs.usd_per_hour else "any $/h")
             for cs in plan.clusters if cs.name in clusters]
    if plan.usd_per_hour:
        parts.append(f"total ${plan.usd_per_hour:g}/h")
    return "; ".join(parts)


def candidates(plan: Plan, prof: ModelProfile, kind: Kind) -> list[Candidate]:
    """Every deployment of `kind` the space allows within the budgets, cheapest first."""
    per_role = [role_options(plan, prof, kind, role, cluster) for role, cluster in _roles(kind)]
    every = [Candidate(kind, tuple(gs)) for gs in itertools.product(*per_role)]
    ok = [c for c in every if _within(plan.spec, c)]
    if not ok:
        small = min(every, key=lambda c: (c.price, c.gpus, c.label()))
        clusters = {g.cluster for g in small.groups}
        need = ", ".join(f"{small.gpus_in(x)} GPUs / ${small.usd_in(x):.2f}/h in cluster {x}"
                         for x in sorted(clusters))
        raise ConfigError(f"plan: no {kind} deployment fits the budget: the smallest, {small.label()}, needs "
                          f"{need} (${small.price:.2f}/h in all); the budget allows "
                          f"{_budget_text(plan.spec, clusters)}")
    ok.sort(key=lambda c: (c.price, c.gpus, c.label()))
    return ok
