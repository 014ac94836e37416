"""Scenario files for `pddgw sim`: deployments, links, workload, SLOs, sweeps.

A scenario is TOML decoded into the frozen dataclasses below with the same
loader as config.toml (`pddgw.config_build.build`), so an unknown key or a bad
value is an error that names the file and the dotted key.  Each deployment
becomes an ordinary `Config` (`deployment_config`): the simulator runs the
real router, policy and workers of that config, only on a virtual clock and
with the cost-model engine.  A deployment may instead name a config.toml
(`config = "path"`), which is how the same deployment runs once simulated
and once as real `pddgw serve` processes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pddgw.config import (Config, ConfigError, CostModelConfig, EngineConfig, LogConfig, ModelConfig, NetConfig,
                          NodeConfig, PolicyConfig, ServerConfig, ShapingConfig, check_stream_interval, load_config)
from pddgw.config_build import load_toml
from pddgw.core.errors import check as _check
from pddgw.sim.costmodel_engine import parallel
from pddgw.sim.model_shape import ModelProfile
from pddgw.sim.profiles import FP4_MODES, HARDWARE, MODELS, Fp4Mode, as_run, check_prices, hardware, model, price
from pddgw.sim.roofline import Fit, memory_fit
from pddgw.sim.workload import AgenticSpec


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """`count` identical instances of one role, each `tensor_parallel` x `data_parallel` GPUs
    (DP-attention ranks of TP GPUs; a MoE's experts over `expert_parallel` of them, 0 = all;
    an instance of more than `gpus_per_node` GPUs spans nodes).  `max_num_seqs`,
    `max_num_batched_tokens` and `mixed_step_tokens` are per DP rank, as in vLLM
    (`config.EngineConfig`).  `relay` (prefill groups only): each instance also relays the
    requests it prefills (`config.NodeConfig.relay`), in place of an RLD group."""

    role: Literal["prefill", "rld", "md"]
    count: int = 1
    cluster: str = "A"
    hardware: str = "H100-SXM"
    tensor_parallel: int = 8
    data_parallel: int = 1
    expert_parallel: int = 0
    gpus_per_node: int = 8
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    prefix_cache: bool = True
    # A decoding step computes at most this many other tokens (0 = the engine's default: no cap,
    # or `config.RELAY_MIXED_STEP_TOKENS` on a relaying P): a relaying P's relayed requests wait
    # one such chunk, not a whole prefill step, for each token.
    mixed_step_tokens: int = 0
    relay: bool = False
    # USD per GPU-hour; 0 = the scenario's [prices], else prices.toml (`profiles.price`).
    price_per_gpu_hour: float = 0.0
    # FP4 weights on a part without FP4 tensor cores: "" = the scenario's (`Scenario.fp4_on_non_native`).
    fp4_on_non_native: Fp4Mode | Literal[""] = ""

    def __post_init__(self) -> None:
        _check(self.count >= 1, "count must be >= 1")
        _check(self.hardware in HARDWARE, f"hardware {self.hardware!r} is not one of {sorted(HARDWARE)}")
        _check(self.tensor_parallel >= 1, "tensor_parallel must be >= 1")
        _check(not self.relay or self.role == "prefill",
               f"relay = true is for a prefill group (this one is {self.role})")
        _check(self.mixed_step_tokens >= 0, "mixed_step_tokens must be >= 0")
        _check(self.price_per_gpu_hour >= 0, "price_per_gpu_hour must be >= 0")
        _check(self.fp4_on_non_native in ("", *FP4_MODES), f"fp4_on_non_native must be one of {FP4_MODES}")
        # The engine's own checks (expert_parallel divides the GPUs, ranges), with this group's keys.
        self.costmodel()

    def costmodel(self) -> CostModelConfig:
        """The engine.costmodel section of this group's instances."""
        return CostModelConfig(hardware=self.hardware, tensor_parallel=self.tensor_parallel,
                               data_parallel=self.data_parallel, expert_parallel=self.expert_parallel,
                               gpus_per_node=self.gpus_per_node, fp4_on_non_native=self.fp4_on_non_native or "w4a16")

    @property
    def seqs_per_instance(self) -> int:
        """The batch bound of one instance: max_num_seqs on each of its DP ranks."""
        return self.max_num_seqs * self.data_parallel

    @property
    def gpus_per_instance(self) -> int:
        return self.tensor_parallel * self.data_parallel

    @property
    def gpus(self) -> int:
        return self.count * self.gpus_per_instance

    @property
    def price(self) -> float:
        """USD per hour for the whole group (`load_scenario` sets price_per_gpu_hour from the
        scenario's [prices]; unset, prices.toml's)."""
        return self.gpus * (self.price_per_gpu_hour or price(self.hardware))


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    name: str
    # Node groups; or `config`, a config.toml whose nodes use the cost-model engine.
    nodes: tuple[NodeGroup, ...] = ()
    config: str = ""
    # Router policy; `pipeline` forces one (e.g. "P-MD" for PD baselines).
    policy: PolicyConfig = field(default_factory=PolicyConfig)

    def __post_init__(self) -> None:
        _check(bool(self.name), "name must not be empty")
        _check(bool(self.nodes) != bool(self.config), "set either nodes or config")


@dataclass(frozen=True, slots=True)
class TraceSpec:
    path: str = ""
    requests: int = 0               # 0 = the whole trace
    speed: float = 1.0              # timestamps are divided by it
    output_cap: int = 0             # cap on output lengths (0 = as in the trace)
    # > 0: every request of each burst_s-second span arrives at its start (after `speed`)
    burst_s: float = 0.0

    def __post_init__(self) -> None:
        _check(self.requests >= 0 and self.output_cap >= 0, "requests and output_cap must be >= 0")
        _check(self.speed > 0, "speed must be > 0")
        _check(self.burst_s >= 0, "burst_s must be >= 0")


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    kind: Literal["agentic", "trace"] = "agentic"
    agentic: AgenticSpec = field(default_factory=AgenticSpec)
    trace: TraceSpec = field(default_factory=TraceSpec)


@dataclass(frozen=True, slots=True)
class SloSpec:
    """A request meets its SLOs when every set bound holds (0 = unbounded); it
    counts as failed when it ends with an error."""

    ttft_s: float = 10.0
    tpot_ms: float = 100.0          # mean time per output token after the first
    e2e_s: float = 0.0
    attainment: float = 0.9         # SLA goodput: highest rate with this share meeting every SLO

    def __post_init__(self) -> None:
        _check(self.ttft_s >= 0 and self.tpot_ms >= 0 and self.e2e_s >= 0, "SLO bounds must be >= 0")
        _check(0 < self.attainment <= 1, "attainment must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class GoodputSpec:
    """Search of SLA goodput per deployment: bisection over offered request rates.

    One probe (`probe.probe_workload`): agentic conversations arrive open-loop for `warmup_s +
    seconds` and the requests arriving in the last `seconds` are measured; a trace's probe takes
    its first rate x seconds requests (at least `min_requests`) scaled to `rate`.
    """

    enabled: bool = True
    seconds: float = 600.0
    min_requests: int = 100
    rate_min: float = 0.25
    rate_max: float = 16.0
    probes: int = 6
    # Agentic workloads: conversations arrive open-loop for warmup_s + seconds and requests
    # arriving in the last `seconds` are measured (pddgw.sim.report.window_goodput).
    warmup_s: float = 0.0

    def __post_init__(self) -> None:
        _check(self.seconds > 0 and self.min_requests >= 1 and self.probes >= 1,
               "seconds must be > 0, min_requests and probes >= 1")
        _check(0 < self.rate_min < self.rate_max, "need 0 < rate_min < rate_max")
        _check(self.warmup_s >= 0, "warmup_s must be >= 0")

    def requests(self, rate: float) -> int:
        return max(self.min_requests, round(rate * self.seconds))


@dataclass(frozen=True, slots=True)
class BathtubSpec:
    """PDD's benefit over a baseline as the average prefix hit sweeps `hits`."""

    enabled: bool = False
    deployment: str = ""
    baseline: str = ""
    wan_gbps: float = 0.0           # the WAN of the sweep (0 = the scenario's first variant)
    hits: tuple[float, ...] = (0.0, 0.25, 0.5, 0.7, 0.85, 0.95, 1.0)
    band: float = 0.02              # follow-up hits are uniform in [hit - band, hit + band]
    requests: int = 200
    rate: float = 1.0

    def __post_init__(self) -> None:
        _check(all(0 <= h <= 1 for h in self.hits), "hits must be in [0, 1]")
        _check(self.wan_gbps >= 0, "wan_gbps must be >= 0")
        _check(self.requests >= 1 and self.rate > 0, "requests must be >= 1 and rate > 0")


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str = "scenario"
    seed: int = 0
    model: str = "llama3-70b"
    block_size: int = 64
    # Deployment BCR and goodput are reported relative to ("" = the first).
    baseline: str = ""
    # Each value is one variant of the whole scenario with the "wan" link at that bandwidth.
    wan_gbps: tuple[float, ...] = ()
    # KV-frame and token-stream granularity of every node: the KV frame size, and the tokens
    # a decoding request gathers before they go to the router (engine.stream_interval).
    kv_frame_mb: float = 64.0
    stream_interval: int = 1
    links: tuple[ShapingConfig, ...] = ()
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    slo: SloSpec = field(default_factory=SloSpec)
    goodput: GoodputSpec = field(default_factory=GoodputSpec)
    bathtub: BathtubSpec = field(default_factory=BathtubSpec)
    deployments: tuple[DeploymentSpec, ...] = ()
    # Published numbers printed next to ours: metric name -> value.
    published: dict[str, float] = field(default_factory=dict)
    # USD per GPU-hour by hardware name, over pddgw/sim/prices.toml's (`profiles.price`).
    prices: dict[str, float] = field(default_factory=dict)
    # FP4 weights on a part without FP4 tensor cores (`profiles.as_run`): "w4a16" keeps FP4
    # bytes and computes in BF16, "fp8_repack" runs an FP8 copy of the checkpoint.
    fp4_on_non_native: Fp4Mode = "w4a16"

    def __post_init__(self) -> None:
        _check(bool(self.deployments), "no [[deployments]]")
        names = [d.name for d in self.deployments]
        _check(len(set(names)) == len(names), "deployment names must be unique")
        for ref in (self.baseline, self.bathtub.deployment, self.bathtub.baseline):
            _check(not ref or ref in names, f"no deployment named {ref!r} (have: {', '.join(names)})")
        _check(not self.bathtub.enabled or (self.bathtub.deployment and self.bathtub.baseline),
               "bathtub needs deployment and baseline")
        _check(all(g > 0 for g in self.wan_gbps), "wan_gbps must be > 0")
        _check(self.kv_frame_mb > 0, "kv_frame_mb must be > 0")
        check_stream_interval(self.stream_interval)
        check_prices(self.prices)
        _check(self.fp4_on_non_native in FP4_MODES, f"fp4_on_non_native must be one of {FP4_MODES}")

    @property
    def baseline_name(self) -> str:
        return self.baseline or self.deployments[0].name

    def deployment(self, name: str) -> DeploymentSpec:
        return next(d for d in self.deployments if d.name == name)

    def variants(self) -> list[float | None]:
        """The WAN bandwidths to run (None: the links as configured)."""
        return list(self.wan_gbps) or [None]

    def bathtub_wan(self) -> float | None:
        return self.bathtub.wan_gbps or self.variants()[0]

    def uses_wan(self, dep: DeploymentSpec) -> bool:
        """Whether a deployment spans clusters (a same-DC one runs once for every WAN variant)."""
        if dep.config:
            return len({n.cluster for n in load_config(dep.config).nodes}) > 1
        return len({"A"} | {g.cluster for g in dep.nodes}) > 1


def load_scenario(path: str | Path) -> Scenario:
    p = Path(path)
    sc: Scenario = load_toml(p, Scenario, "scenario")
    # `model` is a profile name or a config.json path, relative to the scenario file.
    if sc.model not in MODELS and (p.parent / sc.model).exists():
        sc = dataclasses.replace(sc, model=str((p.parent / sc.model).resolve()))
    # Relative paths inside a scenario are relative to the scenario file.
    deps = tuple(dataclasses.replace(d, config=str((p.parent / d.config).resolve())) if d.config else d
                 for d in sc.deployments)
    deps = tuple(dataclasses.replace(d, nodes=with_prices(p, d.nodes, sc.prices, sc.fp4_on_non_native))
                 for d in deps)
    wl = sc.workload
    if wl.kind == "trace":
        if not wl.trace.path:
            raise ConfigError(f"{p}: workload.trace.path: a trace workload needs a path")
        wl = dataclasses.replace(wl, trace=dataclasses.replace(wl.trace,
                                                               path=str((p.parent / wl.trace.path).resolve())))
    return dataclasses.replace(sc, deployments=deps, workload=wl)


def with_prices(where: Path, groups: tuple[NodeGroup, ...], prices: dict[str, float],
                fp4_on_non_native: Fp4Mode) -> tuple[NodeGroup, ...]:
    """`groups` with each one's USD per GPU-hour and FP4 choice set (`profiles.price` of the
    scenario's [prices]); ConfigError naming the key of a part that has no price."""
    out = []
    for g in groups:
        try:
            usd = g.price_per_gpu_hour or price(g.hardware, prices)
        except KeyError as e:
            raise ConfigError(f"{where}: {e.args[0]}") from None
        out.append(dataclasses.replace(g, price_per_gpu_hour=usd,
                                       fp4_on_non_native=g.fp4_on_non_native or fp4_on_non_native))
    return tuple(out)


def _with_wan(links: tuple[ShapingConfig, ...], wan_gbps: float | None) -> tuple[ShapingConfig, ...]:
    """`links` with the "wan" one at a constant `wan_gbps` (None: as they are)."""
    if wan_gbps is None:
        return links
    return tuple(dataclasses.replace(s, gbps=wan_gbps, trace=()) if s.name == "wan" else s for s in links)


def sim_net(links: tuple[ShapingConfig, ...], kv_frame_bytes: int) -> NetConfig:
    """Node links of a simulated deployment: KV in large frames (fewer events), the given shaping."""
    return NetConfig(links=links, kv_frame_bytes=kv_frame_bytes, max_frame_bytes=max(8 << 20, kv_frame_bytes),
                     inbound_buffer_bytes=max(64 << 20, 4 * kv_frame_bytes), request_timeout_s=600.0,
                     send_timeout_s=600.0)


def deployment_config(sc: Scenario, dep: DeploymentSpec, wan_gbps: float | None = None) -> Config:
    """The Config that `dep` runs as (nodes expanded from the groups, cost-model engines)."""
    if dep.config:
        cfg = load_config(dep.config)
        net = dataclasses.replace(cfg.net, links=_with_wan(cfg.net.links, wan_gbps))
        return dataclasses.replace(cfg, net=net, log=LogConfig(level="warning"))
    nodes = [NodeConfig("router", "router", "A")]
    prefix = {"prefill": "p", "rld": "rld", "md": "md"}
    counters: dict[str, int] = {}
    for g in dep.nodes:
        check_fit(sc, dep, g)
        ecfg = EngineConfig(implementation="costmodel", block_size=sc.block_size, num_blocks=0,
                            max_num_seqs=g.max_num_seqs, max_num_batched_tokens=g.max_num_batched_tokens,
                            mixed_step_tokens=g.mixed_step_tokens, enable_prefix_caching=g.prefix_cache,
                            stream_interval=sc.stream_interval, costmodel=g.costmodel())
        for _ in range(g.count):
            i = counters.get(g.role, 0)
            counters[g.role] = i + 1
            nodes.append(NodeConfig(f"{prefix[g.role]}{i}", g.role, g.cluster,
                                    cost=g.price / g.count, engine=ecfg, relay=g.relay))
    return Config(model=ModelConfig(profile=sc.model), engine=nodes[1].engine or EngineConfig(),
                  net=sim_net(_with_wan(sc.links, wan_gbps), int(sc.kv_frame_mb * (1 << 20))),
                  policy=dep.policy, server=ServerConfig(request_timeout_s=3600.0),
                  log=LogConfig(level="warning"), nodes=tuple(nodes))


def group_fit(prof: ModelProfile, g: NodeGroup) -> Fit:
    """How one instance of the group divides its memory (`roofline.memory_fit` of its shape)."""
    cm = g.costmodel()
    hw = hardware(g.hardware)
    return memory_fit(as_run(prof, hw, cm.fp4_on_non_native), hw, parallel(cm), cm.gpu_memory_utilization,
                      g.seqs_per_instance)


def check_fit(sc: Scenario, dep: DeploymentSpec, g: NodeGroup) -> None:
    """ConfigError naming the deployment, the group and the numbers unless the scenario's
    model fits one of the group's instances with room for KV."""
    try:
        prof = model(sc.model)
    except KeyError as e:
        raise ConfigError(f"model: {e.args[0]}") from None
    hw = hardware(g.hardware)
    cm = g.costmodel()
    prof = as_run(prof, hw, cm.fp4_on_non_native)
    fit = group_fit(prof, g)
    if fit.kv_tokens < sc.block_size:
        shape = (f"{g.count} x {g.gpus_per_instance} x {g.hardware} (tensor_parallel {g.tensor_parallel} "
                 f"x data_parallel {g.data_parallel}, expert_parallel {cm.expert_parallel or cm.gpus})")
        raise ConfigError(
            f"deployment {dep.name!r}, {g.role} group {shape}: {prof.name} does not fit: weights "
            f"{prof.weight_bytes / 1e9:.1f} GB, {fit.weights_gb:.1f} GB per GPU, of {hw.hbm_gb:g} GB HBM x "
            f"{cm.gpu_memory_utilization:g} = {fit.usable_gb:.1f} GB usable, leaves {fit.kv_gb:.1f} GB per GPU "
            f"for KV ({fit.kv_tokens} tokens for {g.max_num_seqs} sequences per rank); use more GPUs per instance")


def deployment_hardware(dep: DeploymentSpec) -> list[str]:
    """The hardware names a deployment's instances run on."""
    if dep.config:
        cfg = load_config(dep.config)
        return [cfg.engine_for(n).costmodel.hardware for n in cfg.nodes if n.role != "router"]
    return [g.hardware for g in dep.nodes]


def deployment_price(sc: Scenario, dep: DeploymentSpec) -> tuple[float, int]:
    """(USD per hour, GPUs) of a deployment."""
    if dep.config:
        cfg = load_config(dep.config)
        gpus = sum(cfg.engine_for(n).costmodel.gpus for n in cfg.nodes if n.role != "router")
        return sum(n.cost for n in cfg.nodes if n.role != "router"), gpus
    return sum(g.price for g in dep.nodes), sum(g.gpus for g in dep.nodes)
