"""The planner's search: SLA goodput per dollar-hour of every candidate worth simulating.

Lifecycle of one kind's search (`_KindSearch`):

  1. Enumerate the candidates within the budgets (`plan_space.candidates`).
  2. Bound each one without simulating: the goodput bisection with a probe that passes
     wherever the roofline does not prune the rate (`plan_bounds`); an upper bound on the
     real goodput, since attainment falls as the rate rises.
  3. Order by roofline capacity per USD, best first, and evaluate in that order: the real
     bisection (`pddgw sim`'s probe and goodput), started at `goodput.start_rate`, skipping
     probes the roofline prunes.
  4. Once `top` are evaluated, drop every candidate whose bound per USD ranks below the
     top-th result (branch and bound).  With `jobs` workers the m-th candidate reads the
     results of the first m - jobs only, so the outcome does not depend on timing.
  5. A candidate still left is first offered one refuting probe, the highest grid rate at
     which a fail caps its goodput per USD below the table; a fail drops it (`refuted`), a
     pass continues its bisection, which stops once its cap ranks below the table (`_below`).

`exhaustive = True` is the brute force the tests compare against: every probe simulated, no
pruning, no bound, no start.  Ranking key: goodput per USD-hour, then the lower price, then
the label, so ties resolve the same in every mode and at any `jobs`.  Why each step is
sound: docs/simulator.md.
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pddgw.sim import report
from pddgw.sim.cluster import served_rps
from pddgw.sim.goodput import Probe, Prober, bisect, bracket, describe, grid, start_rate
from pddgw.sim.plan_bounds import Bound, Demand, Setting, attainment_bound, capacity, demand, slo_rps_bound
from pddgw.sim.plan_space import Candidate, Kind, Plan, candidates
from pddgw.sim.profiles import ModelProfile, model
from pddgw.sim.probe import run_probe
from pddgw.sim.run import init_worker
from pddgw.sim.scenario import deployment_config


@dataclass(frozen=True, slots=True)
class Evaluation:
    candidate: Candidate
    roofline: Bound                      # the steady-state roofline at the smallest probe's workload
    upper_rps: float                     # the bound on the goodput (lifecycle steps 2 and 5)
    goodput_rps: float | None = None     # within SLO at the highest passing probe; None: not evaluated
    offered_rps: float | None = None     # that probe's offered rate
    probes: tuple[Probe, ...] = ()
    wall_s: float = 0.0
    refuted_at: float | None = None      # the rate of the refuting probe it failed (step 5)

    @property
    def per_usd(self) -> float:
        """Goodput (requests/s) per USD per hour; the bound's when not evaluated."""
        g = self.upper_rps if self.goodput_rps is None else self.goodput_rps
        return g / self.candidate.price

    def key(self) -> tuple[float, float, str]:
        return (-self.per_usd, self.candidate.price, self.candidate.label())

    @property
    def simulated_probes(self) -> int:
        return sum(p.simulated for p in self.probes)


@dataclass(frozen=True, slots=True)
class KindResult:
    kind: Kind
    ranked: tuple[Evaluation, ...]       # the table: best first, at most `top`
    candidates: int
    evaluated: int                       # simulated: every evaluated candidate, refuted ones included
    pruned: int                          # candidates the roofline prunes at every probe rate
    bounded_out: int                     # candidates never evaluated: their bound ranks below the table
    simulated_probes: int
    pruned_probes: int
    all_evaluations: tuple[Evaluation, ...] = field(default=(), repr=False)

    @property
    def winner(self) -> Evaluation:
        return self.ranked[0]

    @property
    def refuted(self) -> int:
        return sum(e.refuted_at is not None for e in self.all_evaluations)


class _Workloads:
    """Per-rate demand of the probes, computed once per rate (the bisections share most rates)."""

    def __init__(self, plan: Plan):
        self.plan = plan
        self._cache: dict[float, Demand] = {}

    def __call__(self, rate: float) -> Demand:
        if rate not in self._cache:
            self._cache[rate] = demand(self.plan.scenario, rate)
        return self._cache[rate]


def _pruned(at: Setting, prof: ModelProfile, cand: Candidate, d: Demand) -> tuple[bool, float]:
    """(whether the probe is not simulated, the roofline's bound on its attainment)."""
    bound = attainment_bound(at, prof, cand, d)
    return bound < at.scenario.slo.attainment, bound


def upper_bound(at: Setting, prof: ModelProfile, cand: Candidate, work: _Workloads) -> float:
    """A bound on the goodput the real bisection finds (lifecycle step 2): requests per second."""
    g = at.scenario.goodput
    top, _ = report.sla_goodput(lambda r: 0.0 if _pruned(at, prof, cand, work(r))[0] else 1.0,
                                at.scenario.slo.attainment, g.rate_min, g.rate_max, g.probes)
    return _below(at, prof, cand, work, top, inclusive=True)


def goodput_bounds(plan: Plan, cands: Sequence[Candidate]) -> list[float]:
    """`upper_bound` of each candidate, their probes' demand computed once per rate: a bound on
    the goodput `evaluate` finds (any `beat`), unsimulated."""
    prof, work = model(plan.scenario.model), _Workloads(plan)
    return [upper_bound(Setting.of(plan, c), prof, c, work) for c in cands]


def _below(at: Setting, prof: ModelProfile, cand: Candidate, work: _Workloads, rate: float,
           inclusive: bool = False, probes: Sequence[Probe] = ()) -> float:
    """The most requests per second within SLO the roofline allows at any grid rate it does not
    prune below `rate` (at or below, `inclusive`): a bound on the goodput of a bisection whose
    highest passing offer lies there.  A rate simulated among `probes` counts its window's own
    (a window settled early, its bound) instead: the cap once `rate` fails (lifecycle step 5)."""
    g = at.scenario.goodput
    seen = {p.rate: p.window.slo_rps for p in probes if p.window is not None}
    rates = [r for r in grid(g)
             if (r <= rate if inclusive else r < rate) and not _pruned(at, prof, cand, work(r))[0]]
    return max((seen[r] if r in seen else slo_rps_bound(at, prof, cand, work(r)) for r in rates), default=0.0)


class _Refuted(Exception):
    def __init__(self, rate: float):
        super().__init__(rate)
        self.rate = rate


def refuting_rate(at: Setting, prof: ModelProfile, cand: Candidate, work: _Workloads,
                  per_usd: float) -> float | None:
    """The highest grid rate at which a failing probe caps the candidate's goodput per USD below
    `per_usd` (lifecycle step 5); None when even the lowest does not (its fail caps nothing)."""
    g = at.scenario.goodput
    best = None
    for r in grid(g):
        if _below(at, prof, cand, work, r) / cand.price < per_usd:
            best = r
        else:
            break
    return best


def simulate_probe(plan: Plan, cand: Candidate, rate: float) -> tuple[report.Window, float, bool]:
    """`pddgw sim`'s goodput probe at `rate` on the candidate: (its window, requests served per
    second over the run, whether it was settled early)."""
    sc = plan.scenario
    cfg = deployment_config(sc, cand.deployment(plan.spec), plan.wan_gbps if cand.kind != "same-dc" else None)
    window, run = run_probe(sc, cfg, rate)
    return window, served_rps(run), run.decided


def evaluate(plan: Plan, cand: Candidate, exhaustive: bool = False, beat: float | None = None,
             progress: bool = False, hint: float | None = None) -> Evaluation:
    """The candidate's SLA goodput: the bisection, each probe simulated unless pruned; with `beat`
    (goodput per USD to rank above), a refuting probe first (lifecycle step 5).  `progress`: a
    line on stderr per probe and per candidate (a paper-sized probe runs for minutes).  `hint`:
    a grid rate to start at where it lies below the roofline's start (a similar split's offer);
    the start moves the probes, never the answer (`goodput.bisect`)."""
    prof = model(plan.scenario.model)
    work = _Workloads(plan)
    g = plan.goodput
    at = Setting.of(plan, cand)
    wall0 = time.perf_counter()
    name = f"{cand.kind} {cand.label()}" + (f" @ {plan.wan_gbps:g} Gbps" if cand.kind != "same-dc" else "")

    def say(what: str) -> None:
        if progress:
            print(f"pddgw plan: {name}: {what} ({time.perf_counter() - wall0:.0f} s)", file=sys.stderr, flush=True)

    def seen(p: Probe) -> None:
        say(f"probe at {p.rate:.4g} req/s: {describe(p)}")
        if beat is None or exhaustive:
            return
        # The lowest fail caps tightest; a pass below it can tighten its cap (its own window's
        # requests within SLO instead of the roofline's bound), so every probe checks.
        fail = min((q.rate for q in prober.probes if q.attainment < plan.slo.attainment), default=None)
        if fail is not None and _below(at, prof, cand, work, fail, probes=prober.probes) / cand.price < beat:
            raise _Refuted(fail)

    prober = Prober(plan.slo.attainment, lambda r: simulate_probe(plan, cand, r),
                    lambda r: _pruned(at, prof, cand, work(r))[1], exhaustive, seen)
    roof = capacity(at, prof, cand, work(g.rate_min))
    upper = upper_bound(at, prof, cand, work)
    at_rate = None if beat is None or exhaustive else refuting_rate(at, prof, cand, work, beat)
    start = None if exhaustive else start_rate(g, lambda r: capacity(at, prof, cand, work(r)).rate)
    if start is not None and hint is not None:
        start = min(start, max((r for r in grid(g) if r <= hint), default=g.rate_min))
    try:
        if at_rate is not None:
            # A start above the refuting rate goes first, with the neighbour its verdict leaves
            # open: a pass there settles the refuting rate, and a contender passes its start
            # anyway.  Then the refuting rate, unless settled.
            if start is not None and start > at_rate:
                bracket(g, prober, start)
            prober.passes(at_rate)
        goodput, offered, probes = bisect(g, prober, start)
    except _Refuted as e:
        cap = min(upper, _below(at, prof, cand, work, e.rate, probes=prober.probes))
        say(f"refuted: fails {e.rate:.4g} req/s, so its goodput is at most {cap:.3g} req/s")
        return Evaluation(cand, roof, cap, None, None, tuple(prober.probes), time.perf_counter() - wall0, e.rate)
    say(f"SLA goodput {goodput:.3g} req/s at {offered:.4g} offered, {goodput / cand.price * 100:.3g} per $100/h")
    return Evaluation(cand, roof, upper, goodput, offered, probes, time.perf_counter() - wall0)


class _KindSearch:
    """One kind's search (lifecycle steps 1-4) as a queue of candidates to evaluate, in order.

    The m-th candidate starts once the first m - jobs have ended, and its bar (`beat`) and the
    cut read exactly those results, so the search is the same whatever order evaluations end in.
    A free worker may meanwhile take another kind's candidate (`_drive`).
    """

    def __init__(self, plan: Plan, kind: Kind, exhaustive: bool, jobs: int):
        self.plan, self.kind, self.exhaustive, self.jobs = plan, kind, exhaustive, max(1, jobs)
        prof = model(plan.scenario.model)
        work = _Workloads(plan)
        self.candidates = candidates(plan, prof, kind)
        g = plan.goodput
        bounded = []
        for c in self.candidates:
            at = Setting.of(plan, c)
            bounded.append(Evaluation(c, capacity(at, prof, c, work(g.rate_min)), upper_bound(at, prof, c, work)))
        bounded.sort(key=lambda e: (-e.roofline.rate / e.candidate.price, e.candidate.price, e.candidate.label()))
        self.bounded = tuple(bounded)
        self._left = list(bounded)
        self.results: list[Evaluation | None] = []      # in start order; None while it runs

    def next(self) -> tuple[int, Candidate, float | None] | bool:
        """(its index, the candidate to evaluate next, its bar), or whether one may still come:
        True while it waits for an earlier result, False once none is left to start."""
        known = len(self.results) - self.jobs + 1        # the results it reads: 0 .. m - jobs
        if not self.exhaustive and any(r is None for r in self.results[:max(0, known)]):
            return True                                  # (brute force reads none: no bar, no cut)
        beat = None
        top = self.plan.spec.search.top
        if not self.exhaustive and known >= top:
            kth = sorted(self.results[:known], key=Evaluation.key)[top - 1]     # type: ignore[arg-type]
            self._left = [e for e in self._left if e.key() <= kth.key()]
            beat = kth.per_usd
        if not self._left:
            return False
        self.results.append(None)
        return len(self.results) - 1, self._left.pop(0).candidate, beat

    def finish(self, index: int, evaluation: Evaluation) -> None:
        self.results[index] = evaluation

    def result(self) -> KindResult:
        done = sorted((r for r in self.results if r is not None), key=Evaluation.key)
        top = self.plan.spec.search.top
        probes = [p for e in done for p in e.probes]
        return KindResult(self.kind, tuple(done[:top]), len(self.candidates), len(done),
                          sum(e.upper_rps == 0 for e in self.bounded), len(self.candidates) - len(done),
                          sum(p.simulated for p in probes), sum(not p.simulated for p in probes), tuple(done))


def _drive(searches: Sequence[_KindSearch], jobs: int, pool: concurrent.futures.Executor | None,
           progress: bool) -> None:
    """Run the searches to their end: `jobs` evaluations at a time on `pool` (without one, each
    in turn here), a free worker taking the next candidate of the first kind that has one ready."""
    running: dict[concurrent.futures.Future[Evaluation], tuple[_KindSearch, int]] = {}
    while True:
        for s in searches:
            while len(running) < jobs:
                nxt = s.next()
                if isinstance(nxt, bool):
                    break
                i, cand, beat = nxt
                if pool is None:
                    s.finish(i, evaluate(s.plan, cand, s.exhaustive, beat, progress))
                else:
                    running[pool.submit(evaluate, s.plan, cand, s.exhaustive, beat, progress)] = (s, i)
        if not running:
            return
        ended, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in ended:
            s, i = running.pop(f)
            s.finish(i, f.result())


def search(plan: Plan, exhaustive: bool = False, jobs: int = 1, progress: bool = False) -> dict[Kind, KindResult]:
    """Every kind of the plan, with `jobs` processes evaluating candidates side by side, of any
    kind (`_KindSearch`: each kind's search is the same whichever ends first)."""
    searches = [_KindSearch(plan, k, exhaustive, jobs) for k in plan.spec.searched]
    if jobs <= 1:
        _drive(searches, 1, None, progress)
    else:
        with concurrent.futures.ProcessPoolExecutor(jobs, initializer=init_worker) as pool:
            _drive(searches, jobs, pool, progress)
    return {s.kind: s.result() for s in searches}


def winner(results: dict[Kind, KindResult]) -> Evaluation:
    """The best deployment over every kind."""
    return min((r.winner for r in results.values()), key=Evaluation.key)
