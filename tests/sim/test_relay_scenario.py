"""A scenario deployment whose prefill group relays what it prefills (`relay = true`, no RLD
group): `pddgw sim` runs it, its requests decode their first tokens on P as RLD, and the
group's keys reach the node's config (`scenario.deployment_config`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pddgw.config import RELAY_MIXED_STEP_TOKENS, ConfigError
from pddgw.sim.run import simulate
from pddgw.sim.scenario import deployment_config, load_scenario

HERE = Path(__file__).parent
RELAY = """
[[deployments]]
name = "relay"
nodes = [ { role = "prefill", tensor_parallel = 1, hardware = "H100-SXM", relay = true, mixed_step_tokens = 128 },
          { role = "md", count = 1, cluster = "B", tensor_parallel = 1, hardware = "H200-SXM" } ]

[[deployments]]
name = "relay-alone"
policy = { pipeline = "P-RLD" }
nodes = [ { role = "prefill", count = 1, tensor_parallel = 1, hardware = "H100-SXM", relay = true },
          { role = "md", count = 1, cluster = "B", tensor_parallel = 1, hardware = "H200-SXM" } ]
"""


def _scenario(tmp_path: Path, deployments: str) -> Path:
    """tiny.toml (its workload, SLOs and links) with `deployments` in place of its own."""
    text = (HERE / "tiny.toml").read_text()
    head = text[:text.index("[[deployments]]")].replace('baseline = "same-dc"\n', "")
    p = tmp_path / "relay.toml"
    p.write_text(head + deployments)
    return p


def test_a_relaying_p_group_simulates_and_relays_what_it_prefills(tmp_path):
    sc = load_scenario(_scenario(tmp_path, RELAY))
    cfg = deployment_config(sc, sc.deployment("relay"))
    assert [(n.name, n.role, n.cluster, n.relay) for n in cfg.nodes] == [
        ("router", "router", "A", False), ("p0", "prefill", "A", True), ("md0", "md", "B", False)]
    assert [cfg.engine_for(n).mixed_step_tokens for n in cfg.nodes[1:]] == [128, 0]
    # Unset on a relaying group: the relay's default cap (`config.RELAY_MIXED_STEP_TOKENS`).
    alone = deployment_config(sc, sc.deployment("relay-alone"))
    assert [alone.engine_for(n).mixed_step_tokens for n in alone.nodes[1:]] == [RELAY_MIXED_STEP_TOKENS, 0]
    rep, _ = simulate(sc)
    deps = rep["variants"][0]["deployments"]
    for d in deps.values():
        assert d["requests"] == 12 and d["failed"] == 0 and d["output_tokens"] == 12 * 24
        assert d["leaked_blocks"] == 0 and d["leaked_pins"] == 0
    # The 1 Gbps WAN: the policy relays most requests on P (their KV still crossing as their
    # answers end) and sends P-MD the follow-ups whose few missing blocks cross in budget.
    auto = deps["relay"]
    assert auto["pipeline_share"] == {"P-MD": 0.1667, "P-RLD-MD": 0.8333}
    assert auto["rld_token_share"] == 0.8333 and auto["rld_full"] == 0
    alone = deps["relay-alone"]
    assert alone["pipeline_share"] == {"P-RLD": 1.0} and alone["rld_token_share"] == 1.0
    assert alone["wan_kv_gb"] == 0.0 and alone["engine_busy"]["md"] == 0.0


def test_relay_is_for_a_prefill_group(tmp_path):
    bad = RELAY.replace('{ role = "md", count = 1,', '{ role = "md", relay = true, count = 1,', 1)
    with pytest.raises(ConfigError) as ei:
        load_scenario(_scenario(tmp_path, bad))
    assert str(ei.value).endswith("deployments[0].nodes[1]: relay = true is for a prefill group (this one is md)")
    assert "\n" not in str(ei.value)
