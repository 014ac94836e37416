"""The embedded deployment's WAN in the paper's regime, derived from a measured decode step.

What makes PDD's choices right or wrong is dimensionless (docs/architecture.md, The regime PDD lives in): how
many prompt tokens' KV cross the WAN per decode step, the WAN RTT in decode
steps, the P-MD transfer budget in decode steps.  A fixed emulated bandwidth
keeps them only for the one model and machine it was tuned on, so the
embedded deployment derives its WAN at start instead:

  1. `regime_applies`: `[net.regime]` is enabled and `[[net.links]]` "wan"
     sets no bandwidth, latency or trace of its own (explicit figures win).
  2. `probe_step_s`: build a throwaway engine like the one that runs MD
     (off the loop), decode one short prompt at batch 1, and take the median
     step after a warm-up (`measure_decode_step_s`).
  3. `derive`: a pure function of the ratios, that step and the KV bytes
     per token -> the "wan" shaping and the policy's budget and link priors.
  4. `resolve`: the Config with those applied (`dataclasses.replace`) and
     what was derived, logged once as "wan_regime", before any node or link
     is built.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import structlog

from pddgw.config import Config, NodeConfig, RegimeConfig, ShapingConfig
from pddgw.engines.async_engine import in_passing_thread
from pddgw.engines.base import Engine, create_engine, engine_class
from pddgw.engines.kv_pool import DTYPES
from pddgw.core.sampling import SamplingParams
from pddgw.engines.types import EngineRequest
from pddgw.engines.weights import SharedModels, load_spec_for

log = structlog.get_logger(__name__)

WAN = "wan"            # the `[[net.links]]` entry serve.py shapes links between clusters with

# The probe: a short prompt, a few decode steps to warm caches and allocators
# up (the first ones are slower), then an odd number of timed steps (a true
# median, robust to one step that a busy machine stretched).
PROBE_PROMPT_TOKENS = 32
PROBE_WARMUP_STEPS = 3
PROBE_STEPS = 9


@dataclasses.dataclass(frozen=True, slots=True)
class DerivedWan:
    """The concrete emulated WAN and the policy figures that go with it."""

    step_ms: float
    kv_bytes_per_token: int
    shaping: ShapingConfig              # the "wan" link: gbps and one-way latency
    p_md_max_transfer_ms: float

    @property
    def link_prior_mbps(self) -> float:
        """The estimator's bandwidth prior: the derived WAN's own."""
        return self.shaping.gbps * 1000.0

    @property
    def link_prior_rtt_ms(self) -> float:
        return 2.0 * self.shaping.latency_ms

    def apply(self, cfg: Config) -> Config:
        """`cfg` with this WAN in `[[net.links]]` (replacing or adding "wan") and the policy figures."""
        links = tuple(self.shaping if s.name == WAN else s for s in cfg.net.links)
        if not any(s.name == WAN for s in links):
            links += (self.shaping,)
        policy = dataclasses.replace(cfg.policy, p_md_max_transfer_ms=self.p_md_max_transfer_ms,
                                     link_prior_mbps=self.link_prior_mbps,
                                     link_prior_rtt_ms=self.link_prior_rtt_ms)
        return dataclasses.replace(cfg, net=dataclasses.replace(cfg.net, links=links), policy=policy)


def derive(regime: RegimeConfig, step_s: float, kv_bytes_per_token: int,
           base: ShapingConfig | None = None) -> DerivedWan:
    """The WAN whose ratios to a decode step of `step_s` are the regime's.

    bandwidth = kv_bytes_per_token * tokens_per_step / step_s  (so that many
    tokens' KV cross per step), one-way latency = rtt_steps * step_s / 2, P-MD
    budget = budget_steps * step_s; the estimator's priors are that bandwidth
    and RTT.  `base` keeps the other fields of an existing "wan" entry
    (shared, seed).
    """
    if step_s <= 0 or not math.isfinite(step_s):
        raise ValueError(f"decode step must be a positive number of seconds, got {step_s!r}")
    if kv_bytes_per_token <= 0:
        raise ValueError(f"kv_bytes_per_token must be > 0, got {kv_bytes_per_token!r}")
    bits_per_s = kv_bytes_per_token * regime.tokens_per_step / step_s * 8.0
    step_ms = step_s * 1000.0
    rtt_ms = regime.rtt_steps * step_ms
    shaping = dataclasses.replace(base or ShapingConfig(name=WAN), name=WAN, gbps=bits_per_s / 1e9,
                                  latency_ms=rtt_ms / 2.0, trace=(), trace_period_s=0.0)
    return DerivedWan(step_ms=step_ms, kv_bytes_per_token=kv_bytes_per_token, shaping=shaping,
                      p_md_max_transfer_ms=regime.budget_steps * step_ms)


def regime_applies(cfg: Config) -> bool:
    """Enabled, and the "wan" link (if listed) sets no figures of its own."""
    if not cfg.net.regime.enabled:
        return False
    return not any(s.name == WAN and s.enabled for s in cfg.net.links)


def kv_bytes_per_token(cfg: Config) -> int:
    """KV bytes per token as the router counts them for the policy (deploy/serve.py RouterSide)."""
    spec, _, kv_dtype = load_spec_for(cfg.model)
    return spec.kv_bytes_per_token(DTYPES[kv_dtype])


def measure_decode_step_s(engine: Engine, prompt_tokens: int = PROBE_PROMPT_TOKENS,
                          warmup: int = PROBE_WARMUP_STEPS, steps: int = PROBE_STEPS) -> float:
    """Median seconds of one batch-1 decode step of `engine` (blocking: call it off the loop).

    An engine that models time (`runs_inline`) reports each step's modeled
    duration; any other is timed on the wall clock.  The probe request is
    gone from the engine when this returns.
    """
    rid = "wan-regime-probe"
    prompt = tuple(32 + i % 95 for i in range(prompt_tokens))      # printable bytes: valid in any vocabulary
    engine.add_request(EngineRequest(rid, prompt, SamplingParams(max_tokens=warmup + steps + 2, ignore_eos=True)))
    times: list[float] = []
    produced = 0
    try:
        while len(times) < steps:
            if not engine.has_work():
                raise RuntimeError("the decode-step probe finished early")
            t0 = time.perf_counter()
            outs = engine.step()
            dt = engine.step_seconds() if engine.runs_inline else time.perf_counter() - t0
            # Output 0 ends the prefill; the next `warmup` decodes are not timed.
            if produced > warmup and any(o.ids for o in outs):
                times.append(dt)
            produced += sum(len(o.ids) for o in outs)
    finally:
        engine.abort(rid)
    return statistics.median(times)


def probe_node(cfg: Config) -> NodeConfig | None:
    """The node whose engine the step is measured on: the first MD, else the first RLD."""
    for role in ("md", "rld"):
        for n in cfg.nodes:
            if n.role == role:
                return n
    return None


def _probe(cfg: Config, node: NodeConfig | None, models: SharedModels | None) -> float:
    ecfg = cfg.engine_for(node)
    # Only the blocks the probe needs: a copy of the whole pool would be memory for nothing.
    need = PROBE_PROMPT_TOKENS + PROBE_WARMUP_STEPS + PROBE_STEPS + 2
    ecfg = dataclasses.replace(ecfg, num_blocks=-(-need // ecfg.block_size) + 1)
    engine, _ = create_engine(cfg, ecfg, models)
    return measure_decode_step_s(engine)


async def probe_step_s(cfg: Config, models: SharedModels | None = None) -> float:
    """The decode step of a throwaway engine configured like the one that runs MD, measured off the loop.

    A throwaway engine, not MD's own: the probe leaves nothing in MD's prefix
    cache or statistics.  Its weights come from `models` (the ones the
    deployment's engines then share), else are loaded for the moment it runs;
    its pool has a few blocks.
    """
    node = probe_node(cfg)
    if engine_class(cfg.engine_for(node).implementation).runs_inline:
        return _probe(cfg, node, models)            # modeled time: bookkeeping only
    return await in_passing_thread(_probe, cfg, node, models)


async def resolve(cfg: Config, models: SharedModels | None = None) -> tuple[Config, DerivedWan | None]:
    """-> (`cfg` with its WAN and policy figures derived, what was derived) when
    the regime applies; else (`cfg` itself, None)."""
    if not regime_applies(cfg):
        return cfg, None
    regime = cfg.net.regime
    measured = regime.step_ms == 0
    step_s = await probe_step_s(cfg, models) if measured else regime.step_ms / 1000.0
    base = next((s for s in cfg.net.links if s.name == WAN), None)
    d = derive(regime, step_s, kv_bytes_per_token(cfg), base)
    log.info("wan_regime", step_ms=round(d.step_ms, 4), step_measured=measured,
             kv_bytes_per_token=d.kv_bytes_per_token, tokens_per_step=regime.tokens_per_step,
             gbps=round(d.shaping.gbps, 6), latency_ms=round(d.shaping.latency_ms, 4),
             p_md_max_transfer_ms=round(d.p_md_max_transfer_ms, 4),
             link_prior_mbps=round(d.link_prior_mbps, 3), link_prior_rtt_ms=round(d.link_prior_rtt_ms, 4))
    return d.apply(cfg), d
