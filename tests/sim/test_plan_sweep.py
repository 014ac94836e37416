"""`pddgw plan --sweep`: the payoff map on the tiny plan (2 GPU-B parts, 2 price ratios, 1 WAN).

The price axis costs no simulation: each (GPU-B, WAN, hit) is searched once and its
evaluations repriced per ratio."""

import dataclasses
import math
from collections import Counter
from pathlib import Path

import orjson
import pytest

from pddgw.config import ConfigError
from pddgw.sim import plan_search, plan_sweep
from pddgw.sim.plan import main as plan_main
from pddgw.sim.plan_space import candidates, load_plan
from pddgw.sim.profiles import model
from pddgw.sim.plan_sweep import (cells, format_sweep, gpu_b_price, search_all, sweep, sweep_json, sweep_spec,
                                  with_hit)

HERE = Path(__file__).parent
TINY = HERE / "plan_tiny.toml"
SWEEP = """
[sweep]
gpu_b = ["H200-SXM", "H100-SXM"]
price_ratios = [1.0, 1.25]
market = false
wan_gbps = [10.0]
"""
SAME = "P 2 x H100-SXM tp1 | MD 1 x H100-SXM tp1"


def _plan(tmp_path: Path, sweep_toml: str = SWEEP) -> Path:
    (tmp_path / "tiny.toml").write_text((HERE / "tiny.toml").read_text())
    p = tmp_path / "plan.toml"
    p.write_text(TINY.read_text() + sweep_toml)
    return p


def _counted(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Every simulated probe, by (the WAN and MD part it ran at, the split, the rate)."""
    calls: Counter = Counter()
    real = plan_search.simulate_probe

    def counting(plan, cand, rate):
        md = cand.group("md")
        calls[(plan.wan_gbps if cand.kind != "same-dc" else None, md.hardware, cand.kind, cand.label(), rate)] += 1
        return real(plan, cand, rate)

    monkeypatch.setattr(plan_search, "simulate_probe", counting)
    return calls


def _goodputs(searches):
    return [(s.gpu_b, [(e.candidate, e.goodput_rps) for e in s.evaluations]) for s in searches]


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
    plan = load_plan(_plan(tmp_path_factory.mktemp("sweep")))
    with pytest.MonkeyPatch.context() as mp:
        calls = _counted(mp)
        sw = sweep(plan, jobs=1, cut=False)        # every candidate: the reference the cut must match
    return plan, sw, calls


def test_the_price_axis_costs_no_simulation(swept, monkeypatch):
    plan, sw, calls = swept
    # One same-DC search (no GPU-B, no WAN) and one cross-DC search per GPU-B: every probe
    # simulated once, none per price ratio.
    assert [(s.gpu_b, s.wan_gbps, s.hit) for s in sw.searches] == [(None, None, None), ("H200-SXM", 10.0, None),
                                                                   ("H100-SXM", 10.0, None)]
    assert set(calls.values()) == {1}
    assert sum(calls.values()) == sw.simulated_probes == 8 + 16 + 16
    assert len(sw.cells) == 2 * 2
    # One ratio or two: the same simulations.
    one = dataclasses.replace(plan, spec=dataclasses.replace(
        plan.spec, sweep=dataclasses.replace(plan.spec.sweep, price_ratios=(1.0,))))
    again = _counted(monkeypatch)
    assert _goodputs(search_all(one, jobs=1, cut=False)) == _goodputs(sw.searches)
    assert again == calls
    # Re-ranking by price reaches no simulator.
    monkeypatch.setattr(plan_search, "simulate_probe", lambda *a: pytest.fail("simulated while repricing"))
    assert cells(plan, sw.searches) == sw.cells


def test_the_cut_skips_what_cannot_win_at_any_price_and_keeps_every_cell(swept, tmp_path, monkeypatch):
    plan, sw, calls = swept
    # naive-cross-dc's goodput bound (3 req/s: the 10 Gbps WAN) per USD is below pdd's simulated
    # BCR at both ratios, and so are same-DC's second MD's (the P's bound, at one more GPU's price).
    # pdd's other three splits each fail one refuting probe: below 11.5 req/s on 2 P + RLD + MD
    # per USD at both ratios, whatever passes beneath it.
    cut_calls = _counted(monkeypatch)
    cut = sweep(plan, jobs=1)
    assert sweep_json(cut)["cells"] == sweep_json(sw)["cells"]
    assert cut.cells == sw.cells
    assert cut.simulated_probes == sum(cut_calls.values()) == 14 < sw.simulated_probes == sum(calls.values()) == 40
    assert set(cut_calls.values()) == {1}          # none twice (a refuting probe may be one the uncut skips)
    assert {k for k, _, _, _, _ in cut_calls} == {None, 10.0} and {c for _, _, c, _, _ in cut_calls} == {
        "same-dc", "pdd"}
    for search in cut.searches[1:]:
        b = search.gpu_b
        got = {e.candidate.label(): (e.goodput_rps, e.refuted_at, e.simulated_probes) for e in search.evaluations}
        r8, r11, r16 = 8.0, math.sqrt(8.0 * 16.0), 16.0          # the grid's top three rates
        assert got == {f"P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x {b} tp1": (None, r8, 1),
                       f"P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 2 x {b} tp1": (None, r11, 1),
                       f"P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x {b} tp1": (11.5, None, 2),
                       f"P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 2 x {b} tp1": (None, r16, 1)}
    assert sweep_json(cut)["searches"][1]["evaluated"][0] == {
        "kind": "pdd", "deployment": "P 1 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1",
        "goodput_rps": None, "simulated_probes": 1, "refuted_at_rps": 8.0}
    # With the market column (its own price to win at) and with workers: the same cells as uncut.
    market = load_plan(_plan(tmp_path, SWEEP.replace("market = false", "market = true")))
    monkeypatch.undo()
    ref = sweep(market, jobs=1, cut=False)
    got = sweep(market, jobs=2)
    assert sweep_json(got)["cells"] == sweep_json(ref)["cells"] and len(got.cells) == 2 * 3
    assert got.simulated_probes < ref.simulated_probes


def test_a_parts_searches_run_by_falling_wan_each_started_at_the_offer_one_wan_up(tmp_path, monkeypatch):
    """Goodput does not fall as the WAN widens, so a split's offer at 100 Gbps is where its
    bisection at 1 Gbps starts (below the roofline's start); the cells are the uncut sweep's."""
    plan = load_plan(_plan(tmp_path, SWEEP.replace('["H200-SXM", "H100-SXM"]', '["H200-SXM"]')
                           .replace("[10.0]", "[1.0, 100.0]")))
    plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, kinds=("same-dc", "pdd")))
    ref = sweep(plan, jobs=1, cut=False)
    real, seen = plan_sweep.evaluate, []

    def recording(p, cand, **kw):
        e = real(p, cand, **kw)
        hint = None if kw["hint"] is None else round(kw["hint"], 4)
        seen.append((p.wan_gbps, cand.label(), hint, [round(q.rate, 4) for q in e.probes]))
        return e

    monkeypatch.setattr(plan_sweep, "evaluate", recording)
    cut = sweep(plan, jobs=1)
    assert cut.cells == ref.cells and [c.payoff for c in cut.cells] == [c.payoff for c in ref.cells]
    assert [(s.gpu_b, s.wan_gbps) for s in cut.searches] == [(None, None), ("H200-SXM", 1.0), ("H200-SXM", 100.0)]
    # 100 Gbps first, without hints: pdd's 2-P split passes 16 req/s (the grid's top), and the
    # others' bounds per USD fall below it but one, refuted.  At 1 Gbps its hint is that offer
    # (above the roofline's start, 11.31, which goes first); the goodput is the uncut sweep's.
    # Its 2-MD sibling has no offer one WAN up; it takes the offer of the split with the same
    # P and RLD found here (11.31), and fails its refuting probe above that start.
    pdd = "P {} x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD {} x H200-SXM tp1"
    assert [x for x in seen if x[0] != 10.0] == [
        (100.0, pdd.format(2, 1), None, [11.3137, 16.0]), (100.0, pdd.format(1, 1), None, [16.0]),
        (1.0, pdd.format(2, 1), 16.0, [11.3137, 16.0]), (1.0, pdd.format(1, 1), None, [8.0]),
        (1.0, pdd.format(2, 2), 11.3137, [16.0]), (1.0, pdd.format(1, 2), None, [11.3137])]
    assert cut.simulated_probes == 12 < ref.simulated_probes == 8 + 2 * 8


def test_a_hint_moves_the_first_probe_not_the_goodput():
    plan = load_plan(TINY)
    cand = next(c for c in candidates(plan, model(plan.scenario.model), "same-dc") if c.label() == SAME)
    plain = plan_search.evaluate(plan, cand)
    hinted = plan_search.evaluate(plan, cand, hint=9.0)           # off the grid: 8.0, the rate below
    high = plan_search.evaluate(plan, cand, hint=1000.0)          # above the roofline's start: ignored
    assert (plain.goodput_rps, plain.offered_rps) == (hinted.goodput_rps, hinted.offered_rps) == (16.5, 16.0)
    assert [round(p.rate, 4) for p in plain.probes] == [round(p.rate, 4) for p in high.probes] == [11.3137, 16.0]
    assert [round(p.rate, 4) for p in hinted.probes] == [8.0, 11.3137, 16.0]


def test_the_cells_and_their_bcr_by_hand(swept):
    _, sw, _ = swept
    same = {e.candidate.label(): e.goodput_rps for e in sw.searches[0].evaluations}
    assert same == {"P 1 x H100-SXM tp1 | MD 1 x H100-SXM tp1": 8.75, "P 1 x H100-SXM tp1 | MD 2 x H100-SXM tp1": 8.75,
                    SAME: 16.5, "P 2 x H100-SXM tp1 | MD 2 x H100-SXM tp1": 16.5}
    for search in sw.searches[1:]:
        b = search.gpu_b
        got = {(e.candidate.kind, e.candidate.label()): e.goodput_rps for e in search.evaluations}
        assert got == {("naive-cross-dc", f"P {p} x H100-SXM tp1 | MD {m} x {b} tp1"): 1.25
                       for p in (1, 2) for m in (1, 2)} | {
                      ("pdd", f"P {p} x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD {m} x {b} tp1"): g
                      for p, g in ((1, 6.25), (2, 11.5)) for m in (1, 2)}
    rows = [(c.gpu_b, c.ratio, c.gpu_b_price, c.cross.kind, c.cross.label, c.same.label) for c in sw.cells]
    assert rows == [(b, r, 3.0 * r, "pdd", f"P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x {b} tp1", SAME)
                    for b in ("H200-SXM", "H100-SXM") for r in (1.0, 1.25)]
    for c in sw.cells:
        # 11.5 req/s on 2 P + 1 RLD at $3/GPU-h and 1 MD at ratio x $3; same-DC 16.5 req/s on 3 x $3.
        assert c.cross.price == 9.0 + 3.0 * c.ratio and c.cross.goodput_rps == 11.5
        assert c.same.price == 9.0 and c.same.goodput_rps == 16.5
        assert c.payoff == pytest.approx((11.5 / (9.0 + 3.0 * c.ratio)) / (16.5 / 9.0), rel=1e-12)
        # The best split at these prices: no evaluated cross-DC split does better per USD.
        search = next(s for s in sw.searches if s.gpu_b == c.gpu_b)
        for e in search.evaluations:
            usd = sum(g.gpus * (3.0 if g.cluster == "A" else 3.0 * c.ratio) for g in e.candidate.groups)
            assert e.goodput_rps / usd <= c.cross.bcr
    assert [round(c.payoff, 4) for c in sw.cells] == [0.5227, 0.492, 0.5227, 0.492]


def test_the_command_prints_the_map_and_writes_json_and_a_heatmap(tmp_path, capsys):
    p = _plan(tmp_path)
    out = tmp_path / "out"
    assert plan_main(["--plan", str(p), "--sweep", "--jobs", "1", "--out", str(out), "--json"]) == 0
    js = orjson.loads(capsys.readouterr().out)
    assert js == orjson.loads((out / "payoff.json").read_bytes())
    assert list(js) == ["plan", "scenario", "model", "gpu_a", "cross_dc_kinds", "axes", "simulated_probes",
                        "searches", "cells"]
    assert js["gpu_a"] == {"hardware": "H100-SXM", "price_per_gpu_hour": 3.0}
    assert js["cross_dc_kinds"] == ["naive-cross-dc", "pdd"]
    assert js["axes"] == {"gpu_b": ["H200-SXM", "H100-SXM"], "price_ratio": [1.0, 1.25], "wan_gbps": [10.0],
                          "prefix_hit": None}
    assert js["simulated_probes"] == 14 and len(js["searches"]) == 3 and len(js["cells"]) == 4
    assert js["cells"][1] == {
        "gpu_b": "H200-SXM", "price_ratio": 1.25, "gpu_b_price_per_gpu_hour": 3.75, "wan_gbps": 10.0,
        "prefix_hit": None,
        "cross_dc": {"kind": "pdd", "deployment": "P 2 x H100-SXM tp1 | RLD 1 x H100-SXM tp1 | MD 1 x H200-SXM tp1",
                     "goodput_rps": 11.5, "price_per_hour": 12.75, "goodput_per_usd_hour": round(11.5 / 12.75, 6)},
        "same_dc": {"kind": "same-dc", "deployment": SAME, "goodput_rps": 16.5, "price_per_hour": 9.0,
                    "goodput_per_usd_hour": round(16.5 / 9.0, 6)},
        "payoff": round((11.5 / 12.75) / (16.5 / 9.0), 4)}
    png = out / "payoff_llama3-8b.png"
    assert png.stat().st_size > 0


def test_the_relay_on_p_is_of_the_pdd_family(tmp_path):
    """A cross-DC kind like the others: searched per GPU-B and WAN, and its split wins a cell where
    its BCR is the family's best (12 req/s for $9.75/h against PDD's 11.5 for $12.75/h)."""
    p = _plan(tmp_path, SWEEP.replace('["H200-SXM", "H100-SXM"]', '["H200-SXM"]').replace("[1.0, 1.25]", "[1.25]"))
    old = 'kinds = ["same-dc", "naive-cross-dc", "pdd"]'
    assert old in p.read_text()
    p.write_text(p.read_text().replace(old, 'kinds = ["same-dc", "pdd", "pdd-relay-on-p"]'))
    sw = sweep(load_plan(p), jobs=1)
    assert sweep_json(sw)["cross_dc_kinds"] == ["pdd", "pdd-relay-on-p"]
    [cross] = [s for s in sw.searches if s.gpu_b is not None]
    assert {e.candidate.kind for e in cross.evaluations} == {"pdd", "pdd-relay-on-p"}
    [cell] = sw.cells
    assert (cell.cross.kind, cell.cross.label, cell.cross.goodput_rps, cell.cross.price) == (
        "pdd-relay-on-p", "P+RLD 2 x H100-SXM tp1 | MD 1 x H200-SXM tp1", 12.0, 9.75)
    assert cell.same.label == SAME and cell.payoff == pytest.approx((12.0 / 9.75) / (16.5 / 9.0), rel=1e-12)
    assert "relay-p: P+RLD 2 x H100-SXM tp1 | MD 1 x H200-SXM tp1" in format_sweep(sw)


def test_the_table_has_a_row_per_cell_with_the_winning_split_and_the_payoff(swept):
    lines = format_sweep(swept[1]).splitlines()
    assert len(lines) == 2 + 2 + 4
    assert lines[0].endswith("40 probes simulated, none per price")
    row = next(line for line in lines if " H200-SXM       1.25 " in line)
    assert row.split() == ["10", "workload's", "H200-SXM", "1.25", "3.75", "pdd:", "P", "2", "x", "H100-SXM", "tp1",
                           "|", "RLD", "1", "x", "H100-SXM", "tp1", "|", "MD", "1", "x", "H200-SXM", "tp1", "11.5",
                           "12.75", "same-dc:", "P", "2", "x", "H100-SXM", "tp1", "|", "MD", "1", "x", "H100-SXM",
                           "tp1", "16.5", "9.00", "0.492"]


def test_a_part_without_a_price_is_refused_unless_the_ratio_sets_it(tmp_path, capsys):
    p = _plan(tmp_path, SWEEP.replace('"H100-SXM"]', '"H20"]').replace("market = false", "market = true"))
    assert plan_main(["--plan", str(p), "--sweep", "--jobs", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pddgw plan: error: sweep: market: prices.H20: no price for hardware 'H20'")
    assert err.count("\n") == 1 and not (tmp_path / "o").exists()
    # Without the market column the ratio prices it.
    plan = load_plan(_plan(tmp_path, SWEEP.replace('"H100-SXM"]', '"H20"]')))
    assert gpu_b_price(plan, "H20", 1.25, 3.0) == 3.75


def test_the_hit_axis_sets_every_follow_up_turns_hit_and_needs_an_agentic_workload(tmp_path):
    plan = load_plan(_plan(tmp_path, SWEEP + "prefix_hits = [0.5, 0.9]\n"))
    assert sweep_spec(plan).prefix_hits == (0.5, 0.9)
    assert with_hit(plan.scenario, 0.9).workload.agentic.hit_buckets == ((1.0, 0.9, 0.9),)
    trace = dataclasses.replace(plan, scenario=dataclasses.replace(
        plan.scenario, workload=dataclasses.replace(plan.scenario.workload, kind="trace")))
    with pytest.raises(ConfigError, match=r"^sweep\.prefix_hits: a trace workload has no prefix-hit knob"):
        sweep_spec(trace)


@pytest.mark.parametrize("old,new,message", [
    ("wan_gbps = [10.0]", "wan_gbpss = [10.0]", "sweep.wan_gbpss: unknown key"),
    ('"H100-SXM"]', '"B300"]', "gpu_b: hardware 'B300' is not one of"),
    ("[1.0, 1.25]", "[0.0, 1.25]", "price_ratios must be > 0"),
])
def test_bad_sweep_keys_are_refused_with_the_key_named(tmp_path, old, new, message):
    with pytest.raises(ConfigError, match=message):
        load_plan(_plan(tmp_path, SWEEP.replace(old, new)))


def test_a_plan_without_a_sweep_table_is_refused_in_one_line(capsys):
    assert plan_main(["--plan", str(TINY), "--sweep"]) == 2
    err = capsys.readouterr().err
    assert err == ("pddgw plan: error: plan tiny: --sweep needs a [sweep] table (gpu_b, price_ratios, market, "
                   "wan_gbps, prefix_hits)\n")


@pytest.mark.parametrize("name,model", [("map_v4pro.toml", "deepseek-v4-pro"),
                                        ("map_v4flash.toml", "deepseek-v4-flash")])
def test_the_shipped_payoff_maps_load_and_name_their_grid(name, model):
    """docs/results/payoff.md's plans: 4 GPU-B x 3 WANs x 6 price ratios, the relay on P against
    same-DC; no market column (H20 has no shipped price)."""
    plan = load_plan(HERE.parents[1] / "scenarios" / name)
    s = sweep_spec(plan)
    assert plan.scenario.model == model and plan.spec.searched == ("same-dc", "pdd-relay-on-p")
    assert (s.gpu_b, s.wan_gbps, s.ratios) == (("H200-SXM", "H20", "B200", "MI300X"), (1.0, 10.0, 100.0),
                                               (1.0, 1.1, 1.2, 1.3, 1.4, 1.5))
    assert s.market is False


def test_the_shipped_prefix_hit_slice_loads_with_its_axis():
    plan = load_plan(HERE.parents[1] / "scenarios" / "map_v4pro_hits.toml")
    s = sweep_spec(plan)
    assert plan.scenario.model == "deepseek-v4-pro" and plan.spec.searched == ("same-dc", "pdd-relay-on-p")
    assert (s.gpu_b, s.wan_gbps, s.ratios, s.hits) == (("H200-SXM", "B200"), (10.0,), (1.0, 1.2, 1.5),
                                                       (0.5, 0.8, 0.95))
