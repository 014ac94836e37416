"""The embedded default's WAN in the paper's regime (deploy/regime.py, `[net.regime]`).

The derivation is exact arithmetic; the measurement is checked for what it
must leave behind; the end-to-end test drives `Embedded(Config())` as a new
user would and asserts only what the ratios decide (pipeline, who produced
which tokens), never a wall-clock window: the decision compares the missing
KV's WAN time with the budget, and both scale with the same measured step.
"""

from __future__ import annotations

import dataclasses

import pytest

from pddgw.api.server import build_app
from pddgw.config import (Config, ConfigError, EngineConfig, ModelConfig, NetConfig, PolicyConfig, RegimeConfig,
                          ShapingConfig, load_config)
from pddgw.config_build import build
from pddgw.engines.base import create_engine
from pddgw.deploy import regime
from pddgw.deploy.serve import Embedded, with_topology

from .pdd_client import chat

TINY_KV = 2 * 2 * 2 * 16 * 4        # layers x (K, V) x kv heads x head dim x float32
KV_70B = 327_680                     # 320 KiB: 80 layers x (K, V) x 8 kv heads x 128 x bf16


# ---------------------------------------------------------------- derivation


def test_derive_tiny_model_step():
    d = regime.derive(RegimeConfig(), 0.001, TINY_KV)
    # 115 tokens x 512 B per 1 ms step = 58.88 MB/s = 0.47104 Gbps.
    assert d.shaping.gbps == pytest.approx(0.47104, rel=1e-12)
    assert d.link_prior_mbps == pytest.approx(471.04, rel=1e-12)
    assert d.shaping.latency_ms == pytest.approx(0.5, rel=1e-12)       # RTT = 1 step
    assert d.link_prior_rtt_ms == pytest.approx(1.0, rel=1e-12)
    assert d.p_md_max_transfer_ms == pytest.approx(6.7, rel=1e-12)     # 6.7 steps
    assert (d.step_ms, d.kv_bytes_per_token, d.shaping.name) == (1.0, TINY_KV, "wan")
    assert d.shaping.trace == () and d.shaping.jitter_ms == 0.0


def test_derive_gives_back_the_papers_figures_for_the_papers_model():
    # 70B-class KV and a 30 ms step: ~10 Gbps, 30 ms RTT, ~200 ms budget.
    d = regime.derive(RegimeConfig(), 0.030, KV_70B)
    assert d.shaping.gbps == pytest.approx(KV_70B * 115 / 0.030 * 8 / 1e9, rel=1e-12)
    assert round(d.shaping.gbps, 2) == 10.05
    assert d.shaping.latency_ms == pytest.approx(15.0, rel=1e-12)
    assert d.p_md_max_transfer_ms == pytest.approx(201.0, rel=1e-12)
    d100 = regime.derive(RegimeConfig(tokens_per_step=1150.0, rtt_steps=2.0, budget_steps=3.0), 0.030, KV_70B)
    assert d100.shaping.gbps == pytest.approx(10 * d.shaping.gbps, rel=1e-12)
    assert d100.shaping.latency_ms == pytest.approx(30.0, rel=1e-12)
    assert d100.p_md_max_transfer_ms == pytest.approx(90.0, rel=1e-12)


def test_derive_ratios_hold_for_any_step():
    cfg = RegimeConfig()
    for step_s in (0.0004, 0.0013, 0.02):
        d = regime.derive(cfg, step_s, TINY_KV)
        tokens_per_step = d.shaping.gbps * 1e9 / 8 * step_s / TINY_KV
        assert tokens_per_step == pytest.approx(115.0, rel=1e-12)
        assert 2 * d.shaping.latency_ms / d.step_ms == pytest.approx(1.0, rel=1e-12)
        assert d.p_md_max_transfer_ms / d.step_ms == pytest.approx(6.7, rel=1e-12)


def test_derive_keeps_the_wan_entrys_other_fields_and_rejects_nonsense():
    base = ShapingConfig(name="wan", shared=True, seed=9)
    d = regime.derive(RegimeConfig(), 0.002, TINY_KV, base)
    assert (d.shaping.shared, d.shaping.seed) == (True, 9)
    for step in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="decode step"):
            regime.derive(RegimeConfig(), step, TINY_KV)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        regime.derive(RegimeConfig(), 0.001, 0)


def test_apply_replaces_the_wan_and_the_policy_figures_only():
    cfg = Config(net=NetConfig(links=(ShapingConfig(name="fabric", gbps=100.0), ShapingConfig(name="wan"))),
                 policy=PolicyConfig(catchup_threshold=32, catchup_threshold_md_loaded=16))
    d = regime.derive(RegimeConfig(), 0.001, TINY_KV)
    out = d.apply(cfg)
    assert out.net.links == (ShapingConfig(name="fabric", gbps=100.0), d.shaping)
    assert out.net.shaping("wan") == d.shaping
    assert (out.policy.p_md_max_transfer_ms, out.policy.link_prior_mbps, out.policy.link_prior_rtt_ms) == (
        d.p_md_max_transfer_ms, d.link_prior_mbps, d.link_prior_rtt_ms)
    assert dataclasses.replace(out.policy, p_md_max_transfer_ms=cfg.policy.p_md_max_transfer_ms,
                               link_prior_mbps=cfg.policy.link_prior_mbps,
                               link_prior_rtt_ms=cfg.policy.link_prior_rtt_ms) == cfg.policy
    assert (out.engine, out.model, out.nodes, out.net.regime) == (cfg.engine, cfg.model, cfg.nodes, cfg.net.regime)
    # No "wan" entry at all: the derived one is added.
    bare = Config(net=NetConfig(links=()))
    assert d.apply(bare).net.links == (d.shaping,)


# ---------------------------------------------------------------- config


def test_regime_applies_unless_the_wan_is_explicit_or_it_is_off():
    assert regime.regime_applies(Config())
    assert Config().net.shaping("wan") is None           # nothing fixed until the step is known
    for wan in (ShapingConfig(name="wan", gbps=0.004, latency_ms=15.0), ShapingConfig(name="wan", latency_ms=5.0),
                ShapingConfig(name="wan", trace=((0.0, 1.0),))):
        assert not regime.regime_applies(Config(net=NetConfig(links=(wan,))))
    assert regime.regime_applies(Config(net=NetConfig(links=(ShapingConfig(name="other", gbps=1.0),))))
    assert not regime.regime_applies(Config(net=NetConfig(regime=RegimeConfig(enabled=False))))


def test_regime_section_loads_and_errors_name_the_key(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[net.regime]\ntokens_per_step = 1150\nrtt_steps = 2\nstep_ms = 1.5\n")
    r = load_config(p).net.regime
    assert r == RegimeConfig(tokens_per_step=1150.0, rtt_steps=2.0, budget_steps=6.7, step_ms=1.5)
    for bad, msg in [({"tokens_per_step": 0}, "net.regime: tokens_per_step must be > 0"),
                     ({"rtt_steps": -1}, "net.regime: rtt_steps must be >= 0"),
                     ({"budget_steps": -0.5}, "net.regime: budget_steps must be >= 0"),
                     ({"step_ms": -2}, "net.regime: step_ms must be >= 0"),
                     ({"tokens_per_stp": 3}, "net.regime.tokens_per_stp: unknown key"),
                     ({"enabled": "yes"}, "net.regime.enabled: expected bool")]:
        with pytest.raises(ConfigError, match=msg):
            build(Config, {"net": {"regime": bad}})


# ---------------------------------------------------------------- measurement


def test_measure_decode_step_leaves_the_engine_empty():
    cfg = with_topology(Config())
    engine, _ = create_engine(cfg, cfg.engine_for(regime.probe_node(cfg)))
    step_s = regime.measure_decode_step_s(engine)
    assert 0 < step_s < 1.0
    st = engine.stats()
    assert (st.running, st.waiting, st.used_blocks) == (0, 0, 0)
    engine.check_integrity()


def test_probe_runs_on_mds_engine_config():
    cfg = with_topology(Config())
    assert regime.probe_node(cfg).role == "md"
    assert regime.kv_bytes_per_token(cfg) == TINY_KV
    assert regime.kv_bytes_per_token(Config(model=ModelConfig(dtype="float64"))) == 2 * TINY_KV


async def test_cost_model_probe_maps_the_papers_deployment_near_its_own_wan():
    # A 70B on 2 x H100 (modeled) decodes a step in ~30 ms: the derived WAN is
    # then the paper's own, ~10 Gbps and ~30 ms RTT (wide bounds: calibration moves).
    from pddgw.config import CostModelConfig

    cfg = with_topology(Config(model=ModelConfig(profile="llama3-70b"),
                               engine=EngineConfig(implementation="costmodel", num_blocks=0,
                                                   costmodel=CostModelConfig(tensor_parallel=2))))
    step_s = await regime.probe_step_s(cfg)
    assert step_s == await regime.probe_step_s(cfg)      # modeled time: deterministic
    d = regime.derive(cfg.net.regime, step_s, regime.kv_bytes_per_token(cfg))
    assert 5.0 < d.shaping.gbps < 20.0 and 7.5 < d.shaping.latency_ms < 30.0


async def test_resolve_with_a_fixed_step_is_exact_and_explicit_wans_are_untouched():
    cfg = with_topology(Config(net=NetConfig(regime=RegimeConfig(step_ms=2.0))))
    d = regime.derive(cfg.net.regime, 0.002, TINY_KV)
    assert await regime.resolve(cfg) == (d.apply(cfg), d)
    explicit = with_topology(Config(net=NetConfig(links=(ShapingConfig(name="wan", gbps=0.05, latency_ms=20.0),))))
    out, derived = await regime.resolve(explicit)
    assert out is explicit and derived is None


async def test_embedded_with_an_explicit_wan_runs_it_unchanged():
    wan = ShapingConfig(name="wan", gbps=0.05, latency_ms=20.0)
    emb = Embedded(Config(net=NetConfig(links=(wan,))))
    await emb.start()
    try:
        assert emb.wan_regime is None and emb.cfg.net.shaping("wan") == wan
        assert emb.cfg.policy == PolicyConfig()
    finally:
        await emb.stop()


# ---------------------------------------------------------------- a new user's first chat


async def test_first_long_turn_relays_then_hands_off_and_follow_up_goes_straight_to_md(aiohttp_client):
    """`Embedded(Config())`: the WAN derived from the measured step; a new user's first turn.

    1000 uncached prompt tokens are 1000/115 = 8.7 steps of WAN time plus half
    an RTT, over the 6.7-step budget whatever the step: P-RLD-MD, RLD streams
    the first tokens, MD takes over and finishes.  The follow-up misses under
    two MD blocks (< 1 step of WAN time): P-MD.
    """
    emb = Embedded(Config())
    side = await emb.start()
    try:
        d = emb.wan_regime
        assert d is not None and 0 < d.step_ms < 1000 and d.kv_bytes_per_token == TINY_KV
        assert emb.cfg == d.apply(with_topology(Config()))           # what runs is what was derived
        assert emb.cfg.net.shaping("wan") == d.shaping

        client = await aiohttp_client(build_app(side.door))
        ws = await client.ws_connect("/v1/responses")
        p1 = [32 + (i * 7) % 90 for i in range(1000)]
        n = 200
        r = await chat(ws, prompt_token_ids=p1, max_output_tokens=n, temperature=0)
        assert r.final["type"] == "response.completed", r.final
        r.assert_positions_once_in_order()
        tl = r.timeline
        assert (tl["pipeline"], tl["route_reason"]) == ("P-RLD-MD", "transfer_over_budget")
        by_role = tl["tokens_by_role"]
        assert set(by_role) == {"rld", "md"} and by_role["rld"] > 0 and by_role["md"] > 0
        assert by_role["rld"] + by_role["md"] == n == len(r.token_ids)
        assert r.deltas[-1]["pddgw"]["role"] == "md"                     # MD finished it
        assert tl["wan_kv_bytes"] == 1000 * TINY_KV

        await side.router.drain()
        p2 = p1 + r.token_ids + [40 + i % 50 for i in range(30)]
        r2 = await chat(ws, prompt_token_ids=p2, max_output_tokens=20, temperature=0)
        assert (r2.timeline["pipeline"], r2.timeline["tokens_by_role"]) == ("P-MD", {"md": 20})
        await ws.close()
        await side.router.drain()
    finally:
        await emb.stop()
