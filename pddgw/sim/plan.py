"""`pddgw plan`: size deployments for a model, hardware menu, budget, links, workload and SLOs.

    pddgw plan --plan scenarios/plan_paper.toml [--jobs 2] [--out DIR] [--json]
               [--kinds KIND ...] [--trace T.jsonl] [--wan-gbps G] [--exhaustive] [--dry-run]
    pddgw plan --plan P.toml --sweep [--jobs 2] [--out DIR] [--json]

A plan (`plan_space`: TOML, unknown keys refused naming the key) names a
scenario and the space: hardware per cluster with prices, GPU and USD
budgets, per role the counts and parallelism shapes.  For each deployment
kind (same-DC PD, naive cross-DC PD, cross-DC PD with MD's prefix cache,
PDD, PDD with P relaying; `plan_space.KINDS`) the planner searches role counts and shapes for
the highest SLA goodput per USD per hour (`plan_search`): the roofline
prunes the rates a split cannot carry (`plan_bounds`), the survivors run on
the simulator's virtual clock.  It prints a ranked table per kind and, with
`--out DIR`, writes

  DIR/config.toml          the overall winner, ready for `pddgw serve`
  DIR/KIND.config.toml     each kind's winner
  DIR/deployments.toml     each kind's winner as scenario [[deployments]] blocks

`--dry-run` prints the candidates and their roofline bounds without
simulating.  `--sweep` maps the plan's `[sweep]` grid instead (`plan_sweep`: the payoff
map), writing DIR/payoff.json and DIR/payoff_<model>.png (DIR: `--out`, else
payoff-<plan name>).  The JSON report (`--json`) is deterministic: wall-clock figures
go to stderr only.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from pddgw.config import ConfigError
from pddgw.logs import setup_logging
from pddgw.sim.goodput import first_fail
from pddgw.sim.plan_bounds import Bound, Setting, capacity
from pddgw.sim.plan_search import Evaluation, KindResult, _Workloads, search, upper_bound, winner
from pddgw.sim.plan_space import KINDS, Plan, candidates, load_plan
from pddgw.sim.plan_sweep import format_sweep, sweep, sweep_json, write_sweep
from pddgw.sim.plan_write import config_toml, deployments_toml, serve_comment, serve_config
from pddgw.sim.profiles import model, uncalibrated, uncalibrated_line
from pddgw.sim.run import sim_parser
from pddgw.tables import format_table


def _bound_json(b: Bound) -> dict[str, Any]:
    return {"rate_cap_rps": round(b.rate, 4), "limit": b.side,
            "sides_rps": {k: round(v, 4) for k, v in sorted(b.sides.items())}}


def _fail(e: Evaluation) -> dict[str, Any] | None:
    return None if e.offered_rps is None else first_fail(e.probes, e.offered_rps)


def evaluation_json(e: Evaluation) -> dict[str, Any]:
    c = e.candidate
    return {"deployment": c.label(), "gpus": c.gpus, "gpus_by_cluster": {x: c.gpus_in(x) for x in
                                                                          sorted({g.cluster for g in c.groups})},
            "price_per_hour": round(c.price, 4), "roofline": _bound_json(e.roofline),
            "goodput_upper_rps": round(e.upper_rps, 4),
            "goodput_rps": None if e.goodput_rps is None else round(e.goodput_rps, 4),
            "goodput_offered_rps": None if e.offered_rps is None else round(e.offered_rps, 4),
            "goodput_per_usd_hour": round(e.per_usd, 6),
            "goodput_fail": _fail(e),
            "refuted_at_rps": None if e.refuted_at is None else round(e.refuted_at, 4),
            "probes": [p.json() for p in e.probes],
            "groups": [{"role": g.role, "count": g.count, "cluster": g.cluster, "hardware": g.hardware,
                        "tensor_parallel": g.tensor_parallel, "data_parallel": g.data_parallel,
                        "expert_parallel": g.expert_parallel} for g in c.groups]}


def _uncalibrated(plan: Plan) -> dict[str, str]:
    """The menu's parts with no calibration row (`profiles.uncalibrated`)."""
    return uncalibrated(opt.hardware for cs in plan.spec.clusters for opt in cs.hardware)


def report_json(plan: Plan, results: dict[str, KindResult]) -> dict[str, Any]:
    best = winner(results)
    guessed = _uncalibrated(plan)
    return {"plan": plan.spec.name, **({"uncalibrated_hardware": guessed} if guessed else {}),
            "scenario": plan.scenario.name, "model": plan.scenario.model,
            "wan_gbps": plan.wan_gbps, "slo": {"ttft_s": plan.slo.ttft_s, "tpot_ms": plan.slo.tpot_ms,
                                               "e2e_s": plan.slo.e2e_s, "attainment": plan.slo.attainment},
            "winner": {"kind": best.candidate.kind, **evaluation_json(best)},
            "kinds": {k: {"candidates": r.candidates, "evaluated": r.evaluated, "refuted": r.refuted,
                          "pruned_by_roofline": r.pruned, "bounded_out": r.bounded_out,
                          "simulated_probes": r.simulated_probes, "pruned_probes": r.pruned_probes,
                          "ranked": [evaluation_json(e) for e in r.ranked],
                          "also_evaluated": [evaluation_json(e) for e in _rest(r)]}
                      for k, r in results.items()}}


def _rest(r: KindResult) -> list[Evaluation]:
    """The evaluated candidates below the table, best first: refuted, or ranked out."""
    return [e for e in sorted(r.all_evaluations, key=Evaluation.key) if e not in r.ranked]


def _row(rank: int, e: Evaluation) -> list[Any]:
    c = e.candidate
    if e.refuted_at is not None:
        gp = f"< {e.upper_rps:.3g} (fails {e.refuted_at:.3g})"
    else:
        gp = "-" if e.goodput_rps is None else f"{e.goodput_rps:.3g}"
    offered = "-" if e.offered_rps is None else f"{e.offered_rps:.3g}"
    probes = f"{e.simulated_probes} / {len(e.probes) - e.simulated_probes}"
    fail = _fail(e)
    gave_out = "-" if fail is None else f"{fail['offered_rps']:.3g}: " + (
        " ".join(f"{k} {n}" for k, n in fail["misses"].items() if n) or "none")
    return [rank, c.label(), c.gpus, f"{c.price:.2f}", f"{e.roofline.rate:.3g} ({e.roofline.side})", gp, offered,
            gave_out, f"{e.per_usd * 100:.3g}", probes]


HEADS = ["#", "deployment", "GPUs", "$/h", "roofline cap (req/s)", "SLA goodput (req/s in SLO)", "at offered",
         "fails at: misses", "goodput per $100/h", "probes sim / pruned"]


def format_report(plan: Plan, results: dict[str, KindResult]) -> str:
    sc = plan.scenario
    wan = f"WAN {plan.wan_gbps:g} Gbps" if plan.wan_gbps is not None else "links as configured"
    lines = [f"pddgw plan {plan.spec.name}: scenario {sc.name}, model {sc.model}, {wan}; SLO ttft <= "
             f"{plan.slo.ttft_s} s, tpot <= {plan.slo.tpot_ms} ms, >= {plan.slo.attainment:.0%} of requests"]
    if guessed := _uncalibrated(plan):
        lines.append(uncalibrated_line(guessed))
    for kind, r in results.items():
        lines += ["", f"== {kind}: {r.candidates} candidates, {r.evaluated} evaluated ({r.refuted} refuted by one "
                      f"probe), {r.pruned} pruned by the roofline at every rate, {r.bounded_out} bounded out; "
                      f"{r.simulated_probes} probes simulated, {r.pruned_probes} pruned ==",
                  format_table(HEADS, [_row(i + 1, e) for i, e in enumerate(r.ranked)])]
        rest = _rest(r)
        if rest:
            lines += ["-- also evaluated, below the table (goodput per $100/h: the bound of those refuted) --",
                      format_table(HEADS, [_row(len(r.ranked) + i + 1, e) for i, e in enumerate(rest)])]
    best = winner(results)
    gp = best.goodput_rps or 0.0
    lines += ["", f"winner: {best.candidate.kind}, {best.candidate.label()}: {gp:.3g} req/s within SLO for "
                  f"${best.candidate.price:.2f}/h ({best.per_usd * 100:.3g} req/s per $100/h)"]
    return "\n".join(lines)


def format_dry_run(plan: Plan) -> str:
    """Every candidate with its roofline, no simulation."""
    prof = model(plan.scenario.model)
    work = _Workloads(plan)
    d = work(plan.goodput.rate_min)
    lines = [f"pddgw plan {plan.spec.name} --dry-run: the probe at {plan.goodput.rate_min:g} req/s: {d.requests} "
             f"requests ({d.surely} surely in its {d.seconds:g} s window), per request {d.mean(d.uncached):.0f} "
             f"uncached prompt tokens of {d.mean(d.prompt):.0f}, {d.mean(d.output):.0f} output tokens; the "
             "steady-state roofline per side (req/s) and the most requests per second within SLO the bisection "
             "could reach where the roofline allows"]
    if guessed := _uncalibrated(plan):
        lines.append(uncalibrated_line(guessed))
    for kind in plan.spec.searched:
        rows = []
        for c in candidates(plan, prof, kind):
            at = Setting.of(plan, c)
            b = capacity(at, prof, c, d)
            ub = upper_bound(at, prof, c, work)
            sides = " ".join(f"{k}={v:.3g}" for k, v in sorted(b.sides.items()))
            rows.append([c.label(), c.gpus, f"{c.price:.2f}", sides, f"{ub:.3g}", f"{ub / c.price * 100:.3g}"])
        rows.sort(key=lambda r: -float(r[5]))
        lines += ["", f"== {kind}: {len(rows)} candidates ==",
                  format_table(["deployment", "GPUs", "$/h", "roofline req/s per side", "goodput bound (req/s)",
                                "bound per $100/h"], rows)]
    return "\n".join(lines)


def write_outputs(plan: Plan, results: dict[str, KindResult], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    best = winner(results)
    written = []
    for kind, r in [("", None), *results.items()]:
        e = best if r is None else r.winner
        path = out / ("config.toml" if r is None else f"{kind}.config.toml")
        comment = serve_comment(plan, e.candidate, e.goodput_rps, path.name)
        path.write_text(config_toml(serve_config(plan, e.candidate), comment))
        written.append(path)
    path = out / "deployments.toml"
    path.write_text(deployments_toml(plan, [(r.winner.candidate, r.winner.goodput_rps) for r in results.values()]))
    return written + [path]


def _sweep(plan: Plan, out: str | None, jobs: int, as_json: bool) -> int:
    """`--sweep`: the payoff map (`plan_sweep`); its refusals raise before any simulation."""
    wall0 = time.perf_counter()
    sw = sweep(plan, jobs=jobs, progress=True)
    print(f"pddgw plan --sweep: {sw.simulated_probes} probes simulated in {time.perf_counter() - wall0:.1f} s of "
          "wall time", file=sys.stderr)
    for path in write_sweep(sw, Path(out or f"payoff-{plan.spec.name}")):
        print(f"pddgw plan: wrote {path}", file=sys.stderr)
    if as_json:
        sys.stdout.buffer.write(orjson.dumps(sweep_json(sw), option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(format_sweep(sw))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = sim_parser("pddgw plan", "Search role counts and parallelism per deployment kind for the highest SLA "
                   "goodput per USD per hour.", "--plan", "planner TOML (e.g. scenarios/plan_paper.toml)",
                   "size for this Mooncake-format trace instead of the scenario's workload")
    p.add_argument("--wan-gbps", type=float, help="override the plan's WAN bandwidth")
    p.add_argument("--kinds", nargs="+", choices=KINDS, help="search only these deployment kinds")
    p.add_argument("--exhaustive", action="store_true", help="brute force: simulate every candidate and probe")
    p.add_argument("--dry-run", action="store_true", help="print the candidates' roofline bounds, simulate nothing")
    p.add_argument("--out", help="write config.toml, KIND.config.toml and deployments.toml into this directory "
                   "(with --sweep: payoff.json and payoff_MODEL.png)")
    p.add_argument("--sweep", action="store_true", help="map the plan's [sweep] grid: cross-DC over same-DC BCR")
    args = p.parse_args(argv)
    setup_logging("warning")
    try:
        plan = load_plan(args.plan, trace=args.trace or "", wan_gbps=args.wan_gbps or 0.0)
        if args.kinds:
            plan = dataclasses.replace(plan, spec=dataclasses.replace(plan.spec, kinds=tuple(args.kinds)))
        if args.dry_run:
            print(format_dry_run(plan))
            return 0
        if args.sweep:
            return _sweep(plan, args.out, max(1, args.jobs), args.json)
        for kind in plan.spec.searched:         # budget and fit errors before any simulation
            candidates(plan, model(plan.scenario.model), kind)
    except (ConfigError, ValueError, KeyError) as e:
        print(f"pddgw plan: error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    wall0 = time.perf_counter()
    results = search(plan, exhaustive=args.exhaustive, jobs=max(1, args.jobs), progress=True)
    probes = sum(r.simulated_probes for r in results.values())
    print(f"pddgw plan: {probes} probes simulated in {time.perf_counter() - wall0:.1f} s of wall time",
          file=sys.stderr)
    if args.out:
        for path in write_outputs(plan, results, Path(args.out)):
            print(f"pddgw plan: wrote {path}", file=sys.stderr)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(report_json(plan, results), option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(format_report(plan, results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
