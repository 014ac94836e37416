"""Policy: pipeline choice at and around every threshold, the singular rate cap,
handoff mode by load, catch-up plans, instance choice, and the config section."""

from __future__ import annotations

import dataclasses

import pytest

from pddgw.config import Config, ConfigError, PolicyConfig
from pddgw.config_build import build
from pddgw.pipeline.policy import (
    HandoffInputs,
    InstanceLoad,
    NoInstanceError,
    PipelineInputs,
    SingularLimiter,
    choose_handoff_mode,
    choose_pipeline,
    decide_pipeline,
    estimate_transfer_ms,
    is_singular_candidate,
    pick_cached,
    pick_instance,
    plan_handoff_round,
    prefill_wait_tokens,
    relay_pressure,
)

CFG = PolicyConfig()


def inputs(**kw) -> PipelineInputs:
    base = dict(prompt_tokens=1024, block_size=16, md_hit_blocks=60, missing_kv_bytes=0,
                max_output_tokens=256, bandwidth_bytes_per_s=1e6, rtt_ms=30.0,
                rld_load=0.1, md_load=0.1)
    base.update(kw)
    return PipelineInputs(**base)


# ---------------------------------------------------------------- config


def test_policy_config_defaults_and_section():
    c = Config()
    assert c.policy == PolicyConfig()
    assert (CFG.pipeline, CFG.p_md_max_transfer_ms, CFG.catchup_threshold, CFG.handoff_mode,
            CFG.singular_max_share) == ("auto", 200.0, 64, "auto", 0.05)
    c2 = build(Config, {"policy": {"catchup_threshold": 32, "catchup_threshold_md_loaded": 16,
                                   "pipeline": "P-MD", "p_md_max_transfer_ms": 50}})
    assert (c2.policy.catchup_threshold, c2.policy.pipeline, c2.policy.p_md_max_transfer_ms) == (
        32, "P-MD", 50.0)
    with pytest.raises(ConfigError, match="policy.catchup_treshold: unknown key"):
        build(Config, {"policy": {"catchup_treshold": 3}})
    with pytest.raises(ConfigError, match="policy.pipeline: 'P-X' is not one of"):
        build(Config, {"policy": {"pipeline": "P-X"}})


@pytest.mark.parametrize("kw,msg", [
    ({"p_md_max_transfer_ms": -1}, "p_md_max_transfer_ms"),
    ({"singular_max_share": 1.5}, "singular_max_share"),
    ({"singular_burst": 0.5}, "singular_burst"),
    ({"catchup_threshold": 0}, "catchup_threshold must"),
    ({"catchup_threshold_md_loaded": 65}, "catchup_threshold_md_loaded"),
    ({"catchup_max_chunk": 63}, "catchup_max_chunk"),
    ({"catchup_max_rounds": 0}, "catchup_max_rounds"),
    ({"link_prior_mbps": 0}, "link_prior_mbps"),
    ({"link_ewma_alpha": 0}, "link_ewma_alpha"),
    ({"link_median_window": 0}, "link_median_window"),
])
def test_policy_config_validation(kw, msg):
    with pytest.raises(ValueError, match=msg):
        PolicyConfig(**kw)
    with pytest.raises(ConfigError, match=f"policy: .*{msg}"):
        build(Config, {"policy": kw})


# ---------------------------------------------------------------- loads, instances


def rep(name, role="md", running=0, waiting=0, used=0, healthy=True, seqs=10, total=100):
    return InstanceLoad(name, role, running, waiting, seqs, used, total, healthy)


def test_load_is_the_larger_of_slots_and_kv():
    assert rep("a", running=3, waiting=2, used=20).load == 0.5
    assert rep("a", running=1, used=70).load == 0.7
    assert rep("a", running=10, waiting=5).load == 1.5
    with pytest.raises(ValueError):
        rep("a", used=101)
    with pytest.raises(ValueError):
        rep("a", running=-1)


def test_pick_instance():
    reports = [rep("md-b", running=5), rep("md-a", running=2, used=40), rep("md-c", running=1),
               rep("rld-a", role="rld"), rep("md-d", healthy=False)]
    c = pick_instance(reports, "md")
    assert (c.instance, c.load, c.excluded) == ("md-c", 0.1, ("md-d",))
    assert c.candidates == (("md-b", 0.5), ("md-a", 0.4), ("md-c", 0.1))
    c = pick_instance(reports, "md", exclude=["md-c"])
    assert (c.instance, c.excluded) == ("md-a", ("md-c", "md-d"))
    assert pick_instance(reports, "rld").instance == "rld-a"
    assert pick_instance(reports, "prefill") is None
    assert pick_instance([rep("x", healthy=False)], "md") is None
    # Equal load: fewer sequences wins, then the name.
    tie = [rep("b", running=2, used=20), rep("a", running=1, used=20), rep("c", running=1, used=20)]
    assert pick_instance(tie, "md").instance == "a"
    assert pick_instance(tie, "md").as_log()["instance"] == "a"


def test_prefill_wait_spreads_the_backlog_over_the_dp_ranks():
    """A DP16 P holding a follow-up's 62K-token prefix behind one 64K first turn: the first turn
    chunks on its own rank, so the follow-up waits ~4K rank-tokens and its own 3.4K, far less
    than recomputing 56K on an idle P; on one rank (dp 1) the backlog counts whole."""
    assert prefill_wait_tokens(65536, 16, 3400) == 4096 + 3400
    assert prefill_wait_tokens(65536, 16, 3400) < prefill_wait_tokens(0, 16, 65536 - 8192)
    assert prefill_wait_tokens(65536, 1, 3400) == 68936 > prefill_wait_tokens(0, 1, 65536 - 8192)
    assert prefill_wait_tokens(1000, 0, 10) == 1010            # no ranks reported: one


def test_pick_cached_keeps_long_prefixes_and_spreads_short_ones():
    cfg = PolicyConfig()                          # affinity_max_load 0.9, affinity_min_match 0.3
    reports = [rep("md-a", running=6), rep("md-b", running=1), rep("md-c", running=9)]
    # A later turn: md-a holds 75 % of it, busier than md-b: it stays.
    assert pick_cached(reports, {"md-a": 750, "md-b": 100}, 1000, cfg) == "md-a"
    # A first turn sharing only the system prompt (12.5 %) everywhere: None, the least loaded.
    assert pick_cached(reports, {"md-a": 125, "md-b": 125}, 1000, cfg) is None
    assert pick_cached(reports, {"md-a": 299}, 1000, cfg) is None
    assert pick_cached(reports, {"md-a": 300}, 1000, cfg) == "md-a"
    # md-c (0.9 loaded) counts only when every instance is.
    assert pick_cached(reports, {"md-c": 900, "md-a": 400}, 1000, cfg) == "md-a"
    full = [rep("md-a", running=9), rep("md-c", running=10)]
    assert pick_cached(full, {"md-c": 900, "md-a": 400}, 1000, cfg) == "md-c"
    # Equal prefixes: the less loaded, then the name.
    assert pick_cached(reports, {"md-a": 500, "md-b": 500}, 1000, cfg) == "md-b"
    assert pick_cached([rep("md-b"), rep("md-a")], {"md-a": 500, "md-b": 500}, 1000, cfg) == "md-a"
    # Threshold 0: any remembered block counts (the rule before the threshold).
    assert pick_cached(reports, {"md-a": 16}, 1000, dataclasses.replace(cfg, affinity_min_match=0.0)) == "md-a"
    assert pick_cached([], {}, 1000, cfg) is None
    with pytest.raises(ValueError, match="affinity_min_match must be in"):
        PolicyConfig(affinity_min_match=1.5)


# ---------------------------------------------------------------- pipeline choice


def test_transfer_estimate():
    assert estimate_transfer_ms(185_000, 1e6, 30.0) == 200.0
    assert estimate_transfer_ms(0, 1e6, 30.0) == 15.0


def test_p_md_at_and_past_the_budget():
    # 15 ms half-RTT + 185 000 B at 1 MB/s = exactly the 200 ms budget.
    d = choose_pipeline(inputs(missing_kv_bytes=185_000), CFG)
    assert (d.pipeline, d.reason, d.transfer_ms, d.budget_ms) == ("P-MD", "fits_budget", 200.0, 200.0)
    d = choose_pipeline(inputs(missing_kv_bytes=185_001), CFG)
    assert (d.pipeline, d.reason) == ("P-RLD-MD", "transfer_over_budget")
    # The RTT alone can blow the budget.
    d = choose_pipeline(inputs(missing_kv_bytes=0, rtt_ms=400.0), CFG)
    assert (d.pipeline, d.transfer_ms) == ("P-MD", 200.0)
    d = choose_pipeline(inputs(missing_kv_bytes=0, rtt_ms=401.0), CFG)
    assert (d.pipeline, d.reason, d.transfer_ms) == ("P-RLD-MD", "transfer_over_budget", 200.5)
    d = choose_pipeline(inputs(missing_kv_bytes=0, rtt_ms=401.0),
                        dataclasses.replace(CFG, p_md_max_transfer_ms=200.5))
    assert d.pipeline == "P-MD"


def test_md_busy_threshold():
    d = choose_pipeline(inputs(md_load=0.9), CFG)
    assert (d.pipeline, d.reason) == ("P-RLD-MD", "md_busy")
    d = choose_pipeline(inputs(md_load=0.8999), CFG)
    assert (d.pipeline, d.reason) == ("P-MD", "fits_budget")


def test_rld_full_threshold():
    slow = dict(missing_kv_bytes=10_000_000)
    d = choose_pipeline(inputs(rld_load=1.0001, **slow), CFG)
    assert (d.pipeline, d.reason) == ("P-MD", "rld_full")
    d = choose_pipeline(inputs(rld_load=1.0, **slow), CFG)
    assert (d.pipeline, d.reason) == ("P-RLD-MD", "transfer_over_budget")
    # A full RLD also blocks the md_busy detour: the request waits for the WAN.
    d = choose_pipeline(inputs(rld_load=1.5, md_load=0.95), CFG)
    assert (d.pipeline, d.reason) == ("P-MD", "rld_full")


def test_relay_pressure_counts_slots_and_kv_share():
    cfg = dataclasses.replace(CFG, rld_max_relays=4, rld_max_kv_share=0.5)
    assert relay_pressure(0, 0, 1000, cfg) == 0.0
    assert relay_pressure(4, 0, 1000, cfg) == 1.0          # the 4th relay fits
    assert relay_pressure(5, 0, 1000, cfg) == 1.25
    assert relay_pressure(1, 500, 1000, cfg) == 1.0        # half the pool is the KV share
    assert relay_pressure(1, 501, 1000, cfg) == 1.002
    assert relay_pressure(2, 10**9, 0, cfg) == 0.5         # pool size unknown: slots only


def test_availability_and_forcing():
    assert choose_pipeline(inputs(md_load=None), CFG).reason == "md_unavailable"
    assert choose_pipeline(inputs(md_load=None), CFG).pipeline == "P-RLD"
    d = choose_pipeline(inputs(rld_load=None, missing_kv_bytes=10**9), CFG)
    assert (d.pipeline, d.reason) == ("P-MD", "rld_unavailable")
    with pytest.raises(NoInstanceError):
        choose_pipeline(inputs(rld_load=None, md_load=None), CFG)
    for forced in ("P-MD", "P-RLD-MD", "P-RLD"):
        d = choose_pipeline(inputs(missing_kv_bytes=10**9), dataclasses.replace(CFG, pipeline=forced))
        assert (d.pipeline, d.reason) == (forced, "forced")
    # Availability beats forcing: there is no RLD to force through.
    d = choose_pipeline(inputs(rld_load=None), dataclasses.replace(CFG, pipeline="P-RLD-MD"))
    assert (d.pipeline, d.reason) == ("P-MD", "rld_unavailable")


def singular_inputs(**kw) -> PipelineInputs:
    # 2064 prompt tokens, 1 block on MD -> 2048 missing; 16 output tokens.
    base = dict(prompt_tokens=2064, md_hit_blocks=1, missing_kv_bytes=10**8, max_output_tokens=16)
    base.update(kw)
    return inputs(**base)


def test_singular_candidate_thresholds():
    assert singular_inputs().missing_tokens == 2048
    assert is_singular_candidate(singular_inputs(), CFG)
    assert not is_singular_candidate(singular_inputs(md_hit_blocks=2), CFG)   # 2032 missing
    assert not is_singular_candidate(singular_inputs(max_output_tokens=17), CFG)
    assert is_singular_candidate(singular_inputs(max_output_tokens=0), CFG)
    assert not is_singular_candidate(singular_inputs(), dataclasses.replace(CFG, singular_max_share=0.0))
    d = choose_pipeline(singular_inputs(), CFG)
    assert (d.pipeline, d.reason, d.singular_candidate) == ("P-RLD", "singular", True)
    # Singular wins even when the KV would fit: it saves the WAN and MD entirely.
    d = choose_pipeline(singular_inputs(missing_kv_bytes=0), CFG)
    assert (d.pipeline, d.reason) == ("P-RLD", "singular")
    d = choose_pipeline(singular_inputs(), CFG, singular_allowed=False)
    assert (d.pipeline, d.reason, d.singular_allowed) == ("P-RLD-MD", "transfer_over_budget", False)
    d = choose_pipeline(singular_inputs(rld_load=1.1), CFG)
    assert (d.pipeline, d.reason) == ("P-MD", "rld_full")
    d = choose_pipeline(singular_inputs(md_hit_blocks=2), CFG)
    assert (d.pipeline, d.reason, d.singular_candidate) == ("P-RLD-MD", "transfer_over_budget", False)


def test_rate_cap_quarter_share():
    cfg = dataclasses.replace(CFG, singular_max_share=0.25, singular_burst=1.0)
    lim = SingularLimiter.from_config(cfg)
    got = [decide_pipeline(singular_inputs(), cfg, lim).pipeline for _ in range(12)]
    assert got == ["P-RLD", "P-RLD-MD", "P-RLD-MD", "P-RLD-MD"] * 3
    assert (lim.requests, lim.admitted) == (12, 3)


def test_rate_cap_default_share_and_burst():
    lim = SingularLimiter.from_config(CFG)
    admitted = [i for i in range(100)
                if decide_pipeline(singular_inputs(), CFG, lim).reason == "singular"]
    # Burst of 2 up front, then one per 20 requests (0.05 credit each).
    assert admitted == [0, 1, 20, 40, 60, 80]
    assert len(admitted) <= 0.05 * 100 + 2


def test_rate_cap_counts_every_request():
    lim = SingularLimiter(0.1, 1.0)
    assert decide_pipeline(singular_inputs(), CFG, lim).reason == "singular"
    # Nine ordinary requests earn back 0.9 credit; the tenth request's share makes 1.0.
    for _ in range(9):
        assert decide_pipeline(inputs(), CFG, lim).reason == "fits_budget"
    assert decide_pipeline(singular_inputs(), CFG, lim).reason == "singular"
    assert decide_pipeline(singular_inputs(), CFG, lim).reason == "transfer_over_budget"
    # Forced and fallback P-RLD do not spend credit.
    lim2 = SingularLimiter(0.1, 1.0)
    assert decide_pipeline(singular_inputs(md_load=None), CFG, lim2).reason == "md_unavailable"
    assert lim2.admitted == 0 and lim2.available


def test_limiter_share_zero_never_admits():
    lim = SingularLimiter(0.0, 5.0)
    for _ in range(50):
        lim.observe_request()
    assert not lim.available
    with pytest.raises(RuntimeError):
        lim.take()
    with pytest.raises(ValueError):
        SingularLimiter(0.1, 0.5)


def test_decision_log_carries_inputs():
    d = choose_pipeline(inputs(missing_kv_bytes=185_001), CFG)
    log = d.as_log()
    assert log["decision"] == "pipeline" and log["pipeline"] == "P-RLD-MD"
    assert (log["missing_kv_bytes"], log["missing_tokens"], log["prompt_blocks"], log["md_load"],
            log["rtt_ms"], log["transfer_ms"]) == (185_001, 64, 64, 0.1, 30.0, 200.001)


def test_pipeline_inputs_validation():
    with pytest.raises(ValueError):
        inputs(md_hit_blocks=65)          # 1024 tokens = 64 blocks
    assert inputs(prompt_tokens=1025, md_hit_blocks=64).missing_tokens == 1
    with pytest.raises(ValueError):
        inputs(bandwidth_bytes_per_s=0)
    with pytest.raises(ValueError):
        inputs(missing_kv_bytes=-1)


# ---------------------------------------------------------------- handoff mode


@pytest.mark.parametrize("rld,md,mode,threshold,reason", [
    (0.1, 0.1, "catch-up", 64, "default"),
    (0.7499, 0.7499, "catch-up", 64, "default"),
    (0.75, 0.5, "one-shot", 64, "rld_loaded"),
    (0.5, 0.75, "catch-up", 32, "md_loaded"),
    (0.8, 0.8, "one-shot", 32, "both_loaded"),   # tie releases RLD
    (0.8, 0.9, "catch-up", 32, "both_loaded"),
    (0.95, 0.8, "one-shot", 32, "both_loaded"),
])
def test_handoff_mode_by_load(rld, md, mode, threshold, reason):
    d = choose_handoff_mode(HandoffInputs(generated=100, rld_load=rld, md_load=md), CFG)
    assert (d.mode, d.threshold, d.reason) == (mode, threshold, reason)
    assert d.as_log()["rld_load"] == rld


def test_handoff_mode_forced():
    for forced in ("one-shot", "catch-up"):
        cfg = dataclasses.replace(CFG, handoff_mode=forced)
        d = choose_handoff_mode(HandoffInputs(10, rld_load=0.99, md_load=0.0), cfg)
        assert (d.mode, d.threshold, d.reason) == (forced, 64, "forced")
        d = choose_handoff_mode(HandoffInputs(10, rld_load=0.0, md_load=0.99), cfg)
        assert (d.mode, d.threshold, d.reason) == (forced, 32, "forced")


# ---------------------------------------------------------------- catch-up planner


def plan(g, s, rounds=0, mode="catch-up", t=64, max_chunk=256, max_rounds=8, per_round=0.0):
    c = plan_handoff_round(generated=g, sent=s, rounds_done=rounds, mode=mode, threshold=t,
                           max_chunk=max_chunk, max_rounds=max_rounds, per_round=per_round)
    return c.start, c.end, c.final, c.reason


@pytest.mark.parametrize("args,expected", [
    ((100, 0, 0, "one-shot"), (0, 100, True, "one-shot")),
    ((500, 0, 0, "one-shot"), (0, 500, True, "one-shot")),
    ((63, 0), (0, 63, True, "under_threshold")),
    ((64, 0), (0, 64, False, "catch-up")),
    ((65, 0), (0, 65, False, "catch-up")),
    ((256, 0), (0, 256, False, "catch-up")),
    ((300, 0), (0, 256, False, "catch-up")),           # capped at max_chunk
    ((310, 256, 1), (256, 310, True, "under_threshold")),
    ((320, 256, 1), (256, 320, False, "catch-up")),
    ((500, 100, 8), (100, 500, True, "max_rounds")),
    # 400 unsent: a 256 cap would leave 144 >= 64 for the next round, so the
    # chunk grows until the next round is the last (400 - 337 = 63 < 64).
    ((500, 100, 7), (100, 437, False, "catch-up")),
    ((0, 0), (0, 0, True, "under_threshold")),
    ((40, 40, 2), (40, 40, True, "under_threshold")),
])
def test_plan_default_threshold(args, expected):
    assert plan(*args) == expected


@pytest.mark.parametrize("t,g,expected", [
    (1, 0, (0, 0, True, "under_threshold")),
    (1, 1, (0, 1, False, "catch-up")),
    (16, 15, (0, 15, True, "under_threshold")),
    (16, 16, (0, 16, False, "catch-up")),
    (128, 127, (0, 127, True, "under_threshold")),
    (128, 200, (0, 200, False, "catch-up")),
])
def test_plan_other_thresholds(t, g, expected):
    assert plan(g, 0, t=t, max_chunk=256) == expected


def run_catch_up(g0, per_round, t, max_chunk, max_rounds, told=None):
    """RLD makes `per_round` tokens while MD extends each chunk; the plan is told
    `told` tokens per round (default: the truth, as RLD measures it)."""
    g, sent, rounds, out = g0, 0, 0, []
    while True:
        c = plan_handoff_round(generated=g, sent=sent, rounds_done=rounds, mode="catch-up",
                               threshold=t, max_chunk=max_chunk, max_rounds=max_rounds,
                               per_round=per_round if told is None else told)
        out.append((c.start, c.end, c.final, c.reason))
        if c.final:
            return out
        sent, rounds, g = c.end, rounds + 1, g + per_round


def test_catch_up_converges_in_two_rounds_when_md_keeps_up():
    assert run_catch_up(200, 20, 64, 256, 8) == [(0, 200, False, "catch-up"),
                                                 (200, 220, True, "under_threshold")]
    # Past max_chunk the first chunk grows just enough that the rest is one final round.
    assert run_catch_up(600, 10, 64, 256, 8) == [(0, 547, False, "catch-up"),
                                                 (547, 610, True, "under_threshold")]
    # The paper's regime: WAN RTT ~ one decode step, so ~2 tokens per round.
    for g0 in range(64, 1025, 7):
        rounds = run_catch_up(g0, 2, 64, 256, 8)
        assert len(rounds) == 2 and rounds[-1][2], (g0, rounds)


def test_catch_up_goes_one_shot_when_rld_outruns_a_round_trip():
    # RLD makes 40 tokens per round, the threshold is 32: chasing never converges.
    assert run_catch_up(200, 40, 32, 64, 8) == [(0, 200, True, "no_convergence")]
    assert run_catch_up(200, 64, 64, 256, 8) == [(0, 200, True, "no_convergence")]
    assert run_catch_up(200, 63, 64, 256, 8)[-1] == (200, 263, True, "under_threshold")


def test_catch_up_ends_at_max_rounds_when_the_rate_was_underestimated():
    # Told 0 tokens per round, RLD really makes 40 against a threshold of 32.
    assert run_catch_up(200, 40, 32, 64, 3, told=0) == [
        (0, 169, False, "catch-up"), (169, 233, False, "catch-up"), (233, 280, False, "catch-up"),
        (280, 320, True, "max_rounds")]


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError):
        plan(10, 11)
    with pytest.raises(ValueError):
        plan(10, 0, t=0)
    with pytest.raises(ValueError):
        plan(10, 0, t=64, max_chunk=32)
    with pytest.raises(ValueError):
        plan(10, 0, rounds=-1)
    with pytest.raises(ValueError):
        plan(10, 0, per_round=-1.0)
