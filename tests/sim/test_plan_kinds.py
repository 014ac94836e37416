"""`pddgw plan`'s deployment kinds beyond the three of test_plan.py: cross-DC PD with MD's prefix
cache and no relay (`cross-dc-cached`), and PDD with P relaying what it prefills, no RLD
instance (`pdd-relay-on-p`)."""

import dataclasses
import math
from pathlib import Path

import pytest

from pddgw.config import ConfigError, PolicyConfig, load_config
from pddgw.sim import plan_search
from pddgw.sim.plan import main as plan_main
from pddgw.sim.plan import write_outputs
from pddgw.sim.plan_bounds import Demand, Setting, attainment_bound, capacity, demand, deployment_bound, met_bound
from pddgw.sim.plan_space import KINDS, candidates, load_plan
from pddgw.sim.plan_write import serve_config
from pddgw.sim.profiles import model
from pddgw.sim.run import Job, goodput_probe
from pddgw.sim.scenario import deployment_config, load_scenario

HERE = Path(__file__).parent
TINY = HERE / "plan_tiny.toml"
LLAMA8B = model("llama3-8b")
TINY_KINDS = 'kinds = ["same-dc", "naive-cross-dc", "pdd"]'
# P's engines cap a decoding step's prefill tokens: a relaying P's relayed requests wait less.
MIXED = ("[roles.prefill]\ncount_max = 2\n", "[roles.prefill]\ncount_max = 2\nmixed_step_tokens = 128\n")
RELAY_LABELS = ["P+RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1", "P+RLD 2 x H100-SXM tp1 | MD 1 x H200-SXM tp1",
                "P+RLD 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1", "P+RLD 2 x H100-SXM tp1 | MD 2 x H200-SXM tp1"]


def _write_plan(tmp_path: Path, kinds: str, *replace: tuple[str, str]) -> Path:
    """The tiny plan with its `kinds` line replaced (no line: every kind), and each (old, new) of `replace`."""
    text = TINY.read_text()
    assert TINY_KINDS in text
    for old, new in replace:
        assert old in text
        text = text.replace(old, new)
    (tmp_path / "tiny.toml").write_text((HERE / "tiny.toml").read_text())
    p = tmp_path / "plan.toml"
    p.write_text(text.replace(TINY_KINDS, kinds))
    return p


def test_a_plan_compares_five_kinds_unless_it_names_some(tmp_path):
    assert KINDS == ("same-dc", "naive-cross-dc", "cross-dc-cached", "pdd", "pdd-relay-on-p")
    plan = load_plan(_write_plan(tmp_path, ""))
    assert plan.spec.kinds == plan.spec.searched == KINDS
    # The paper's plan lists no kinds: it compares all five.
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


def test_the_relay_on_p_is_searched(tmp_path, capsys):
    p = _write_plan(tmp_path, 'kinds = ["pdd", "pdd-relay-on-p"]')
    assert load_plan(p).spec.searched == ("pdd", "pdd-relay-on-p")
    assert plan_main(["--plan", str(p), "--dry-run"]) == 0
    heads = [line for line in capsys.readouterr().out.splitlines() if line.startswith("== ")]
    assert heads == ["== pdd: 4 candidates ==", "== pdd-relay-on-p: 4 candidates =="]
    # From the command line too.
    assert plan_main(["--plan", str(TINY), "--kinds", "pdd-relay-on-p", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("== ")] == ["== pdd-relay-on-p: 4 candidates =="]
    assert sorted(line.split("  ")[0] for line in lines if line.startswith("P+RLD ")) == sorted(RELAY_LABELS)
    # Not a kind at all: the decoder's one line.
    with pytest.raises(ConfigError, match=r"kinds\[0\]: 'pdd-relay' is not one of"):
        load_plan(_write_plan(tmp_path, 'kinds = ["pdd-relay"]'))


def test_relay_on_p_candidates_relay_on_p_and_let_the_policy_decide(tmp_path):
    plan = load_plan(_write_plan(tmp_path, TINY_KINDS, MIXED))
    cands = candidates(plan, LLAMA8B, "pdd-relay-on-p")
    # Cross-DC cached's split (P in A, MD in B with its prefix cache), each P relaying.
    assert [c.label() for c in cands] == RELAY_LABELS
    assert [c.price for c in cands] == [6.75, 9.75, 10.5, 13.5]
    for c, x in zip(cands, candidates(plan, LLAMA8B, "cross-dc-cached")):
        p, md = c.groups
        assert (p.role, p.cluster, p.relay, p.mixed_step_tokens) == ("prefill", "A", True, 128)
        assert (md.role, md.cluster, md.relay, md.prefix_cache) == ("md", "B", False, True)
        assert c.groups == (dataclasses.replace(x.groups[0], relay=True), x.groups[1])
        assert c.policy(plan.spec) == PolicyConfig()             # the router's policy decides
        cfg = deployment_config(plan.scenario, c.deployment(plan.spec), plan.wan_gbps)
        assert [(n.role, n.cluster, n.relay) for n in cfg.nodes] == (
            [("router", "A", False)] + [("prefill", "A", True)] * p.count + [("md", "B", False)] * md.count)
        assert [cfg.engine_for(n).mixed_step_tokens for n in cfg.nodes[1:]] == [128] * p.count + [0] * md.count
        assert cfg.policy.pipeline == "auto" and cfg.net.shaping("wan").gbps == 10.0


def test_the_roofline_reads_a_relaying_p_as_p_and_as_an_rld():
    """No new physics: a relaying P's prefill side is P's (its relays' decodes are a small share
    of its steps), its decode capacity, pool and relay slots an RLD's of its shape.  On the tiny
    plan the one-P relay split bounds exactly as PDD's split of the same P, an RLD like it and
    the same MD, at every rate."""
    plan = load_plan(TINY)
    relay = candidates(plan, LLAMA8B, "pdd-relay-on-p")[0]
    pdd = candidates(plan, LLAMA8B, "pdd")[0]
    assert pdd.label() == "P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1"
    for rate in (1.0, 4.0, 16.0):
        d = demand(plan.scenario, rate)
        at_relay, at_pdd = Setting.of(plan, relay), Setting.of(plan, pdd)
        assert capacity(at_relay, LLAMA8B, relay, d).sides == capacity(at_pdd, LLAMA8B, pdd, d).sides
        assert met_bound(at_relay, LLAMA8B, relay, d) == met_bound(at_pdd, LLAMA8B, pdd, d)
    # A scenario's relay deployment is bounded as the kind when its policy decides, else not at all.
    dep = relay.deployment(plan.spec)
    assert deployment_bound(plan.scenario, dep, 10.0) == relay
    for pipeline in ("P-RLD", "P-RLD-MD", "P-MD"):
        forced = dataclasses.replace(dep, policy=dataclasses.replace(dep.policy, pipeline=pipeline))
        assert deployment_bound(plan.scenario, forced, 10.0) is None


@pytest.fixture(scope="module")
def relay_searched(tmp_path_factory):
    """Brute force and the pruned search of PDD and the relay on P (a 128-token mixed step, not
    the relay's default 256)."""
    plan = load_plan(_write_plan(tmp_path_factory.mktemp("relay"), 'kinds = ["pdd", "pdd-relay-on-p"]', MIXED))
    return plan, plan_search.search(plan, exhaustive=True), plan_search.search(plan)


def test_the_relay_on_p_search_finds_the_brute_force_optimum_within_its_bounds(relay_searched):
    plan, brute, pruned = relay_searched
    b, p = brute["pdd-relay-on-p"], pruned["pdd-relay-on-p"]
    assert b.evaluated == 4 and b.bounded_out == 0 and b.pruned_probes == 0
    assert [(e.candidate, e.goodput_rps) for e in p.ranked] == [(e.candidate, e.goodput_rps) for e in b.ranked]
    # Two relaying P pass sqrt(128) = 11.3 req/s offered (47 of 50 window arrivals in SLO), one
    # P sqrt(32) (24 of 25).
    assert [(e.candidate.label(), e.goodput_rps, round(e.offered_rps, 4)) for e in p.ranked] == [
        ("P+RLD 2 x H100-SXM tp1 | MD 1 x H200-SXM tp1", 11.75, 11.3137),
        ("P+RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1", 6.0, 5.6569)]
    # The bounds hold: no goodput above its bound, no probe meeting more than the roofline allows.
    for r in brute.values():
        for e in r.all_evaluations:
            assert e.upper_rps >= e.goodput_rps
            for probe in e.probes:
                assert probe.decided or probe.window.met <= met_bound(
                    Setting.of(plan, e.candidate), LLAMA8B, e.candidate, demand(plan.scenario, probe.rate))
    # One GPU fewer than PDD's best split (11.5 req/s for $12.75/h): the relay wins the plan.
    assert pruned["pdd"].winner.goodput_rps == 11.5
    assert plan_search.winner(pruned).candidate == plan_search.winner(brute).candidate == p.winner.candidate


def test_the_relay_on_p_winner_is_written_with_its_relay_nodes(relay_searched, tmp_path):
    plan, _, pruned = relay_searched
    win = pruned["pdd-relay-on-p"].winner.candidate
    paths = write_outputs(plan, pruned, tmp_path)
    assert [x.name for x in paths] == ["config.toml", "pdd.config.toml", "pdd-relay-on-p.config.toml",
                                       "deployments.toml"]
    cfg = load_config(tmp_path / "pdd-relay-on-p.config.toml")
    assert cfg == serve_config(plan, win) == load_config(tmp_path / "config.toml")
    assert [(n.name, n.role, n.cluster, n.relay, n.port) for n in cfg.nodes] == [
        ("router", "router", "A", False, 0), ("p0", "prefill", "A", True, 9101), ("p1", "prefill", "A", True, 9102),
        ("md0", "md", "B", False, 9103)]
    assert [cfg.engine_for(n).mixed_step_tokens for n in cfg.nodes[1:]] == [128, 128, 0]
    assert cfg.policy.pipeline == "auto"
    text = (tmp_path / "pdd-relay-on-p.config.toml").read_text()
    assert text.count("\nrelay = true\n") == 2
    # The scenario blocks read back as the winner's groups.
    (tmp_path / "tiny.toml").write_text((HERE / "tiny.toml").read_text())
    sc = (HERE / "tiny.toml").read_text()
    (tmp_path / "sc.toml").write_text(sc[:sc.index("[[deployments]]")].replace('baseline = "same-dc"\n', "")
                                      + (tmp_path / "deployments.toml").read_text())
    assert load_scenario(tmp_path / "sc.toml").deployment("pdd-relay-on-p").nodes == win.groups
