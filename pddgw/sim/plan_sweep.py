"""The payoff map (`pddgw plan --sweep`): where cross-DC deployment pays, over a grid of GPU-B
parts, GPU-B/GPU-A price ratios, WAN bandwidths and prefix hits.

Per cell it compares the best cross-DC split (the plan's kinds other than same-dc: the PDD
family) with the best same-DC split by BCR, SLA goodput per USD per hour, and says which split
won.  The grid is the plan's `[sweep]` table (`plan_space.SweepSpec`).

The price axis costs no simulation.  A split's goodput does not depend on what its GPUs cost,
so the sweep runs in two stages:

  1. Search (`search_all`): once per (GPU-B, WAN, hit) for the cross-DC kinds, and once per
     hit for same-DC (it uses neither GPU-B nor the WAN), candidates are evaluated, their
     probes pruned by the roofline.  The search's branch and bound ranks at one price; the
     sweep's cut (`search_cut`) holds at all of the search's prices: a candidate is skipped,
     or refuted by one failing probe, only where at every ratio (and market) it is outside
     the budgets or its goodput per USD falls below a BCR already simulated there, so it wins
     no cell.  A GPU-B's searches run by falling WAN, each bisection started at the same
     split's offer one WAN up (`search_chain`).  USD budgets are left out of the search plan
     (they move with the price) and applied in stage 2.
  2. Re-rank (`cells`): per price ratio, each search's evaluations are repriced (GPU-B at
     ratio x GPU-A's USD per GPU-hour, or `market`: its [prices] entry) and ranked by BCR
     within the budgets.  Pure arithmetic: nothing here reaches the simulator.

GPU-A is cluster A's hardware (its menu must hold one part); GPU-B replaces cluster B's menu.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pddgw.config import ConfigError
from pddgw.sim.plan_search import Evaluation, evaluate, goodput_bounds
from pddgw.sim.plan_space import Candidate, HardwareOption, Kind, Plan, SweepSpec, _within, candidates
from pddgw.sim.profiles import model, price
from pddgw.sim.run import init_worker
from pddgw.sim.scenario import Scenario
from pddgw.tables import format_table

SHORT = {"naive-cross-dc": "naive", "cross-dc-cached": "cached", "pdd": "pdd", "pdd-relay-on-p": "relay-p",
         "same-dc": "same-dc"}


@dataclass(frozen=True, slots=True)
class Search:
    """Stage 1's result for one (GPU-B, WAN, hit): every candidate's evaluation.  Same-DC's
    searches have no GPU-B and no WAN."""

    gpu_b: str | None
    wan_gbps: float | None
    hit: float | None                    # None: the workload's own hits
    evaluations: tuple[Evaluation, ...]

    @property
    def simulated_probes(self) -> int:
        return sum(e.simulated_probes for e in self.evaluations)


@dataclass(frozen=True, slots=True)
class Pick:
    """A family's best split at one set of prices."""

    kind: Kind
    label: str
    goodput_rps: float
    price: float                         # USD per hour at the cell's prices

    @property
    def bcr(self) -> float:
        """SLA goodput (req/s) per USD per hour."""
        return self.goodput_rps / self.price


@dataclass(frozen=True, slots=True)
class Cell:
    gpu_b: str
    ratio: float | None                  # GPU-B/GPU-A price; None: market (GPU-B's [prices] entry)
    gpu_b_price: float                   # USD per GPU-hour
    wan_gbps: float
    hit: float | None
    cross: Pick | None                   # None: no cross-DC split within the budgets
    same: Pick | None

    @property
    def payoff(self) -> float | None:
        """The best cross-DC BCR over the best same-DC BCR (None where either is missing or
        same-DC serves nothing within SLO)."""
        if self.cross is None or self.same is None or self.same.bcr == 0:
            return None
        return self.cross.bcr / self.same.bcr


@dataclass(frozen=True, slots=True)
class Sweep:
    plan: Plan
    gpu_a: str
    gpu_a_price: float
    searches: tuple[Search, ...]
    cells: tuple[Cell, ...]

    @property
    def spec(self) -> SweepSpec:
        assert self.plan.spec.sweep is not None
        return self.plan.spec.sweep

    @property
    def simulated_probes(self) -> int:
        return sum(s.simulated_probes for s in self.searches)


# ---- the grid --------------------------------------------------------------------------------------

def sweep_spec(plan: Plan) -> SweepSpec:
    """The plan's [sweep] table; ConfigError where it has none or its axes do not apply."""
    s = plan.spec.sweep
    if s is None:
        raise ConfigError(f"plan {plan.spec.name}: --sweep needs a [sweep] table (gpu_b, price_ratios, market, "
                          "wan_gbps, prefix_hits)")
    if s.prefix_hits and plan.scenario.workload.kind != "agentic":
        raise ConfigError("sweep.prefix_hits: a trace workload has no prefix-hit knob (its hits are the trace's); "
                          "leave the axis out")
    kinds = plan.spec.searched
    if "same-dc" not in kinds or len(kinds) < 2:
        raise ConfigError("sweep: kinds must include same-dc and at least one cross-DC kind")
    return s


def gpu_a(plan: Plan) -> tuple[str, float]:
    """Cluster A's part and its USD per GPU-hour: what the price ratios multiply."""
    menu = plan.spec.cluster("A").hardware
    if len(menu) != 1:
        raise ConfigError(f"sweep: cluster A's menu names {len(menu)} parts; a price ratio needs one GPU-A")
    opt = menu[0]
    if opt.price <= 0:
        raise ConfigError(f"sweep: GPU-A {opt.hardware} costs $0/h; a price ratio needs a positive price")
    return opt.hardware, opt.price


def gpu_b_price(plan: Plan, part: str, ratio: float | None, a_price: float) -> float:
    """GPU-B's USD per GPU-hour: ratio x GPU-A's, or at market its [prices] entry (the plan's,
    the scenario's, prices.toml's); ConfigError naming the key where it has none."""
    if ratio is not None:
        return ratio * a_price
    try:
        return price(part, {**plan.scenario.prices, **plan.spec.prices})
    except KeyError as e:
        raise ConfigError(f"sweep: market: {e.args[0]}") from None


def with_hit(sc: Scenario, hit: float | None) -> Scenario:
    """The scenario with every follow-up turn hitting `hit` of its prompt (None: as it is)."""
    if hit is None:
        return sc
    ag = dataclasses.replace(sc.workload.agentic, hit_buckets=((1.0, hit, hit),))
    return dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, agentic=ag))


def search_plan(plan: Plan, kinds: tuple[Kind, ...], gpu_b: str | None, wan: float | None,
                hit: float | None, b_price: float) -> Plan:
    """The plan one search runs: `kinds` only, GPU-B as cluster B's menu at a placeholder price
    (goodput does not read it), the WAN and hit set, no USD budgets (stage 2 applies them)."""
    clusters = []
    for cs in plan.spec.clusters:
        if cs.name == "B" and gpu_b is not None:
            cs = dataclasses.replace(cs, hardware=(HardwareOption(gpu_b, b_price, cs.hardware[0].gpus_per_node),))
        clusters.append(dataclasses.replace(cs, usd_per_hour=0.0))
    spec = dataclasses.replace(plan.spec, kinds=kinds, clusters=tuple(clusters), usd_per_hour=0.0)
    return Plan(spec, with_hit(plan.scenario, hit), wan if wan is not None else plan.wan_gbps)


# ---- stage 1: search ---------------------------------------------------------------------------------

def _jobs(plan: Plan, a_price: float) -> list[tuple[Search, Plan, Kind]]:
    """Each search (evaluations still empty), the plan it runs and a kind to evaluate in it."""
    s = sweep_spec(plan)
    cross = tuple(k for k in plan.spec.searched if k != "same-dc")
    out: list[tuple[Search, Plan, Kind]] = []
    for hit in s.hits:
        out.append((Search(None, None, hit, ()), search_plan(plan, ("same-dc",), None, None, hit, a_price),
                    "same-dc"))
        for part in s.gpu_b:
            for wan in s.wan_gbps:
                p = search_plan(plan, cross, part, wan, hit, a_price)
                out += [(Search(part, wan, hit, ()), p, k) for k in cross]
    return out


def _prices(plan: Plan, x: Search, a_price: float) -> tuple[dict[str, float], ...]:
    """USD per GPU-hour by cluster at each price the search's evaluations are ranked at in stage 2:
    same-DC's one (GPU-A's), a cross-DC search's one per ratio (and market)."""
    if x.gpu_b is None:
        return ({"A": a_price},)
    s = sweep_spec(plan)
    return tuple({"A": a_price, "B": gpu_b_price(plan, x.gpu_b, r, a_price)}
                 for r in s.ratios)


def _bcr(plan: Plan, cand: Candidate, goodput: float, usd: Mapping[str, float]) -> float | None:
    """Goodput per USD-hour at these prices, as `best` computes it; None outside the budgets."""
    c = repriced(cand, usd)
    return goodput / c.price if _within(plan.spec, c) else None


def _beat(plan: Plan, cand: Candidate, prices: Sequence[Mapping[str, float]],
          bar: Sequence[float | None]) -> float | None:
    """The goodput per USD, at the candidate's own prices, it must reach to win at one of
    `prices` (to tie `bar` there at least): `evaluate`'s `beat`.  None while a price it is
    within the budgets at has no bar yet."""
    need = []
    for usd, b in zip(prices, bar):
        c = repriced(cand, usd)
        if _within(plan.spec, c):
            if b is None:
                return None
            need.append(b * c.price)
    return min(need) / cand.price if need else None


def search_cut(plan: Plan, p: Plan, cands: Sequence[Candidate], prices: Sequence[Mapping[str, float]],
               progress: bool = False, hints: Mapping[tuple[Kind, str], float] | None = None,
               ) -> tuple[Evaluation, ...]:
    """One search's candidates, evaluated in order of their best bound per USD, each skipped
    where it cannot win at any of `prices`: at every one, outside the budgets or its goodput
    bound per USD below the best BCR an evaluated candidate already holds there.  One that is
    evaluated is offered `evaluate`'s refuting probe at the goodput it needs to win at one price
    (`_beat`): refuted, it wins none.  Its bisection starts at `hints`' rate for it, by (kind,
    label), else at the offer of the last split evaluated here with the same prefill side
    (`_prefill_side`).  `progress`: `evaluate`'s lines on stderr (a search runs for minutes)."""
    bounds = list(zip(cands, goodput_bounds(p, cands)))
    bcrs = [[_bcr(plan, c, u, usd) for usd in prices] for c, u in bounds]
    order = sorted(range(len(bounds)), key=lambda i: (-max((b for b in bcrs[i] if b is not None), default=-1.0),
                                                      bounds[i][0].label(), bounds[i][0].kind))
    bar: list[float | None] = [None] * len(prices)
    out: dict[int, Evaluation] = {}
    siblings: dict[tuple, float] = {}
    for i in order:
        if not any(u is not None and (b is None or u >= b) for u, b in zip(bcrs[i], bar)):
            continue
        c = bounds[i][0]
        hint = (hints or {}).get((c.kind, c.label()), siblings.get(_prefill_side(c)))
        e = out[i] = evaluate(p, c, beat=_beat(plan, c, prices, bar), progress=progress, hint=hint)
        if e.offered_rps is not None:
            siblings[_prefill_side(c)] = e.offered_rps
        for j, usd in enumerate(prices):
            got, b = _bcr(plan, e.candidate, e.goodput_rps or 0.0, usd), bar[j]
            if got is not None and (b is None or got > b):
                bar[j] = got
    # In the candidates' own order: `best` breaks a full tie (two kinds' equal labels) by it.
    return tuple(out[i] for i in sorted(out))


def _prefill_side(c: Candidate) -> tuple:
    """The kind and every group but the decoder's: splits whose goodput the same P tends to set."""
    return c.kind, tuple(g for g in c.groups if g.role != "md")


Link = tuple[Plan, list[Candidate], tuple[dict[str, float], ...]]


def search_chain(plan: Plan, links: Sequence[Link], progress: bool = False) -> list[tuple[Evaluation, ...]]:
    """`search_cut` on each link in turn, each bisection started at the offer the same split
    found in the nearest link before it (the same GPU-B and hit at a higher WAN, where goodput is
    at least as high), where that lies below the roofline's start."""
    found: list[tuple[Evaluation, ...]] = []
    hints: dict[tuple[Kind, str], float] = {}
    for p, cands, prices in links:
        found.append(search_cut(plan, p, cands, prices, progress, dict(hints)))
        hints |= {(e.candidate.kind, e.candidate.label()): e.offered_rps
                  for e in found[-1] if e.offered_rps is not None}
    return found


def search_all(plan: Plan, jobs: int = 1, progress: bool = False, cut: bool = True) -> tuple[Search, ...]:
    """Stage 1: every candidate of every search evaluated once (module docstring), `jobs` at a
    time; with `cut`, the searches of one GPU-B and hit in one worker, by falling WAN, each
    skipping or refuting what cannot win at any of its prices (`search_cut`, `search_chain`:
    the cells are the same as without)."""
    _, a_price = gpu_a(plan)
    prof = model(plan.scenario.model)
    wall0 = time.perf_counter()
    if cut:
        grouped: dict[Search, tuple[Plan, list[Candidate]]] = {}
        for s, p, k in _jobs(plan, a_price):
            grouped.setdefault(s, (p, []))[1].extend(candidates(p, prof, k))
        chains: dict[tuple[str | None, float | None], list[Search]] = {}
        for s in sorted(grouped, key=lambda s: -(s.wan_gbps or 0.0)):
            chains.setdefault((s.gpu_b, s.hit), []).append(s)
        args = [(plan, [(*grouped[s], _prices(plan, s, a_price)) for s in ch], progress) for ch in chains.values()]
        if jobs <= 1:
            chained = [search_chain(*a) for a in args]
        else:
            with concurrent.futures.ProcessPoolExecutor(jobs, initializer=init_worker) as pool:
                chained = list(pool.map(search_chain, *zip(*args)))
        found_by = {s: es for ch, found in zip(chains.values(), chained) for s, es in zip(ch, found)}
        if progress:
            n = sum(len(cs) for _, cs in grouped.values())
            print(f"pddgw plan --sweep: {sum(map(len, found_by.values()))} of {n} candidates evaluated in "
                  f"{time.perf_counter() - wall0:.1f} s", file=sys.stderr)
        return tuple(dataclasses.replace(s, evaluations=found_by[s]) for s in grouped)
    tasks = [(s, p, c) for s, p, k in _jobs(plan, a_price) for c in candidates(p, prof, k)]
    if jobs <= 1:
        done = [evaluate(p, c) for _, p, c in tasks]
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs, initializer=init_worker) as pool:
            done = list(pool.map(evaluate, [p for _, p, _ in tasks], [c for _, _, c in tasks]))
    if progress:
        print(f"pddgw plan --sweep: {len(tasks)} candidates evaluated in {time.perf_counter() - wall0:.1f} s",
              file=sys.stderr)
    by_search: dict[Search, list[Evaluation]] = {}
    for (s, _, _), e in zip(tasks, done):
        by_search.setdefault(s, []).append(e)
    return tuple(dataclasses.replace(s, evaluations=tuple(es)) for s, es in by_search.items())


# ---- stage 2: re-rank by price -------------------------------------------------------------------------

def repriced(cand: Candidate, usd_by_cluster: Mapping[str, float]) -> Candidate:
    """The candidate with each group's GPUs at its cluster's USD per GPU-hour (GPU-B may be
    GPU-A's part: the price goes by cluster, not by part)."""
    groups = tuple(dataclasses.replace(g, price_per_gpu_hour=usd_by_cluster[g.cluster]) for g in cand.groups)
    return dataclasses.replace(cand, groups=groups)


def best(plan: Plan, evaluations: Sequence[Evaluation], usd_by_cluster: Mapping[str, float]) -> Pick | None:
    """The highest BCR at these prices within the plan's budgets; ties: the lower price, then the label."""
    picks = []
    for e in evaluations:
        c = repriced(e.candidate, usd_by_cluster)
        if _within(plan.spec, c):
            picks.append(Pick(c.kind, c.label(), e.goodput_rps or 0.0, c.price))
    return min(picks, key=lambda p: (-p.bcr, p.price, p.label), default=None)


def cells(plan: Plan, searches: Sequence[Search]) -> tuple[Cell, ...]:
    """Stage 2: per search and price ratio, the two families' best splits (module docstring)."""
    s = sweep_spec(plan)
    _, a_price = gpu_a(plan)
    same = {x.hit: best(plan, x.evaluations, {"A": a_price}) for x in searches if x.gpu_b is None}
    out = []
    for x in searches:
        if x.gpu_b is None or x.wan_gbps is None:
            continue
        for ratio in s.ratios:
            b_price = gpu_b_price(plan, x.gpu_b, ratio, a_price)
            cross = best(plan, x.evaluations, {"A": a_price, "B": b_price})
            out.append(Cell(x.gpu_b, ratio, b_price, x.wan_gbps, x.hit, cross, same[x.hit]))
    return tuple(out)


def sweep(plan: Plan, jobs: int = 1, progress: bool = False, cut: bool = True) -> Sweep:
    """The payoff map: stage 1 (simulation), then stage 2 (prices); refusals before any simulation."""
    s = sweep_spec(plan)
    a, a_price = gpu_a(plan)
    for part in s.gpu_b:
        if s.market:
            gpu_b_price(plan, part, None, a_price)
    searches = search_all(plan, jobs, progress, cut)
    return Sweep(plan, a, a_price, searches, cells(plan, searches))


# ---- the report ------------------------------------------------------------------------------------------

def _ratio_label(r: float | None) -> str:
    return "market" if r is None else f"{r:g}"


def _hit_label(h: float | None) -> str:
    return "workload's" if h is None else f"{h:g}"


def _pick_json(p: Pick | None) -> dict[str, Any] | None:
    if p is None:
        return None
    return {"kind": p.kind, "deployment": p.label, "goodput_rps": round(p.goodput_rps, 4),
            "price_per_hour": round(p.price, 4), "goodput_per_usd_hour": round(p.bcr, 6)}


def _evaluation_json(e: Evaluation) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": e.candidate.kind, "deployment": e.candidate.label(),
                           "goodput_rps": None if e.goodput_rps is None else round(e.goodput_rps, 4),
                           "simulated_probes": e.simulated_probes}
    if e.refuted_at is not None:
        out["refuted_at_rps"] = round(e.refuted_at, 4)
    return out


def sweep_json(sw: Sweep) -> dict[str, Any]:
    s = sw.spec
    return {"plan": sw.plan.spec.name, "scenario": sw.plan.scenario.name, "model": sw.plan.scenario.model,
            "gpu_a": {"hardware": sw.gpu_a, "price_per_gpu_hour": sw.gpu_a_price},
            "cross_dc_kinds": [k for k in sw.plan.spec.searched if k != "same-dc"],
            "axes": {"gpu_b": list(s.gpu_b), "price_ratio": [_ratio_label(r) if r is None else r for r in s.ratios],
                     "wan_gbps": list(s.wan_gbps), "prefix_hit": list(s.prefix_hits) or None},
            "simulated_probes": sw.simulated_probes,
            "searches": [{"gpu_b": x.gpu_b, "wan_gbps": x.wan_gbps, "prefix_hit": x.hit,
                          "simulated_probes": x.simulated_probes,
                          "evaluated": [_evaluation_json(e) for e in x.evaluations]}
                         for x in sw.searches],
            "cells": [{"gpu_b": c.gpu_b, "price_ratio": "market" if c.ratio is None else c.ratio,
                       "gpu_b_price_per_gpu_hour": round(c.gpu_b_price, 4), "wan_gbps": c.wan_gbps,
                       "prefix_hit": c.hit, "cross_dc": _pick_json(c.cross), "same_dc": _pick_json(c.same),
                       "payoff": None if c.payoff is None else round(c.payoff, 4)} for c in sw.cells]}


HEADS = ["WAN Gbps", "prefix hit", "GPU-B", "B/A price", "GPU-B $/GPU-h", "best cross-DC split", "req/s", "$/h",
         "best same-DC split", "req/s", "$/h", "payoff (BCR x)"]


def _pick_cells(p: Pick | None) -> list[str]:
    if p is None:
        return ["-", "-", "-"]
    return [f"{SHORT[p.kind]}: {p.label}", f"{p.goodput_rps:.3g}", f"{p.price:.2f}"]


def format_sweep(sw: Sweep) -> str:
    pl = sw.plan
    hits = "prefix hit as swept" if sw.spec.prefix_hits else (
        "prefix hits: the workload's own" if pl.scenario.workload.kind == "agentic" else
        "no prefix-hit axis (a trace workload's hits are the trace's)")
    rows = [[f"{c.wan_gbps:g}", _hit_label(c.hit), c.gpu_b, _ratio_label(c.ratio), f"{c.gpu_b_price:.2f}",
             *_pick_cells(c.cross), *_pick_cells(c.same), "-" if c.payoff is None else f"{c.payoff:.3f}"]
            for c in sorted(sw.cells, key=_cell_order(sw))]
    return "\n".join([
        f"pddgw plan {pl.spec.name} --sweep: the payoff map of {pl.scenario.model}: the best cross-DC split's "
        f"BCR (SLA goodput per USD per hour; kinds {', '.join(k for k in pl.spec.searched if k != 'same-dc')}) "
        f"over the best same-DC split's; GPU-A {sw.gpu_a} at ${sw.gpu_a_price:.2f}/GPU-h; {hits}; "
        f"{sw.simulated_probes} probes simulated, none per price", "",
        format_table(HEADS, rows)])


def _cell_order(sw: Sweep) -> Any:
    axes = (sw.spec.wan_gbps, sw.spec.hits, sw.spec.gpu_b, sw.spec.ratios)
    return lambda c: tuple(ax.index(v) for ax, v in zip(axes, (c.wan_gbps, c.hit, c.gpu_b, c.ratio)))


def model_slug(name: str) -> str:
    """A file-name part for a model: its profile name, or a model file's stem."""
    return Path(name).stem if "/" in name else name


def write_heatmap(sw: Sweep, path: Path) -> Path:
    """One PNG: a panel per (prefix hit, WAN), price ratio across, GPU-B down, each cell's payoff
    and the winning cross-DC kind written in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import TwoSlopeNorm

    s = sw.spec
    at = {(c.hit, c.wan_gbps, c.gpu_b, c.ratio): c for c in sw.cells}
    vals = [c.payoff for c in sw.cells if c.payoff is not None]
    norm = TwoSlopeNorm(vcenter=1.0, vmin=min([*vals, 0.99]), vmax=max([*vals, 1.01]))
    rows, cols = len(s.hits), len(s.wan_gbps)
    fig, axes = plt.subplots(rows, cols, squeeze=False, layout="constrained",
                             figsize=(3.0 + 1.0 * len(s.ratios) * cols, 1.8 + 0.6 * len(s.gpu_b) * rows))
    for i, hit in enumerate(s.hits):
        for j, wan in enumerate(s.wan_gbps):
            ax = axes[i][j]
            grid = [[math.nan if (p := at[(hit, wan, b, r)].payoff) is None else p for r in s.ratios]
                    for b in s.gpu_b]
            im = ax.imshow(grid, cmap="RdBu", norm=norm, aspect="auto")
            for y, b in enumerate(s.gpu_b):
                for x, r in enumerate(s.ratios):
                    c = at[(hit, wan, b, r)]
                    text = "-" if c.payoff is None or c.cross is None else f"{c.payoff:.2f}\n{SHORT[c.cross.kind]}"
                    dark = c.payoff is not None and abs(float(norm(c.payoff)) - 0.5) > 0.3
                    ax.text(x, y, text, ha="center", va="center", fontsize=7, color="white" if dark else "black")
            ax.set_xticks(range(len(s.ratios)), [_ratio_label(r) for r in s.ratios], fontsize=7)
            ax.set_yticks(range(len(s.gpu_b)), list(s.gpu_b), fontsize=7)
            ax.set_xlabel("GPU-B / GPU-A price", fontsize=8)
            ax.set_title(f"WAN {wan:g} Gbps, hit {_hit_label(hit)}", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="cross-DC BCR / same-DC BCR")
    fig.suptitle(f"{sw.plan.scenario.model}: payoff of cross-DC over same-DC (GPU-A {sw.gpu_a})", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_sweep(sw: Sweep, out: Path) -> list[Path]:
    """OUT/payoff.json and OUT/payoff_<model>.png."""
    import orjson

    out.mkdir(parents=True, exist_ok=True)
    js = out / "payoff.json"
    js.write_bytes(orjson.dumps(sweep_json(sw), option=orjson.OPT_INDENT_2) + b"\n")
    return [js, write_heatmap(sw, out / f"payoff_{model_slug(sw.plan.scenario.model)}.png")]
