"""`pddgw plan`: the space, the roofline's bounds, the pruned search against brute force, the files it writes."""

import dataclasses
import math
from pathlib import Path

import orjson
import pytest

from pddgw import cli
from pddgw.config import ConfigError, load_config
from pddgw.sim import plan_search, report
from pddgw.sim.plan import main as plan_main
from pddgw.sim.plan import write_outputs
from pddgw.sim.plan_bounds import (Demand, Setting, _fit, _kv_tokens, attainment_bound, capacity, decode_step_s,
                                   decode_tokens_per_s, demand, met_bound, prefill_tokens_per_s, slo_rps_bound)
from pddgw.sim.report import bisection_rates
from pddgw.sim.plan_space import candidates, load_plan
from pddgw.sim.plan_write import config_toml, serve_config
from pddgw.sim.profiles import model
from pddgw.sim.probe import probe_workload
from pddgw.sim.run import Job, goodput_probe
from pddgw.sim.scenario import NodeGroup, load_scenario

HERE = Path(__file__).parent
TINY = HERE / "plan_tiny.toml"
LLAMA8B = model("llama3-8b")


def _plan_text(**replace: str) -> str:
    text = TINY.read_text()
    for old, new in replace.items():
        assert old in text
        text = text.replace(old, new)
    return text


def _write_plan(tmp_path: Path, text: str) -> Path:
    (tmp_path / "tiny.toml").write_text((HERE / "tiny.toml").read_text())
    p = tmp_path / "plan.toml"
    p.write_text(text)
    return p


# ---- the space --------------------------------------------------------------------------------------

def test_the_tiny_space_has_four_candidates_per_kind_cheapest_first():
    plan = load_plan(TINY)
    assert plan.wan_gbps == 10.0 and plan.slo.ttft_s == 1.5 and plan.goodput.probes == 5
    # The plan's workload replaces the scenario's; links and model stay the scenario's.
    assert plan.scenario.workload.agentic.context_tokens == 4096 and plan.scenario.model == "llama3-8b"
    labels = [c.label() for c in candidates(plan, LLAMA8B, "pdd")]
    assert labels == ["P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1",
                      "P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1",
                      "P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1",
                      "P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1"]
    # 3 + 3.75 x 1 ... : prices per hour from the menu.
    assert [c.price for c in candidates(plan, LLAMA8B, "pdd")] == [9.75, 12.75, 13.5, 16.5]
    naive = candidates(plan, LLAMA8B, "naive-cross-dc")
    assert all(not c.group("md").prefix_cache for c in naive)
    assert all(c.policy(plan.spec).pipeline == "P-MD" for c in naive)


def test_budgets_cut_the_space(tmp_path):
    # Cluster A holds 3 GPUs: same-DC 2 P + 2 MD (4 GPUs) is out; a $12/h total cuts PDD to two.
    p = _write_plan(tmp_path, _plan_text(**{'gpus = 4': 'gpus = 3', 'wan_gbps = 10.0': 'wan_gbps = 10.0\n'
                                                                                       'usd_per_hour = 13.0'}))
    plan = load_plan(p)
    assert len(candidates(plan, LLAMA8B, "same-dc")) == 3
    assert [c.price for c in candidates(plan, LLAMA8B, "pdd")] == [9.75, 12.75]


def test_a_too_small_budget_is_a_clear_error(tmp_path, capsys):
    p = _write_plan(tmp_path, _plan_text(**{'gpus = 4': 'gpus = 1'}))
    with pytest.raises(ConfigError) as ei:
        candidates(load_plan(p), LLAMA8B, "same-dc")
    assert str(ei.value) == ("plan: no same-dc deployment fits the budget: the smallest, P 1 x H100-SXM tp1 | "
                             "MD 1 x H100-SXM tp1, needs 2 GPUs / $6.00/h in cluster A ($6.00/h in all); the "
                             "budget allows cluster A: 1 GPUs, any $/h")
    # The command line says it in one line, before simulating anything.
    assert plan_main(["--plan", str(p)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pddgw plan: error: plan: no same-dc deployment fits the budget") and err.count("\n") == 1


def test_a_model_no_shape_holds_is_a_clear_error(tmp_path):
    p = _write_plan(tmp_path, _plan_text(**{'wan_gbps = 10.0': 'wan_gbps = 10.0\nmodel = "deepseek-v4-pro"'}))
    with pytest.raises(ConfigError, match=r"^plan: same-dc: deepseek-v4-pro \(846\.8 GB of weights\) fits no "
                                          r"prefill shape of cluster A \(1 x H100-SXM tp1\): roles\.prefill\.shapes "
                                          r"needs more GPUs per instance$"):
        candidates(load_plan(p), model("deepseek-v4-pro"), "same-dc")


@pytest.mark.parametrize("old,new,message", [
    ("count_max = 2\n[roles.rld]", "count_maxx = 2\n[roles.rld]", "roles.prefill.count_maxx: unknown key"),
    ("[search]\ntop = 2", "[search]\ntop = 0", "search: top must be >= 1"),
    ('name = "B"', 'name = "C"', "clusters: no cluster named 'B'"),
    ('hardware = "H200-SXM"', 'hardware = "B300"', "hardware 'B300' is not one of"),
])
def test_bad_plan_keys_are_refused_with_the_key_named(tmp_path, old, new, message):
    with pytest.raises(ConfigError, match=message):
        load_plan(_write_plan(tmp_path, _plan_text(**{old: new})))


# ---- the roofline's bounds ----------------------------------------------------------------------------

def test_prefill_and_decode_capacity_are_the_step_roofline_by_hand():
    h100 = NodeGroup(role="md", tensor_parallel=1, hardware="H100-SXM")
    # Llama-3-8B: 7,504,924,672 active parameters (8,030,261,248 less the 128,256 x 4,096
    # embedding), 32 layers x 4 x 32 heads x 128 = 524,288 attention FLOPs per (query, key)
    # pair.  A step of 8,192 tokens as 4,096 two-token prompts (3 pairs each): compute-bound at
    # 989.5 TFLOP/s x 0.40 = 3.958e14 FLOP/s, plus the 2 ms step overhead.
    flops = 8192 * 2 * 7_504_924_672 + 4096 * 3 * 524_288
    assert prefill_tokens_per_s(LLAMA8B, h100) == pytest.approx(8192 / (flops / 3.958e14 + 0.002), rel=1e-12)
    # A decode at 4,096 tokens of context: 16,060,522,496 weight bytes + 4,097 x 131,072 KV bytes
    # at 3.35 TB/s x 0.8, plus 2 ms.
    assert decode_step_s(LLAMA8B, h100, 1, 4096) == pytest.approx(
        (16_060_522_496 + 4097 * 131_072) / 2.68e12 + 0.002, rel=1e-12)
    # The pool: (80 GB x 0.9 - the weights) // 131,072 = 426,784 tokens; 426,784 // 4,097 = 104
    # sequences decode at once.
    assert _kv_tokens(LLAMA8B, h100) == 426_784
    assert decode_tokens_per_s(LLAMA8B, h100, 4096) == pytest.approx(
        104 / ((16_060_522_496 + 104 * 4097 * 131_072) / 2.68e12 + 0.002), rel=1e-12)


def test_the_smallest_requests_fit_first():
    assert _fit(10.0, [4.0, 3.0, 5.0]) == 2          # 3 + 4 = 7 fits, + 5 = 12 does not
    assert _fit(12.0, [4.0, 3.0, 5.0]) == 3
    assert _fit(2.0, [4.0, 3.0]) == 0


def test_the_attainment_bound_by_hand():
    plan = load_plan(TINY)
    cand = candidates(plan, LLAMA8B, "naive-cross-dc")[0]        # P 1 x H100 | MD 1 x H200, no MD cache
    at = Setting.of(plan, cand)
    # Four requests of 4,096 prompt tokens, 1,000 of them uncached, 2 output tokens, all arriving
    # in the window [0, 1 s).  Naive P-MD: each prompt's whole KV (4,096 x 131,072 B = 537 MB)
    # reaches MD before its first token, within window + TTFT = 1 + 1.5 s: 10 Gbps carries
    # 1.25e9 x 2.5 = 3.125 GB, all four (2.15 GB).  At 1 s + 0.1 s TTFT only 1.375 GB: two.
    times = (0.0, 0.25, 0.5, 0.75)
    d = Demand(uncached=(1000,) * 4, prompt=(4096,) * 4, output=(2,) * 4, earliest=times, latest=times,
               start_s=0.0, end_s=1.0)
    assert attainment_bound(at, LLAMA8B, cand, d) == 1.0
    tight = dataclasses.replace(at, scenario=dataclasses.replace(
        at.scenario, slo=dataclasses.replace(at.scenario.slo, ttft_s=0.1)))
    assert attainment_bound(tight, LLAMA8B, cand, d) == 0.5
    # In the steady state the WAN carries 1.25e9 / 536,870,912 = 2.33 requests/s of it.
    assert capacity(at, LLAMA8B, cand, d).sides["wan"] == pytest.approx(1.25e9 / (4096 * 131_072), rel=1e-12)
    assert capacity(at, LLAMA8B, cand, d).side == "wan"


def test_the_attainment_bound_counts_the_window_only():
    plan = load_plan(TINY)
    cand = candidates(plan, LLAMA8B, "naive-cross-dc")[0]
    at = Setting.of(plan, cand)
    # The window [1.0, 1.5): request 0 arrived before it, request 4 after; 1 and 2 arrive in it
    # whenever they can; 3 may (between 1.3 and 1.7 s).  So 3 may meet their SLOs and 2 surely count.
    d = Demand(uncached=(1000,) * 5, prompt=(4096,) * 5, output=(2,) * 5, earliest=(0.2, 1.0, 1.2, 1.3, 1.6),
               latest=(0.2, 1.1, 1.4, 1.7, 1.6), start_s=1.0, end_s=1.5)
    assert (d.maybe, d.surely, d.seconds) == ((1, 2, 3), 2, 0.5)
    # Within window + TTFT = 0.5 + 1.5 s the WAN carries 2.5 GB: the three that may (1.61 GB),
    # met 3 of at least 2 arrivals bounds nothing; 3 in SLO over the 0.5 s window: 6 req/s.
    assert (met_bound(at, LLAMA8B, cand, d), attainment_bound(at, LLAMA8B, cand, d)) == (3, 1.0)
    assert slo_rps_bound(at, LLAMA8B, cand, d) == 6.0
    # TTFT 0.1 s: 0.6 s x 1.25 GB/s = 0.75 GB, one prompt's KV: at most 1 of the 2 sure arrivals.
    tight = dataclasses.replace(at, scenario=dataclasses.replace(
        at.scenario, slo=dataclasses.replace(at.scenario.slo, ttft_s=0.1)))
    assert (met_bound(tight, LLAMA8B, cand, d), attainment_bound(tight, LLAMA8B, cand, d)) == (1, 0.5)
    assert slo_rps_bound(tight, LLAMA8B, cand, d) == 2.0
    with pytest.raises(ValueError, match="one entry per request"):
        dataclasses.replace(d, latest=(0.2,))
    with pytest.raises(ValueError, match=r"empty window \[1.0, 1.0\)"):
        dataclasses.replace(d, end_s=1.0)


def test_the_demand_of_a_conversation_by_hand():
    plan = load_plan(TINY)
    spec = dataclasses.replace(plan.scenario.workload.agentic, context_tokens=1000, output_tokens=11,
                               shared_prefix_tokens=200, turns_min=2, turns_max=2, think_s_min=1.0,
                               think_s_max=1.0, hit_buckets=((1.0, 0.5, 0.5),))
    sc = dataclasses.replace(plan.scenario, workload=dataclasses.replace(plan.scenario.workload, agentic=spec),
                             goodput=dataclasses.replace(plan.goodput, warmup_s=1.0, seconds=3.0))
    # At 0.01 req/s (a conversation per 200 s) only the first starts within the 4 s horizon, at 0.
    assert [(c.start_s, len(c.turns)) for c in probe_workload(sc, 0.01).conversations] == [(0.0, 2)]
    d = demand(sc, 0.01)
    # Turn 0 keeps the 200 shared tokens; turn 1 keeps half of turn 0 (500 tokens).
    assert d.uncached == (800, 500) and d.prompt == (1000, 1000) and d.output == (11, 11)
    # Turn 1 arrives after 1 s of thinking at the earliest, and at the latest after turn 0's
    # SLO budget too (1.5 s TTFT + 10 x 50 ms): in [1, 4) s, the window after the 1 s warm-up.
    assert d.earliest == (0.0, 1.0) and d.latest == pytest.approx((0.0, 1.5 + 10 * 0.05 + 1.0), rel=1e-12)
    assert (d.start_s, d.end_s, d.maybe, d.surely) == (1.0, 4.0, (1,), 1)
    # P's cache keeps turn 0's prompt through its answer and turn 1's think time.
    assert d.think_next == (1.0, 0.0)


def test_the_p_cache_side_is_ps_pools_over_the_prompts_kept_until_the_next_turn():
    """capacity's p_kv estimate: P's KV tokens over each prompt x (its answer at the fastest
    decode step + the think time before its conversation's next turn)."""
    plan = load_plan(TINY)
    cand = candidates(plan, LLAMA8B, "same-dc")[0]          # P 1 x H100 | MD 1 x H100
    at = Setting.of(plan, cand)
    (p,) = [g for g in cand.groups if g.role == "prefill"]
    (md,) = [g for g in cand.groups if g.role == "md"]
    d = Demand(uncached=(1000, 500), prompt=(4096, 4096), output=(11, 11), earliest=(0.0, 1.0),
               latest=(0.0, 1.0), start_s=0.0, end_s=2.0, think_next=(2.0, 0.0))
    step = decode_step_s(LLAMA8B, md, 1, 4096)
    held = (4096 * (10 * step + 2.0) + 4096 * (10 * step + 0.0)) / 2
    assert capacity(at, LLAMA8B, cand, d).sides["p_kv"] == pytest.approx(_kv_tokens(LLAMA8B, p) / held, rel=1e-12)
    # A trace's requests have no next turn to keep a prompt for: no such side.
    assert "p_kv" not in capacity(at, LLAMA8B, cand, dataclasses.replace(d, think_next=())).sides


def test_the_demand_of_a_trace_counts_blocks_no_earlier_request_had(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in (
        {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
        {"timestamp": 1000, "input_length": 1200, "output_length": 8, "hash_ids": [1, 2, 3]},
        {"timestamp": 2000, "input_length": 100, "output_length": 4, "hash_ids": [4]})))
    plan = load_plan(TINY, trace=str(trace))
    sc = plan.scenario
    # A probe takes rate x 4 s = 8 requests (the trace has 3) and scales them to the rate:
    # 3 requests over 2 s arrive at 1 req/s, at 2 req/s the timestamps halve; the window holds
    # all three, 3 / 2 = 1.5 s of them.
    pw = probe_workload(sc, 2.0)
    assert [c.start_s for c in pw.conversations] == [0.0, 0.5, 1.0] and (pw.start_s, pw.end_s) == (0.0, 1.5)
    # A burst trace gathers the scaled arrivals: spans of 0.75 s start at 0 and 0.75.
    burst = dataclasses.replace(sc, workload=dataclasses.replace(
        sc.workload, trace=dataclasses.replace(sc.workload.trace, burst_s=0.75)))
    assert [c.start_s for c in probe_workload(burst, 2.0).conversations] == [0.0, 0.0, 0.75]
    d = demand(sc, 2.0)
    # Second request: its first 1,024 tokens are the first request's two blocks.
    assert d.uncached == (1024, 1200 - 1024, 100) and d.prompt == (1024, 1200, 100) and d.output == (8, 8, 4)
    assert d.earliest == d.latest == (0.0, 0.5, 1.0) and (d.maybe, d.surely) == ((0, 1, 2), 3)
    # The probe replays it on the simulator at that rate: all three within the SLOs, 2 per
    # second of the window, over the 1 s of arrivals plus the last answer (3 requests / (1 s +
    # its service) between 2 and 3 per s).
    cand = candidates(plan, LLAMA8B, "pdd")[0]
    window, achieved, decided = plan_search.simulate_probe(plan, cand, 2.0)
    assert (window.requests, window.met, window.seconds, window.slo_rps) == (3, 3, 1.5, 2.0)
    assert 2.0 < achieved < 3.0 and not decided


def test_the_bisection_rates_are_every_rate_the_search_can_probe():
    # 1 .. 16 req/s in 5 probes: the ends, then 3 levels of geometric midpoints.
    assert bisection_rates(1.0, 16.0, 5) == [1.0, math.sqrt(2), 2.0, math.sqrt(8), 4.0, math.sqrt(32), 8.0,
                                             math.sqrt(128), 16.0]
    assert bisection_rates(1.0, 16.0, 2) == bisection_rates(1.0, 16.0, 1) == [1.0, 16.0]
    for passing in (0.0, 1.0, 3.0, 5.0, 12.0, 99.0):
        _, points = report.sla_goodput(lambda r: float(r <= passing), 0.9, 1.0, 16.0, 5)  # noqa: B023
        assert {r for r, _ in points} <= set(bisection_rates(1.0, 16.0, 5))


# ---- the search against brute force ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def searched():
    """Brute force (every candidate, every probe simulated) and the pruned search over the tiny
    space; each (candidate, rate) probe is simulated once and shared by both (the sim is
    deterministic), so the pruned search's simulations are counted exactly."""
    plan = load_plan(TINY)
    real = plan_search.simulate_probe
    memo: dict = {}
    calls: dict[str, list] = {"brute": [], "pruned": []}
    mode = ["brute"]

    def cached(plan, cand, rate):
        calls[mode[0]].append((cand, rate))
        if (cand, rate) not in memo:
            memo[cand, rate] = real(plan, cand, rate)
        return memo[cand, rate]

    mp = pytest.MonkeyPatch()
    mp.setattr(plan_search, "simulate_probe", cached)
    try:
        brute = plan_search.search(plan, exhaustive=True)
        mode[0] = "pruned"
        pruned = plan_search.search(plan)
    finally:
        mp.undo()
    return plan, brute, pruned, memo, calls


def test_the_pruned_search_finds_the_brute_force_optimum(searched):
    plan, brute, pruned, memo, calls = searched
    for kind in plan.spec.kinds:
        b, p = brute[kind], pruned[kind]
        assert b.bounded_out == 0 and b.pruned_probes == 0 and b.evaluated == 4
        # The same table: candidates, goodputs and order.
        assert [(e.candidate, e.goodput_rps) for e in p.ranked] == [(e.candidate, e.goodput_rps) for e in b.ranked]
    assert plan_search.winner(pruned).candidate == plan_search.winner(brute).candidate
    # The optimum on this space: two P and one decode GPU in one datacenter carry the top rate.
    # Goodput is `pddgw sim`'s (issue 20): the requests per second within SLO of the window's
    # arrivals at the highest passing offer, not the offered rate.  At 16 req/s offered, 66
    # requests arrived in the 4 s window (Poisson: more than 16 x 4) and all met the SLO: 16.5.
    best = plan_search.winner(pruned)
    assert (best.candidate.label(), best.goodput_rps, best.offered_rps, best.candidate.price) == (
        "P 2 x H100-SXM tp1 | MD 1 x H100-SXM tp1", 16.5, 16.0, 9.0)
    # Its roofline capacity reaches the top of the range (16 req/s, meant to fail), so its search
    # starts one step below (goodput.start_rate): 11.3 passes, then the top passes too.
    assert [(round(p.rate, 4), p.window.requests, p.window.met) for p in best.probes] == [
        (11.3137, 50, 50), (16.0, 66, 66)]
    # One P passes 8 req/s offered on the bisection's grid of 1 .. 16 req/s (5 probes): 35
    # arrivals in 4 s, all in SLO, 8.75 req/s.
    assert [(e.candidate.label(), e.goodput_rps, e.offered_rps) for e in pruned["same-dc"].ranked] == [
        ("P 2 x H100-SXM tp1 | MD 1 x H100-SXM tp1", 16.5, 16.0),
        ("P 1 x H100-SXM tp1 | MD 1 x H100-SXM tp1", 8.75, 8.0)]
    # PDD with two P passes sqrt(128) = 11.3 req/s offered: 46 of 50 window arrivals in SLO.
    assert [(e.candidate.label(), e.goodput_rps, round(e.offered_rps, 4)) for e in pruned["pdd"].ranked] == [
        ("P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1", 11.5, 11.3137),
        ("P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1", 11.5, 11.3137)]
    # Naive cross-DC passes sqrt(2) req/s offered (5 of 5 arrivals: 1.25 req/s): the WAN carries the
    # prompts of 2.33 req/s in the steady state, and 2 req/s already fails (4 of 7 in SLO).
    assert [(e.candidate.label(), e.goodput_rps, round(e.offered_rps, 4))
            for e in pruned["naive-cross-dc"].ranked] == [
        ("P 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1", 1.25, 1.4142),
        ("P 2 x H100-SXM tp1 | MD 1 x H200-SXM tp1", 1.25, 1.4142)]
    # It got there with fewer simulations: candidates it bounded out, bisections started where the
    # roofline's capacity puts the goodput (one P: 8 passes, 11.3 fails; no 4 req/s probe; two P:
    # 11.3 and 16, not the midpoints 4 and 8 first).
    assert (len(calls["pruned"]), len(calls["brute"])) == (18, 40)
    assert sum(r.bounded_out for r in pruned.values()) == 1
    assert [(round(p.rate, 4), p.window.requests)
            for p in pruned["same-dc"].ranked[1].probes] == [(8.0, 35), (11.3137, 54)]


def test_the_roofline_never_prunes_a_probe_that_would_pass(searched):
    plan, brute, pruned, memo, calls = searched
    target = plan.slo.attainment
    # Every rate the roofline prunes that either search simulated (brute force, pruning nothing,
    # simulates the bisection's every rate) failed: naive cross-DC's 4 req/s, twice the prompts its
    # WAN carries.
    checked = []
    for (cand, rate), (window, _, _) in memo.items():
        if plan_search._pruned(Setting.of(plan, cand), LLAMA8B, cand, demand(plan.scenario, rate))[0]:
            assert window.attainment < target
            checked.append((cand.kind, round(rate, 4)))
    assert sorted(set(checked)) == [("naive-cross-dc", 4.0)]
    for r in pruned.values():
        for e in r.all_evaluations:
            # The bound the branch and bound orders by is never below the real goodput.
            if e.refuted_at is None:
                assert e.upper_rps >= e.goodput_rps
    # Nor for any candidate, those it bounded out included (brute force evaluated every one),
    # and no simulated probe met more of its window than the roofline allows.
    grid = set(bisection_rates(plan.goodput.rate_min, plan.goodput.rate_max, plan.goodput.probes))
    prof = LLAMA8B
    for r in brute.values():
        for e in r.all_evaluations:
            assert e.upper_rps >= e.goodput_rps
            for probe in e.probes:
                assert probe.rate in grid
                # (A probe settled early reports the most its window could still meet, not what it met.)
                assert probe.decided or probe.window.met <= met_bound(Setting.of(plan, e.candidate), prof, e.candidate,
                                                                      demand(plan.scenario, probe.rate))


def test_a_refuting_probe_is_one_failing_probe_that_caps_the_goodput_below_the_table(searched):
    """Lifecycle step 5: once the table is full, a candidate is offered the highest grid rate at
    which a fail caps its goodput per USD below the table's last row; failing there (or at any
    later probe after which its lowest fail's cap, counting the simulated rates below it, ranks
    below the table) it is not evaluated further.  Brute force evaluated each one whole: every
    refuted candidate's goodput is within the cap, and its failing probe is the one brute force
    ran at that rate."""
    plan, brute, pruned, memo, calls = searched
    refuted = [(kind, e) for kind, r in pruned.items() for e in r.all_evaluations if e.refuted_at is not None]
    assert refuted and sum(r.refuted for r in pruned.values()) == len(refuted)
    # Naive's one-P split with two MD fails 2 req/s, and its pass at 1.41 (its window's own
    # requests within SLO) caps that fail below the table: refuted by the pass that came second.
    assert [(kind, e.candidate.label(), round(e.refuted_at, 4), [round(p.rate, 4) for p in e.probes])
            for kind, e in refuted] == [
        ("naive-cross-dc", "P 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1", 2.0, [2.0, 1.4142]),
        ("naive-cross-dc", "P 2 x H100-SXM tp1 | MD 2 x H200-SXM tp1", 2.0, [2.0]),
        ("pdd", "P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 2 x H200-SXM tp1", 11.3137, [11.3137]),
        ("pdd", "P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1", 8.0, [8.0])]
    for kind, e in refuted:
        full = next(b for b in brute[kind].all_evaluations if b.candidate == e.candidate)
        assert full.goodput_rps <= e.upper_rps
        assert e.per_usd < pruned[kind].ranked[-1].per_usd and full.per_usd < pruned[kind].ranked[-1].per_usd
        # Refuted at its lowest fail (the search stopped at that fail, or at a pass below it
        # whose window tightened the fail's cap).
        fails = [p for p in e.probes if p.attainment < plan.slo.attainment]
        probe = min(fails, key=lambda p: p.rate)
        assert probe.rate == e.refuted_at and e.goodput_rps is None
        assert e.probes[-1] is probe or e.probes[-1].rate < probe.rate
        if probe.simulated:
            assert memo[e.candidate, probe.rate][0] == probe.window
        # Refuting took no more probes than evaluating.
        assert len(e.probes) <= len(full.probes)
    # And fewer in all.
    assert sum(len(e.probes) for _, e in refuted) < sum(
        len(next(b for b in brute[kind].all_evaluations if b.candidate == e.candidate).probes) for kind, e in refuted)


def test_the_planners_probe_is_pddgw_sims_goodput_probe(searched):
    plan, brute, _, memo, _ = searched
    # The PDD winner's probe at 4 req/s, as `pddgw sim` runs it for the same deployment in a scenario.
    cand = brute["pdd"].winner.candidate
    sc = dataclasses.replace(plan.scenario, deployments=(cand.deployment(plan.spec, "x"),), baseline="x")
    window, run = goodput_probe(sc, Job("goodput", "x", plan.wan_gbps), 4.0)
    assert memo[cand, 4.0] == (window, sum(r.error is None for r in run.requests) / run.duration_s, run.decided)
    assert (window.seconds, window.requests) == (4.0, 21)


def test_the_winner_is_written_as_a_serve_config_and_scenario_deployments(searched, tmp_path):
    plan, _, pruned, _, _ = searched
    paths = write_outputs(plan, pruned, tmp_path)
    assert [p.name for p in paths] == ["config.toml", "same-dc.config.toml", "naive-cross-dc.config.toml",
                                       "pdd.config.toml", "deployments.toml"]
    pdd = pruned["pdd"].winner.candidate
    cfg = load_config(tmp_path / "pdd.config.toml")
    assert cfg == serve_config(plan, pdd)
    roles = [(n.name, n.role, n.cluster, n.port) for n in cfg.nodes]
    # The PDD winner (2 P, issue 20's window counting: 11.5 req/s in SLO against one P's 6.25).
    assert roles == [("router", "router", "A", 0), ("p0", "prefill", "A", 9101), ("p1", "prefill", "A", 9102),
                     ("rld0", "rld", "A", 9103), ("md0", "md", "B", 9104)]
    md = cfg.engine_for(cfg.node("md0"))
    assert (md.implementation, md.costmodel.hardware, md.costmodel.tensor_parallel, md.costmodel.data_parallel) == (
        "costmodel", "H200-SXM", 1, 1)
    assert cfg.node("md0").cost == 3.75 and cfg.model.profile == "llama3-8b" and cfg.policy.pipeline == "auto"
    assert cfg.net.shaping("wan").gbps == 10.0
    text = (tmp_path / "pdd.config.toml").read_text()
    assert 'hardware = "H200-SXM"\ntensor_parallel = 1\n' in text
    best = load_config(tmp_path / "config.toml")
    assert best.policy.pipeline == "P-MD" and [n.role for n in best.nodes] == ["router", "prefill", "prefill", "md"]
    # The [[deployments]] blocks make a scenario's deployments, named by kind, equal to the winners.
    header = (HERE / "tiny.toml").read_text().split("[[deployments]]")[0]
    (tmp_path / "sized.toml").write_text(header + (tmp_path / "deployments.toml").read_text())
    sc = load_scenario(tmp_path / "sized.toml")
    assert [d.name for d in sc.deployments] == ["same-dc", "naive-cross-dc", "pdd"]
    for kind, r in pruned.items():
        assert sc.deployment(kind) == r.winner.candidate.deployment(plan.spec)


@pytest.mark.parametrize("name", ["config.toml", "config.local.toml"])
def test_the_config_writer_round_trips_the_shipped_configs(name, tmp_path):
    cfg = load_config(HERE.parent.parent / name)
    (tmp_path / "c.toml").write_text(config_toml(cfg, "round trip"))
    assert load_config(tmp_path / "c.toml") == cfg


def test_the_dry_run_prints_every_kind_without_simulating(capsys, monkeypatch):
    monkeypatch.setattr(plan_search, "simulate_probe", lambda *a: pytest.fail("the dry run simulated"))
    assert cli.main(["plan", "--plan", str(TINY), "--dry-run"]) == 0       # `pddgw plan` reaches the planner
    out = capsys.readouterr().out
    for kind in ("same-dc", "naive-cross-dc", "pdd"):
        assert f"== {kind}: 4 candidates ==" in out


def test_the_json_report_names_the_winner_and_each_kinds_table(searched):
    from pddgw.sim.plan import _row, report_json

    plan, _, pruned, memo, _ = searched
    best = plan_search.winner(pruned).candidate
    rep = report_json(plan, pruned)
    assert orjson.loads(orjson.dumps(rep)) == rep
    assert (rep["winner"]["kind"], rep["winner"]["deployment"], rep["winner"]["goodput_rps"],
            rep["winner"]["goodput_offered_rps"]) == ("same-dc", "P 2 x H100-SXM tp1 | MD 1 x H100-SXM tp1", 16.5, 16.0)
    assert rep["winner"]["probes"][-1] == {"rate": 16.0, "attainment": 1.0, "simulated": True, "attainment_bound": 1.0,
                                          "arrival_rps": 16.5, "slo_rps": 16.5,
                                          "achieved_rps": round(memo[best, 16.0][1], 4),
                                          "decided_early": True,     # stopped once its window ended
                                          "window_bound": False,     # ...so its counts are exact
                                          "misses": {"failed": 0, "ttft": 0, "tpot": 0, "e2e": 0}}
    assert rep["winner"]["gpus_by_cluster"] == {"A": 3} and rep["winner"]["price_per_hour"] == 9.0
    naive = rep["kinds"]["naive-cross-dc"]
    # Started at the capacity (its WAN: 2.33 req/s), naive's searches ask no rate the roofline prunes.
    assert (naive["candidates"], naive["pruned_probes"], len(naive["ranked"])) == (4, 0, 2)
    assert naive["ranked"][0]["roofline"]["limit"] == "wan"
    # Where naive's best gave out, by cause: at 2 req/s one window request has no first token past
    # its TTFT deadline, so at most 7 of the window's 8 can meet the SLO (docs/simulator.md).
    top = naive["ranked"][0]
    fail = top["goodput_fail"]
    first = min((p for p in top["probes"] if p["simulated"] and p["rate"] > top["goodput_offered_rps"]),
                key=lambda p: p["rate"])
    assert fail == {"offered_rps": first["rate"], "attainment": first["attainment"], "misses": first["misses"]}
    assert fail == {"offered_rps": 2.0, "attainment": 0.875, "misses": {"failed": 0, "ttft": 1, "tpot": 0, "e2e": 0}}
    assert _row(1, plan_search.winner({"naive-cross-dc": pruned["naive-cross-dc"]}))[7] == "2: ttft 1"


# ---- the order of the probes and of the candidates ---------------------------------------------------

def _threshold_probe(goodput_at: float, asked: list[float]):
    """A synthetic probe: 10 arrivals per req/s offered over a 10 s window, all in SLO up to
    `goodput_at` req/s offered, half of them above (attainment falls as the rate rises)."""
    def simulate(plan, cand, rate):
        asked.append(round(rate, 4))
        n = round(rate * 10)
        return report.Window(n, n if rate <= goodput_at else n // 2, 10.0), rate, False
    return simulate


@pytest.mark.parametrize("goodput_at, probes, goodput", [
    (8.0, [8.0, 11.3137], 8.0),                 # the start passes: no refuting probe below it
    (6.0, [8.0, 5.6569], 5.7),                  # it fails, its neighbour below passes: settled
    (5.0, [8.0, 5.6569, 4.0], 4.0),             # both fail: the refuting probe, then the bisection
    (3.0, [8.0, 5.6569, 4.0], None),            # all three fail: refuted at 4 req/s
])
def test_a_start_above_the_refuting_rate_is_probed_first(monkeypatch, goodput_at, probes, goodput):
    """Lifecycle step 5 with a start (`goodput.start_rate`) above the refuting rate: the start goes
    first, and a pass there settles the refuting rate without simulating it; a fail there is
    followed by its neighbour below (above the refuting rate), whose pass settles it too."""
    plan = load_plan(TINY)
    cand = next(c for c in candidates(plan, LLAMA8B, "same-dc")
                if c.label() == "P 2 x H100-SXM tp1 | MD 1 x H100-SXM tp1")
    asked: list[float] = []
    monkeypatch.setattr(plan_search, "simulate_probe", _threshold_probe(goodput_at, asked))
    monkeypatch.setattr(plan_search, "start_rate", lambda spec, capacity: 8.0)
    monkeypatch.setattr(plan_search, "refuting_rate", lambda *a: 4.0)
    # A bar only the refuting probe's fail can hold a candidate under: caps count the roofline's
    # bounds at the rates below a fail, far above these windows, except below the grid's 4 req/s.
    bar = plan_search._below(Setting.of(plan, cand), LLAMA8B, cand, plan_search._Workloads(plan), 4.0) / cand.price
    e = plan_search.evaluate(plan, cand, beat=bar * 1.001)
    assert asked == probes and [round(p.rate, 4) for p in e.probes] == probes
    assert e.goodput_rps == goodput and e.refuted_at == (4.0 if goodput is None else None)


def _order_of_starts(plan, jobs: int, last_first: bool) -> dict[str, list[tuple[str, float | None]]]:
    """Each kind's candidates in the order `_KindSearch` hands them out, with their bars, when
    evaluations end oldest first or newest first (a synthetic goodput: half the bound)."""
    searches = [plan_search._KindSearch(plan, k, False, jobs) for k in plan.spec.kinds]
    bound = {e.candidate: e for s in searches for e in s.bounded}
    started: dict[str, list[tuple[str, float | None]]] = {s.kind: [] for s in searches}
    running: list[tuple[plan_search._KindSearch, int, object]] = []
    while True:
        for s in searches:
            while len(running) < jobs and not isinstance(nxt := s.next(), bool):
                i, cand, beat = nxt
                started[s.kind].append((cand.label(), beat))
                running.append((s, i, cand))
        if not running:
            return started
        s, i, cand = running.pop(-1 if last_first else 0)
        b = bound[cand]
        s.finish(i, dataclasses.replace(b, goodput_rps=b.upper_rps / 2, offered_rps=1.0))


def test_each_kinds_search_is_the_same_whichever_evaluation_ends_first():
    """`_KindSearch`: the m-th candidate starts once the first m - jobs have ended and reads only
    their results, so the candidates, their bars and the cut are the same in any order of ending;
    with one job, each reads every result before it (the sequential search)."""
    plan = load_plan(TINY)
    two = _order_of_starts(plan, 2, last_first=False)
    assert two == _order_of_starts(plan, 2, last_first=True)
    one = _order_of_starts(plan, 1, last_first=False)
    for kind in plan.spec.kinds:
        # top = 2: with two jobs the first three start with no bar (the third reads one result),
        # with one job the first two.
        assert [beat is None for _, beat in two[kind][:4]] == [True, True, True, False]
        assert [beat is None for _, beat in one[kind][:3]] == [True, True, False]
        # The same four candidates (half their bounds cuts none here); the fourth of two jobs reads
        # the first two results, as the third of one job does.
        assert [label for label, _ in one[kind]] == [label for label, _ in two[kind]] and len(two[kind]) == 4
        assert two[kind][3][1] == one[kind][2][1]


def test_two_workers_find_the_same_table(searched):
    """`--jobs 2`: candidates of every kind on a process pool, none waiting for a batch; the
    bars read fewer results than one job's, so it may simulate more, never a different table."""
    plan, _, pruned, _, _ = searched
    two = plan_search.search(plan, jobs=2)
    for kind in plan.spec.kinds:
        assert [(e.candidate, e.goodput_rps) for e in two[kind].ranked] == [
            (e.candidate, e.goodput_rps) for e in pruned[kind].ranked]
        one = {e.candidate: e.goodput_rps for e in pruned[kind].all_evaluations if e.goodput_rps is not None}
        both = [e for e in two[kind].all_evaluations if e.candidate in one and e.goodput_rps is not None]
        assert both and all(e.goodput_rps == one[e.candidate] for e in both)
    # Per kind (same-DC, naive, PDD), simulated probes: one job 5 / 7 / 6, two jobs 6 / 7 / 7.
    assert [(pruned[k].simulated_probes, two[k].simulated_probes) for k in plan.spec.kinds] == [(5, 6), (7, 7), (6, 7)]
