"""`pddgw plan`'s deployment kinds beyond the three of test_plan.py: cross-DC PD with MD's prefix
cache and no relay (`cross-dc-cached`), and the relay on P, named but not implemented yet."""

import dataclasses
import math
from pathlib import Path

import pytest

from pddgw.config import ConfigError, load_config
from pddgw.sim.plan import main as plan_main
from pddgw.sim.plan_bounds import Demand, Setting, attainment_bound, capacity
from pddgw.sim.plan_space import KINDS, candidates, load_plan
from pddgw.sim.profiles import model
from pddgw.sim.run import Job, goodput_probe
from pddgw.sim.scenario import deployment_config

HERE = Path(__file__).parent
TINY = HERE / "plan_tiny.toml"
LLAMA8B = model("llama3-8b")
TINY_KINDS = 'kinds = ["same-dc", "naive-cross-dc", "pdd"]'


def _write_plan(tmp_path: Path, kinds: str) -> Path:
    """The tiny plan with its `kinds` line replaced (no line: every kind)."""
    text = TINY.read_text()
    assert TINY_KINDS in text
    (tmp_path / "tiny.toml").write_text((HERE / "tiny.toml").read_text())
    p = tmp_path / "plan.toml"
    p.write_text(text.replace(TINY_KINDS, kinds))
    return p


def test_a_plan_compares_four_kinds_unless_it_names_some(tmp_path):
    assert KINDS == ("same-dc", "naive-cross-dc", "cross-dc-cached", "pdd")
    plan = load_plan(_write_plan(tmp_path, ""))
    assert plan.spec.kinds == plan.spec.searched == KINDS
    # The paper's plan lists no kinds: it compares all four.
    assert load_plan(HERE.parents[1] / "scenarios" / "plan_paper.toml").spec.searched == KINDS


def test_cross_dc_cached_candidates_have_no_rld_and_force_p_md():
    plan = load_plan(TINY)
    cands = candidates(plan, LLAMA8B, "cross-dc-cached")
    # P in cluster A, MD in cluster B, no RLD: naive's space, cheapest first.
    assert [c.label() for c in cands] == ["P 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1",
                                          "P 2 x H100-SXM tp1 | MD 1 x H200-SXM tp1",
                                          "P 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1",
                                          "P 2 x H100-SXM tp1 | MD 2 x H200-SXM tp1"]
    assert [c.price for c in cands] == [6.75, 9.75, 10.5, 13.5]
    naive = candidates(plan, LLAMA8B, "naive-cross-dc")
    for c, n in zip(cands, naive):
        assert [(g.role, g.cluster) for g in c.groups] == [("prefill", "A"), ("md", "B")]
        assert c.group("rld") is None
        # What differs from naive: MD keeps its prefix cache.
        assert c.group("md").prefix_cache and not n.group("md").prefix_cache
        assert c.groups == tuple(dataclasses.replace(g, prefix_cache=True) for g in n.groups)
        pol = c.policy(plan.spec)
        assert (pol.pipeline, pol.prefix_affinity) == ("P-MD", True)
        cfg = deployment_config(plan.scenario, c.deployment(plan.spec), plan.wan_gbps)
        assert {n.role for n in cfg.nodes} == {"router", "prefill", "md"}
        assert all(cfg.engine_for(n).enable_prefix_caching for n in cfg.nodes if n.role == "md")
        assert cfg.policy.pipeline == "P-MD" and cfg.net.shaping("wan").gbps == 10.0


def test_cross_dc_cached_routes_every_request_p_md_and_sends_only_what_md_lacks():
    """A probe at 2 req/s on the split with two MD: every request goes P-MD, and each follow-up
    turn finds its previous turn's KV on the MD that served it (prefix affinity) and hits exactly
    the workload's kept share, in whole blocks; naive's MD hits nothing."""
    plan = load_plan(TINY)
    block = plan.scenario.block_size
    cached = next(c for c in candidates(plan, LLAMA8B, "cross-dc-cached")
                  if c.label() == "P 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1")
    naive = next(c for c in candidates(plan, LLAMA8B, "naive-cross-dc") if c.label() == cached.label())
    runs = {}
    for cand in (cached, naive):
        sc = dataclasses.replace(plan.scenario, deployments=(cand.deployment(plan.spec, "x"),), baseline="x")
        _, runs[cand.kind] = goodput_probe(sc, Job("goodput", "x", plan.wan_gbps), 2.0)
    for run in runs.values():
        assert run.requests and {r.pipeline for r in run.requests} == {"P-MD"}
    reqs = runs["cross-dc-cached"].requests
    follow = [r for r in reqs if r.turn > 0]
    assert follow and all(r.error is None for r in follow)
    for r in follow:
        assert r.md_cached_tokens == math.floor(r.target_hit * r.prompt_tokens) // block * block > 0
    assert all(r.md_cached_tokens == 0 for r in reqs if r.turn == 0)
    assert all(r.md_cached_tokens == 0 for r in runs["naive-cross-dc"].requests)


def test_the_roofline_sends_cross_dc_cached_only_the_uncached_kv():
    """As test_plan.py's naive bound by hand: four requests of 4,096 prompt tokens, 1,000 uncached,
    in the window [0, 1 s) with a 0.1 s TTFT.  Naive's WAN carries 1.1 s x 1.25 GB/s = 1.375 GB
    before the deadlines, two whole prompts (537 MB each); cross-DC cached sends 131 MB each:
    all four.  In the steady state 1.25e9 / (1,000 x 131,072) = 9.54 req/s, no relay side."""
    plan = load_plan(TINY)
    plan = dataclasses.replace(plan, scenario=dataclasses.replace(
        plan.scenario, slo=dataclasses.replace(plan.scenario.slo, ttft_s=0.1)))
    times = (0.0, 0.25, 0.5, 0.75)
    d = Demand(uncached=(1000,) * 4, prompt=(4096,) * 4, output=(2,) * 4, earliest=times, latest=times,
               start_s=0.0, end_s=1.0)
    cached = candidates(plan, LLAMA8B, "cross-dc-cached")[0]
    naive = candidates(plan, LLAMA8B, "naive-cross-dc")[0]
    assert attainment_bound(Setting.of(plan, cached), LLAMA8B, cached, d) == 1.0
    assert attainment_bound(Setting.of(plan, naive), LLAMA8B, naive, d) == 0.5
    wan = capacity(Setting.of(plan, cached), LLAMA8B, cached, d).sides["wan"]
    assert wan == pytest.approx(1.25e9 / (1000 * 131_072), rel=1e-12)


def test_the_report_has_a_cross_dc_cached_table_and_writes_its_winner(tmp_path, capsys):
    p = _write_plan(tmp_path, 'kinds = ["naive-cross-dc", "cross-dc-cached"]')
    out = tmp_path / "out"
    assert plan_main(["--plan", str(p), "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = {kind: next(i for i, line in enumerate(lines) if line.startswith(f"== {kind}: "))
          for kind in ("naive-cross-dc", "cross-dc-cached")}
    head = lines[at["cross-dc-cached"]]
    assert head.startswith("== cross-dc-cached: 4 candidates, ")
    # The same columns as every kind's table; a row per evaluated candidate (in the table or
    # below it), P and MD, no RLD.
    assert lines[at["cross-dc-cached"] + 1] == lines[at["naive-cross-dc"] + 1]
    section = lines[at["cross-dc-cached"]:]
    rows = [line for line in section[:section.index("")] if " x H200-SXM tp1 " in line]
    assert rows and f"== cross-dc-cached: 4 candidates, {len(rows)} evaluated " in head
    assert all(" | MD " in row and "RLD" not in row for row in rows)
    cfg = load_config(out / "cross-dc-cached.config.toml")
    assert cfg.policy.pipeline == "P-MD" and {n.role for n in cfg.nodes} == {"router", "prefill", "md"}
    assert all(cfg.engine_for(n).enable_prefix_caching for n in cfg.nodes if n.role == "md")
    assert "name = \"cross-dc-cached\"" in (out / "deployments.toml").read_text()


def test_the_relay_on_p_is_named_and_refused_in_one_line(tmp_path, capsys):
    p = _write_plan(tmp_path, 'kinds = ["pdd", "pdd-relay-on-p"]')
    with pytest.raises(ConfigError, match=r": kinds: kind 'pdd-relay-on-p' is not implemented yet \(the planner "
                                          r"compares same-dc, naive-cross-dc, cross-dc-cached, pdd\)$"):
        load_plan(p)
    assert plan_main(["--plan", str(p), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "kind 'pdd-relay-on-p' is not implemented yet" in err and err.count("\n") == 1
    # From the command line too.
    assert plan_main(["--plan", str(TINY), "--kinds", "pdd-relay-on-p"]) == 2
    err = capsys.readouterr().err
    assert err == ("pddgw plan: error: kinds: kind 'pdd-relay-on-p' is not implemented yet (the planner compares "
                   "same-dc, naive-cross-dc, cross-dc-cached, pdd)\n")
    # Not a kind at all: the decoder's one line.
    with pytest.raises(ConfigError, match=r"kinds\[0\]: 'pdd-relay' is not one of"):
        load_plan(_write_plan(tmp_path, 'kinds = ["pdd-relay"]'))
