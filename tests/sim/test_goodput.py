"""SLA goodput the paper's way: open-loop conversations, a measured window, requests per second within SLO."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from pddgw.sim import report
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import Decided, RequestResult, run_deployment
from pddgw.sim.goodput import Prober, bisect, start_rate
from pddgw.sim.probe import probe_workload, run_probe
from pddgw.sim.run import Job, goodput_probe, run_job
from pddgw.sim.plan_bounds import Setting, capacity, demand, deployment_bound, met_bound
from pddgw.sim.profiles import model
from pddgw.sim.scenario import GoodputSpec, SloSpec, deployment_config, load_scenario
from pddgw.sim.workload import AgenticSpec, agentic

TINY = Path(__file__).parent / "tiny.toml"


def _req(i: int, arrival: float, ttft: float | None, tpot: float | None = 0.01, error: str | None = None):
    r = RequestResult(f"r{i}", i, 0, arrival, 100, 10, 0.0)
    r.ttft_s, r.tpot_s, r.error = ttft, tpot, error
    return r


def test_window_counts_the_arrivals_inside_it_and_those_within_slo():
    slo = SloSpec(ttft_s=1.0, tpot_ms=50.0, attainment=0.9)
    reqs = [_req(0, 0.5, 0.2),                     # before the window
            _req(1, 1.0, 0.9),                     # in, meets
            _req(2, 2.0, 1.5),                     # in, TTFT too slow
            _req(3, 2.5, 0.3, tpot=0.06),          # in, TPOT 60 ms > 50
            _req(4, 3.0, None, error="node_lost: x"),   # in, failed
            _req(5, 3.5, 0.1),                     # in, meets
            _req(6, 5.0, 0.1),                     # at the window's end: out
            _req(7, 4.0, 1.2, tpot=0.07)]          # in, TTFT and TPOT too slow: a TTFT miss
    w = report.window_goodput(reqs[:-1], slo, 1.0, 5.0)
    assert (w.requests, w.met, w.seconds) == (5, 2, 4.0)
    assert w.misses == report.Misses(failed=1, ttft=1, tpot=1, e2e=0)
    assert report.window_goodput(reqs, slo, 1.0, 5.0).misses == report.Misses(failed=1, ttft=2, tpot=1)
    e2e = dataclasses.replace(slo, e2e_s=2.0)
    r8 = _req(8, 1.0, 0.5)
    r8.e2e_s = 2.5                                 # met TTFT and TPOT, then took too long
    assert [report.miss_cause(r, e2e) for r in (reqs[1], reqs[2], reqs[3], reqs[4], r8)] == [
        None, "ttft", "tpot", "failed", "e2e"]
    assert (w.arrival_rps, w.slo_rps, w.attainment) == (1.25, 0.5, 0.4)
    empty = report.window_goodput(reqs, slo, 10.0, 12.0)
    assert (empty.requests, empty.met, empty.slo_rps, empty.attainment) == (0, 0, 0.0, 0.0)
    with pytest.raises(ValueError, match=r"need 0 <= start_s < end_s, got \[2.0, 2.0\)"):
        report.window_goodput(reqs, slo, 2.0, 2.0)


def test_a_horizon_starts_conversations_open_loop_with_all_their_turns():
    spec = AgenticSpec(requests=5, rate=3.0, context_tokens=256, output_tokens=4, shared_prefix_tokens=64,
                       turns_min=2, turns_max=4)
    convs = agentic(spec, 7, horizon_s=20.0)
    assert convs[0].start_s == 0.0 and all(c.start_s < 20.0 for c in convs)
    assert all(2 <= len(c.turns) <= 4 for c in convs)
    # Starts at rate / mean turns = 1 conversation per second: ~20 of them, far past 5 requests.
    assert 10 <= len(convs) <= 30 and sum(len(c.turns) for c in convs) > spec.requests
    # The same draws as the request-budget mode: its conversations are the horizon's first ones,
    # the last cut to the budget.
    budget = agentic(spec, 7)
    assert sum(len(c.turns) for c in budget) == 5
    k = len(budget) - 1
    assert budget[:k] == convs[:k]
    assert budget[k].start_s == convs[k].start_s and budget[k].turns == convs[k].turns[:len(budget[k].turns)]
    assert agentic(spec, 7, horizon_s=20.0) == convs
    with pytest.raises(ValueError, match="horizon_s must be > 0"):
        agentic(spec, 7, horizon_s=0.0)


def _tiny(**goodput):
    sc = load_scenario(TINY)
    return dataclasses.replace(sc, goodput=GoodputSpec(**goodput))


def test_a_probe_measures_the_window_after_the_warm_up_on_the_virtual_clock():
    sc = _tiny(seconds=3.0, warmup_s=1.0, rate_min=0.5, rate_max=4.0, probes=2)
    w, run = goodput_probe(sc, Job("goodput", "same-dc", None), 3.5)
    convs = agentic(dataclasses.replace(sc.workload.agentic, rate=3.5), sc.seed, horizon_s=4.0)
    pw = probe_workload(sc, 3.5)
    assert [c.cid for c in pw.conversations] == [c.cid for c in convs]
    # The whole run: every conversation started before the horizon plays all its turns; first
    # turns arrive exactly at their conversation's start, whatever the deployment's speed.
    cfg = deployment_config(sc, sc.deployment("same-dc"), None)
    whole = run_virtual(run_deployment(cfg, list(pw.conversations), pw.prefix))
    assert len(whole.requests) == sum(len(c.turns) for c in convs)
    firsts = {r.conversation: r.arrival_s for r in whole.requests if r.turn == 0}
    assert firsts == pytest.approx({c.cid: c.start_s for c in convs}, abs=1e-6)
    inside = [r for r in whole.requests if 1.0 <= r.arrival_s < 4.0]
    assert (w.requests, w.seconds) == (len(inside), 3.0)
    assert w.met == sum(report.meets_slo(r, sc.slo) for r in inside)
    assert w.slo_rps == w.met / 3.0
    # The probe stopped once a request arrived past the window and every window request had
    # ended: its requests are the whole run's that ended by then, event for event.
    assert run.decided and len(run.requests) < len(whole.requests)
    assert all(r.arrival_s < 4.0 for r in run.requests) and {r.rid for r in inside} <= {r.rid for r in run.requests}
    same = {r.rid: (r.arrival_s, r.ttft_s, r.e2e_s, r.output_digest) for r in whole.requests}
    assert [(r.arrival_s, r.ttft_s, r.e2e_s, r.output_digest) for r in run.requests] == [
        same[r.rid] for r in run.requests]


def test_goodput_is_the_rate_within_slo_at_the_highest_passing_offer(monkeypatch, capsys):
    # A stand-in deployment that meets the SLO for 95 % of requests up to 2 req/s offered and
    # for half of them above: the search offers the midpoint 2 (passes), then 4 (fails); 1, below a
    # passing midpoint, is never offered (report.sla_goodput); goodput = 2's window.
    sc = _tiny(seconds=10.0, warmup_s=5.0, rate_min=1.0, rate_max=4.0, probes=3)
    from pddgw.sim import run as sim_run

    class FakeRun:
        def __init__(self, rate):
            self.requests = [_req(i, 0.0, 0.1) for i in range(int(rate * 15))]
            self.duration_s = 20.0
            self.wall_s = 0.0
            self.decided = rate > 2.0                        # as a probe settled early reports it

    def fake_probe(sc_, job, rate):
        n = int(rate * 10)                                   # arrivals in the 10 s window
        met = round(0.95 * n) if rate <= 2.0 else n // 2
        # Settled out of reach above 2 req/s: the window's counts are then the verdict's bounds.
        return (report.Window(n, met, 10.0, report.Misses(ttft=1, tpot=n - met - 1), bound=rate > 2.0),
                FakeRun(rate))

    monkeypatch.setattr(sim_run, "goodput_probe", fake_probe)
    # The plain bisection (the roofline's start is pinned below, with its own stand-in).
    monkeypatch.setattr(sim_run, "start_rate", lambda spec, capacity: None)
    out = run_job(sc, Job("goodput", "same-dc", None), progress=True)
    # One line per probe as it ends, on stderr (the JSON report stays free of wall-clock figures).
    assert capsys.readouterr().err.splitlines() == [
        f"pddgw sim: goodput same-dc: probe {i} of at most 3 at {r:g} req/s: {what}, missed: 0 failed, 1 TTFT, "
        f"{tpot} TPOT, 0 E2E; {k} requests simulated in 0.0 s"
        for i, r, what, tpot, k in (
            (1, 2, "attainment 0.950 of 20 window requests", 0, 30),
            (2, 4, "attainment at most 0.500 of at most 40 window requests (settled early, out of reach)", 19, 60))]
    assert [p["rate"] for p in out["probes"]] == [2.0, 4.0]
    assert [p["attainment"] for p in out["probes"]] == [0.95, 0.5]
    # At 2 req/s offered, 20 arrivals in 10 s, 19 within SLO: 1.9 requests per second.
    assert (out["goodput_offered_rps"], out["goodput_rps"]) == (2.0, 1.9)
    assert [p["slo_rps"] for p in out["probes"]] == [1.9, 2.0]
    assert [p["achieved_rps"] for p in out["probes"]] == [1.5, 3.0]     # served / 20 s
    assert [p["decided_early"] for p in out["probes"]] == [False, True]
    assert [p["window_bound"] for p in out["probes"]] == [False, True]
    # The lowest failing offer and what gave out there: the report's "fails at" rows.
    assert out["goodput_fail"] == {"offered_rps": 4.0, "attainment": 0.5,
                                   "misses": {"failed": 0, "ttft": 1, "tpot": 19, "e2e": 0}}


def test_a_window_verdict_settles_exactly_when_the_target_is_out_of_reach():
    # Window [10, 20), at most 10 requests, target 0.7.  `warm` arrives before the window: at
    # most 9 can be in it, and the third miss leaves at most 6 of 9.
    slo = SloSpec(ttft_s=1.0, tpot_ms=50.0, attainment=0.7)
    v = report.WindowVerdict(slo, 0.7, 10.0, 20.0, most=10)
    warm, late, slow = _req(0, 9.0, None), _req(1, 10.0, None), _req(2, 10.5, 0.2, tpot=0.06)
    for r in (warm, late, slow):
        v.arrived(r)
    assert v.most == 9
    v.finished(slow)                                       # TPOT 60 ms: the first miss
    v.arrived(_req(3, 11.0, None))                         # `late` is 1.0 s old, not past 1.0 s yet
    assert v.missed == 1
    v.arrived(_req(4, 11.5, None))                         # `warm` (before the window) is not counted
    assert v.missed == 2 and v.window() == report.Window(9, 7, 10.0, report.Misses(ttft=1, tpot=1), bound=True)
    late.ttft_s, late.e2e_s = 1.5, 2.0
    v.finished(late)                                       # counted once, at its deadline, not again
    assert v.missed == 2
    v.finished(_req(5, 12.0, 0.1))                         # met
    with pytest.raises(Decided, match="3 of at most 9 window requests missed the SLO"):
        v.finished(_req(6, 12.5, None, error="node_lost: x"))
    assert v.window().attainment == 6 / 9
    # `late` ended with its first token past the deadline: still a TTFT miss; the error a failure.
    assert v.window().misses == report.Misses(failed=1, ttft=1, tpot=1)


def test_a_request_counted_late_at_its_deadline_ends_as_its_own_cause():
    # Counted as a TTFT miss once a later arrival finds it past 1 s without a first token; it
    # then fails: the complete window says "failed", as window_goodput of the same requests.
    slo = SloSpec(ttft_s=1.0, tpot_ms=50.0, attainment=0.1)
    v = report.WindowVerdict(slo, 0.1, 10.0, 20.0, most=3)
    late, ok = _req(0, 10.0, None), _req(1, 11.5, None)
    v.arrived(late)
    v.arrived(ok)
    assert v.window().misses == report.Misses(ttft=1)
    late.error = "node_lost: p0"
    v.finished(late)
    assert v.window().misses == report.Misses(failed=1) and v.missed == 1
    ok.ttft_s = 0.2
    v.finished(ok)
    with pytest.raises(Decided, match="all 2 window requests have ended"):
        v.arrived(_req(2, 20.0, None))
    assert v.window() == report.window_goodput([late, ok], slo, 10.0, 20.0) == report.Window(
        2, 1, 10.0, report.Misses(failed=1))


def test_an_arrival_after_the_window_tightens_the_verdict_s_bound():
    # At most 5 in [10, 20), target 0.8: one miss leaves 4 of 5 (0.8, still in reach); a request
    # arriving at 20 s is not one of them, which leaves at most 3 of 4.
    slo = SloSpec(ttft_s=1.0, tpot_ms=50.0, attainment=0.8)
    v = report.WindowVerdict(slo, 0.8, 10.0, 20.0, most=5)
    v.arrived(miss := _req(0, 10.0, 0.2, tpot=0.06))
    v.arrived(_req(1, 15.0, None))
    v.finished(miss)
    assert (v.missed, v.most) == (1, 5)
    with pytest.raises(Decided, match="1 of at most 4 window requests missed the SLO"):
        v.arrived(_req(2, 20.0, None))
    assert v.window() == report.Window(4, 3, 10.0, report.Misses(tpot=1), bound=True)


def test_a_window_verdict_settles_exactly_when_every_window_request_has_ended():
    slo = SloSpec(ttft_s=1.0, tpot_ms=50.0, attainment=0.5)
    v = report.WindowVerdict(slo, 0.5, 10.0, 20.0, most=10)
    early, a, b = _req(0, 9.5, None), _req(1, 10.0, None), _req(2, 19.0, None)
    for r in (early, a):
        v.arrived(r)
    a.ttft_s = 0.1
    v.finished(a)                                           # met
    v.arrived(b)
    v.arrived(_req(3, 20.0, None))                          # past the window; `b` is still open
    assert not v.complete
    early.ttft_s = 0.1
    v.finished(early)                                       # before the window: not counted
    b.ttft_s, b.tpot_s = 0.2, 0.06
    with pytest.raises(Decided, match="all 2 window requests have ended"):
        v.finished(b)                                       # TPOT 60 ms: missed; the window is complete
    assert v.complete and v.window() == report.Window(2, 1, 10.0, report.Misses(tpot=1))


def test_an_overloaded_probe_stops_once_settled_with_the_whole_runs_verdict():
    # 40 req/s into one tiny deployment with a 20 ms TTFT SLO: most of the window misses.
    sc = dataclasses.replace(_tiny(seconds=2.0, warmup_s=1.0, rate_min=1.0, rate_max=40.0, probes=2),
                             slo=SloSpec(ttft_s=0.02, tpot_ms=50.0, attainment=0.9))
    cfg = deployment_config(sc, sc.deployment("same-dc"), None)
    w, run = run_probe(sc, cfg, 40.0)
    pw = probe_workload(sc, 40.0)
    whole = run_virtual(run_deployment(cfg, list(pw.conversations), pw.prefix))
    full = report.window_goodput(whole.requests, sc.slo, pw.start_s, pw.end_s)
    assert run.decided and not whole.decided and w.bound and not full.bound
    assert full.attainment <= w.attainment < 0.9             # the bound, and the same fail
    # Its bound on the window's requests: every turn, less those seen arriving outside it.
    assert full.requests <= w.requests < sum(len(c.turns) for c in pw.conversations if c.start_s < pw.end_s)
    assert len(run.requests) < len(whole.requests)
    # A probe that passes (the tiny scenario's own 1 s TTFT SLO) measures the whole run's window
    # exactly, and stops when its last window request ends: those before are the whole run's.
    sc = dataclasses.replace(sc, slo=load_scenario(TINY).slo)
    w1, run1 = run_probe(sc, cfg, 1.0)
    pw1 = probe_workload(sc, 1.0)
    whole1 = run_virtual(run_deployment(cfg, list(pw1.conversations), pw1.prefix))
    assert w1 == report.window_goodput(whole1.requests, sc.slo, pw1.start_s, pw1.end_s)
    assert w1.attainment == 1.0 and w1.requests > 0 and not w1.bound
    same = {r.rid: (r.ttft_s, r.e2e_s, r.output_digest) for r in whole1.requests}
    assert [(r.ttft_s, r.e2e_s, r.output_digest) for r in run1.requests] == [same[r.rid] for r in run1.requests]
    assert run1.decided == (len(run1.requests) < len(whole1.requests))


def test_a_probe_settled_early_ends_its_pending_alignments_without_failing_them():
    # At 8 req/s the tiny PDD deployment's probe settles while MD alignments are still moving
    # KV; the run stops there.  Its links were up: stopping ends those alignments (each one's
    # cleanup run), instead of the closing links failing each as a lost node.
    sc = _tiny(seconds=20.0, warmup_s=10.0, rate_min=0.5, rate_max=8.0, probes=2)
    with capture_logs() as logs:
        w, run = goodput_probe(sc, Job("goodput", "pdd", 1.0), 8.0)
    assert run.decided and run.alignments["started"] > run.alignments["completed"]
    events = [e["event"] for e in logs]
    assert "md_alignment_failed" not in events and "node_lost" not in events
    abandoned = [e["count"] for e in logs if e["event"] == "md_alignments_abandoned"]
    assert abandoned == [run.alignments["started"] - run.alignments["completed"] - run.alignments["superseded"]
                         - run.alignments["failed"] - run.alignments["shed"]]


def test_the_roofline_prunes_a_probe_out_of_reach_and_the_search_ends_where_it_would(monkeypatch):
    # Tiny PDD at 1 Gbps: at 512 req/s the WAN and RLD's relay slots bound the window's
    # attainment at 0.689 (plan_bounds.met_bound: 0.689 of the window fits), under the 0.9 target, so the
    # probe is not simulated; the search takes the branch the simulation takes, to the same goodput.
    from pddgw.sim import run as sim_run
    sc = _tiny(seconds=4.0, warmup_s=1.0, rate_min=0.5, rate_max=512.0, probes=3)
    job = Job("goodput", "pdd", 1.0)
    pruned = run_job(sc, job)
    # The midpoint, then rate_max (report.sla_goodput), once the midpoint passed; rate_min never.
    assert [(p["rate"], p["simulated"]) for p in pruned["probes"]] == [(16.0, True), (512.0, False)]
    assert pruned["probes"][1] == {"rate": 512.0, "attainment": 0.0, "simulated": False, "attainment_bound": 0.689}
    monkeypatch.setattr(sim_run, "deployment_bound", lambda *a: None)      # every probe simulated
    whole = run_job(sc, job)
    # Simulated, it fails too (settled early: its attainment is then the verdict's bound).
    assert whole["probes"][1]["simulated"] and whole["probes"][1]["attainment"] < 0.9
    assert (whole["goodput_rps"], whole["goodput_offered_rps"]) == (pruned["goodput_rps"],
                                                                    pruned["goodput_offered_rps"])
    for a, b in zip(pruned["probes"][:1], whole["probes"][:1]):
        assert {**a, "attainment_bound": 1.0} == {**b, "attainment_bound": 1.0}
    assert pruned["_requests"] < whole["_requests"]


def test_a_scenario_deployment_is_bounded_as_its_kind_or_not_at_all():
    sc = load_scenario(Path(__file__).parents[2] / "scenarios" / "paper.toml")
    kinds = {d.name: getattr(deployment_bound(sc, d, 10.0), "kind", None) for d in sc.deployments}
    assert kinds == {"same-dc-pd": "same-dc", "naive-cross-dc": "naive-cross-dc", "pdd": "pdd"}
    # The bound reads the deployment's own groups (naive's P: one DP24 H100 instance).
    naive = deployment_bound(sc, sc.deployment("naive-cross-dc"), 10.0)
    assert naive.groups == sc.deployment("naive-cross-dc").nodes
    assert [(g.count, g.data_parallel) for g in naive.groups if g.role == "prefill"] == [(1, 24)]
    # Groups of one role add up: two groups of one instance bound as one group of two, side by side.
    tiny = load_scenario(TINY)
    dep = tiny.deployment("pdd")
    p, rld, md = dep.nodes
    two = dataclasses.replace(dep, nodes=(dataclasses.replace(p, count=2), rld, md))
    split = dataclasses.replace(dep, nodes=(p, rld, p, md))
    at, prof, d = Setting(tiny, 1.0, dep.policy.rld_max_relays), model(tiny.model), demand(tiny, 64.0)
    assert (capacity(at, prof, deployment_bound(tiny, split, 1.0), d).sides
            == capacity(at, prof, deployment_bound(tiny, two, 1.0), d).sides)
    assert (met_bound(at, prof, deployment_bound(tiny, split, 1.0), d)
            == met_bound(at, prof, deployment_bound(tiny, two, 1.0), d))
    naive_dep = sc.deployment("naive-cross-dc")
    caching = dataclasses.replace(naive_dep, nodes=tuple(dataclasses.replace(g, prefix_cache=True)
                                                         for g in naive_dep.nodes))
    assert deployment_bound(sc, caching, 10.0).kind == "pdd"          # lacks only the uncached
    pdd = sc.deployment("pdd")
    for pipeline in ("P-RLD", "P-RLD-MD", "P-MD"):
        forced = dataclasses.replace(pdd, policy=dataclasses.replace(pdd.policy, pipeline=pipeline))
        assert deployment_bound(sc, forced, 10.0) is None


def _search(passing: float, start: float | None, spec: GoodputSpec) -> tuple[float, list[float]]:
    """`goodput.bisect` on a stand-in deployment that passes up to `passing` req/s offered ->
    (the offered goodput, the rates simulated in order)."""
    def simulate(rate: float) -> tuple[report.Window, float, bool]:
        return report.Window(100, 100 if rate <= passing else 50, 10.0), rate, False

    _, offered, probes = bisect(spec, Prober(0.9, simulate, lambda r: 1.0), start)
    return round(offered, 4), [round(p.rate, 4) for p in probes]


def test_a_search_started_where_the_goodput_lies_simulates_two_probes():
    spec = GoodputSpec(seconds=10.0, warmup_s=1.0, rate_min=1.0, rate_max=16.0, probes=6)
    grid = report.bisection_rates(1.0, 16.0, 6)       # 1 x 16^(i/16), i = 0..16
    # Without a start: the midpoints 4, 8 (fails), 5.66, 6.73 (passes); with the start at the
    # answer, only it and the rate above it, which fails; every midpoint is then settled.
    assert _search(7.0, None, spec) == (6.7272, [4.0, 8.0, 5.6569, 6.7272])
    assert _search(7.0, grid[11], spec) == (6.7272, [6.7272, 8.0])
    # A start below the answer: it passes, the rate above passes too, and the bisection takes
    # over above them (4 is settled by the start's pass; 8 fails); a start above: it fails,
    # the rate below fails too, and the bisection goes on below them.
    assert _search(7.0, grid[10], spec) == (6.7272, [5.6569, 6.7272, 8.0])
    assert _search(7.0, grid[13], spec) == (6.7272, [9.5137, 8.0, 4.0, 5.6569, 6.7272])
    # The ends: a start at the grid's top passes and there is nothing above; at the bottom it
    # fails and the goodput is 0.
    assert _search(99.0, grid[-1], spec) == (16.0, [16.0])
    assert _search(0.5, grid[0], spec) == (0.0, [1.0])
    # Whatever the start, a monotone attainment's answer is the grid's highest passing rate, and
    # a start costs at most two probes more than the bisection.
    for passing in [0.5, *grid, *(r * 1.01 for r in grid), 99.0]:
        plain, probed = _search(passing, None, spec)
        assert plain == round(max((r for r in grid if r <= passing), default=0.0), 4)
        for start in grid:
            offered, with_start = _search(passing, start, spec)
            assert offered == plain and len(with_start) <= len(probed) + 2


def test_the_search_starts_at_the_highest_grid_rate_the_roofline_capacity_reaches():
    spec = GoodputSpec(seconds=10.0, warmup_s=1.0, rate_min=1.0, rate_max=16.0, probes=6)
    grid = report.bisection_rates(1.0, 16.0, 6)
    assert start_rate(spec, lambda r: 7.0) == grid[11] and round(grid[11], 4) == 6.7272      # 16^(11/16)
    # At the capacity itself, or the rate below it when the capacity falls short by a hair.
    assert start_rate(spec, lambda r: grid[11]) == grid[11]
    assert start_rate(spec, lambda r: grid[11] * 0.999) == grid[10]
    # The capacity read at each rate (it shifts with the rate's workload): 8 > 7.9.
    assert start_rate(spec, lambda r: 8.5 - r / 16) == 8.0
    # A capacity at the top or above: one step below it (the top, meant to fail, second).
    assert start_rate(spec, lambda r: 16.0) == grid[-2] and start_rate(spec, lambda r: 99.0) == grid[-2]
    # Nothing to say: the capacity does not reach even the bottom.
    assert start_rate(spec, lambda r: 0.9) is None
    assert start_rate(spec, lambda r: 1.0) == 1.0
    # The paper scenario: PDD and same-DC are bound by their decode (~23.4 req/s; their two DP24
    # H100 P carry ~26 with the FP4 experts W4A16 at the MoE prefill efficiency; PDD's WAN at
    # 10 Gbps ~29.4); naive at 100 Gbps by its one DP24 P (~13), at 10 Gbps by its WAN's 3.46.
    sc = load_scenario(Path(__file__).parents[2] / "scenarios" / "paper.toml")
    prof = model(sc.model)
    starts = {}
    for dep in sc.deployments:
        for wan in (10.0, 100.0):
            cand = deployment_bound(sc, dep, wan if sc.uses_wan(dep) else None)
            at = Setting(sc, wan if sc.uses_wan(dep) else None, dep.policy.rld_max_relays)
            starts[dep.name, wan] = round(start_rate(sc.goodput,
                                                     lambda r: capacity(at, prof, cand, demand(sc, r)).rate), 4)  # noqa: B023
    assert starts == {("same-dc-pd", 10.0): 22.6274, ("same-dc-pd", 100.0): 22.6274,
                      ("naive-cross-dc", 10.0): 3.3636, ("naive-cross-dc", 100.0): 11.3137,
                      ("pdd", 10.0): 22.6274, ("pdd", 100.0): 22.6274}
