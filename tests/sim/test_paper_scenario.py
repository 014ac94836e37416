"""scenarios/paper.toml on the seed's model: DeepSeek-V4-Pro, the planner's splits and their prices,
instances that fit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pddgw.sim import profiles
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import run_deployment
from pddgw.sim.run import _jobs, _longest_first, simulate
from pddgw.sim.scenario import deployment_config, deployment_price, load_scenario
from pddgw.sim.workload import agentic, shared_prefix

ROOT = Path(__file__).parent.parent.parent
PAPER = ROOT / "scenarios" / "paper.toml"


def test_the_paper_scenario_runs_the_paper_model_on_the_planners_splits():
    sc = load_scenario(PAPER)
    assert (sc.name, sc.model, sc.wan_gbps) == ("paper", "deepseek-v4-pro", (10.0, 100.0))
    wl = sc.workload.agentic
    assert (wl.context_tokens, wl.output_tokens, wl.hit_buckets) == (65536, 1024, ((0.78, 0.95, 1.0),
                                                                                   (0.22, 0.75, 0.95)))
    wan = next(s for s in sc.links if s.name == "wan")
    assert wan.latency_ms * 2 == 30.0 and wan.shared
    a, b = (profiles.price(h) for h in ("H100-SXM", "H200-SXM"))
    assert 1.2 <= b / a <= 1.3
    # Each kind's split is `pddgw plan --plan scenarios/plan_paper.toml`'s winner (the comment in
    # paper.toml, docs/results/planner.md): same-DC 72 H100 (216 USD/h), naive 24 H100 + 16 H200
    # (72 + 60 = 132), PDD 64 H100 + 16 H200 (192 + 60 = 252), all within 88 H100 + 32 H200.
    by_hw: dict[str, dict[str, int]] = {}
    for d in sc.deployments:
        for g in d.nodes:
            by_hw.setdefault(d.name, {}).setdefault(g.hardware, 0)
            by_hw[d.name][g.hardware] += g.gpus
    assert by_hw == {"same-dc-pd": {"H100-SXM": 72}, "naive-cross-dc": {"H100-SXM": 24, "H200-SXM": 16},
                     "pdd": {"H100-SXM": 64, "H200-SXM": 16}}
    prices = {d.name: deployment_price(sc, d)[0] for d in sc.deployments}
    assert prices == {"same-dc-pd": pytest.approx(216.0), "naive-cross-dc": pytest.approx(132.0),
                      "pdd": pytest.approx(252.0)}
    # Every instance holds V4-Pro's 846.8 GB of weights with room for KV (check_fit passes).
    for d in sc.deployments:
        cfg = deployment_config(sc, d, 10.0)
        assert len(cfg.nodes) == 1 + sum(g.count for g in d.nodes)


def test_the_report_carries_the_model_name_and_the_kv_of_80_requests_of_64k(tmp_path):
    # tiny.toml's Llama-3-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 131,072 B per
    # token; 80 x 65,536 tokens of it = 687.19 GB.
    sc = load_scenario(Path(__file__).parent / "tiny.toml")
    sc = dataclasses.replace(sc, workload=dataclasses.replace(
        sc.workload, agentic=dataclasses.replace(sc.workload.agentic, requests=2)))
    rep, _ = simulate(sc, jobs=1)
    assert (rep["model"], rep["model_name"], rep["kv_gb_80x64k"]) == ("llama3-8b", "llama3-8b", 687.195)
    # V4-Pro: 61 layers x 128-token windows of 584 B (4,559,872 B) + 30 CSA layers x 16,384
    # entries x (584 + 132) B + 31 HCA layers x 512 entries x 584 B = 365,757,440 B per 64K request.
    v4 = profiles.model("deepseek-v4-pro")
    assert v4.kv_bytes(65536) == 61 * 128 * 584 + 30 * 16384 * 716 + 31 * 512 * 584 == 365_757_440
    assert round(80 * v4.kv_bytes(65536) / 1e9, 3) == 29.261


def test_the_paper_deployments_serve_v4_pro_on_the_virtual_clock():
    # The paper's PDD deployment, short prompts so that the test stays small.
    sc = load_scenario(PAPER)
    spec = dataclasses.replace(sc.workload.agentic, requests=4, context_tokens=4096, output_tokens=6,
                               shared_prefix_tokens=1024, turns_min=2, turns_max=2, rate=2.0)
    cfg = deployment_config(sc, sc.deployment("pdd"), 10.0)
    convs = agentic(spec, sc.seed)
    run = run_virtual(run_deployment(cfg, convs, shared_prefix(1024, sc.seed)))
    assert len(run.requests) == 4 and all(r.error is None and r.output_tokens == 6 for r in run.requests)
    assert run.leaked_blocks == 0 and run.leaked_pins == 0 and run.wan_kv_bytes > 0


def test_the_workers_take_the_longest_goodput_searches_first():
    # Each search's length follows the rate the roofline lets it carry (its probes simulate about
    # that many requests per second), then its nodes: same-DC and PDD (both WANs) are bound by
    # their decode (23.46 and 23.36 req/s; their two P carry ~26 with the FP4 experts W4A16 on
    # Hopper at the MoE prefill efficiency), then naive at 100 Gbps (its one P: 13.05), naive at
    # 10 Gbps (its WAN: 3.46) last, then the single runs.
    sc = load_scenario(PAPER)
    order = sorted(_jobs(sc), key=lambda j: _longest_first(sc, j))
    assert [j.label for j in order[:6]] == [
        "goodput same-dc-pd", "goodput pdd @ 10 Gbps", "goodput pdd @ 100 Gbps",
        "goodput naive-cross-dc @ 100 Gbps", "goodput naive-cross-dc @ 10 Gbps", "main same-dc-pd"]
    assert [round(-_longest_first(sc, j)[1], 2) for j in order[:5]] == [23.46, 23.36, 23.36, 13.05, 3.46]
