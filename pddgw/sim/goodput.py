"""The SLA-goodput bisection both searches run: `pddgw sim` on a scenario's deployment,
`pddgw plan` on each candidate.

`bisect` walks `report.sla_goodput` over the rates, after a start and its neighbour
(`start_rate`); a probe the roofline's attainment bound puts below the target is not
simulated and fails (a simulated probe never beats that bound, so the walk is the same).
The searches pass in what they simulate and bound (`Prober`); the records are the same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pddgw.sim import report
from pddgw.sim.scenario import GoodputSpec


@dataclass(frozen=True, slots=True)
class Probe:
    rate: float                          # offered requests per second
    attainment: float                    # of the window's requests (0.0: not simulated)
    window: report.Window | None         # None: not simulated (the roofline pruned the rate)
    achieved_rps: float | None           # requests served per second over the run
    attainment_bound: float              # the roofline's bound on its attainment (plan_bounds)
    # Stopped once settled (`probe.run_probe`): out of reach (attainment and window are bounds)
    # or every window request ended (exact).
    decided: bool = False

    @property
    def simulated(self) -> bool:
        return self.window is not None

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rate": round(self.rate, 4), "attainment": round(self.attainment, 4),
                               "simulated": self.simulated, "attainment_bound": round(self.attainment_bound, 4)}
        if self.window is not None and self.achieved_rps is not None:
            out |= {"arrival_rps": round(self.window.arrival_rps, 4), "slo_rps": round(self.window.slo_rps, 4),
                    "achieved_rps": round(self.achieved_rps, 4), "decided_early": self.decided,
                    "window_bound": self.window.bound,
                    "misses": self.window.misses.json()}
        return out


# One simulated probe at a rate: (its window, requests served per second, settled early).
Simulate = Callable[[float], tuple[report.Window, float, bool]]


class Prober:
    """One deployment's goodput probes, each rate simulated (or pruned by `bound`) at most once, in
    the order asked (`probes`).  `passes` answers without simulating where monotonicity decides
    (at or below a passing rate passes, at or above a failing one fails).
    """

    def __init__(self, target: float, simulate: Simulate, bound: Callable[[float], float],
                 exhaustive: bool = False, on_probe: Callable[[Probe], None] | None = None):
        self.target = target
        self._simulate = simulate
        self._bound = bound
        self.exhaustive = exhaustive             # simulate the probes the bound would prune too
        self._on_probe = on_probe
        self.probes: list[Probe] = []

    def probe(self, rate: float) -> Probe:
        """The probe at `rate`: run now unless it ran already."""
        for p in self.probes:
            if p.rate == rate:
                return p
        b = self._bound(rate)
        if b < self.target and not self.exhaustive:
            p = Probe(rate, 0.0, None, None, b)
        else:
            window, achieved, decided = self._simulate(rate)
            p = Probe(rate, window.attainment, window, achieved, b, decided)
        self.probes.append(p)
        if self._on_probe is not None:
            self._on_probe(p)
        return p

    def passes(self, rate: float) -> bool:
        """Whether the deployment holds the SLO's attainment at `rate`."""
        for p in self.probes:
            if p.rate == rate:
                return p.attainment >= self.target
        if any(p.rate > rate and p.attainment >= self.target for p in self.probes):
            return True
        if any(p.rate < rate and p.attainment < self.target for p in self.probes):
            return False
        return self.probe(rate).attainment >= self.target


def grid(spec: GoodputSpec) -> list[float]:
    """The rates a search of `spec` can probe, ascending (`report.bisection_rates`)."""
    return report.bisection_rates(spec.rate_min, spec.rate_max, spec.probes)


def bisect(spec: GoodputSpec, prober: Prober, start: float | None = None) -> tuple[float, float, tuple[Probe, ...]]:
    """-> (the goodput: requests per second within SLO at the highest passing offer, that offered
    rate, every probe in the order run).  The highest passing offer is always simulated.

    `start`, a rate of `grid`, goes first, then `bracket`'s neighbour; the bisection then skips
    what they settled (`Prober.passes`).  With attainment monotone in the rate the answer is the
    same either way; a start off the mark costs at most two probes more.
    """
    if start is not None:
        bracket(spec, prober, start)
    offered, _ = report.sla_goodput(lambda r: 1.0 if prober.passes(r) else 0.0, prober.target,
                                    spec.rate_min, spec.rate_max, spec.probes)
    best = prober.probe(offered).window if offered else None
    return (best.slo_rps if best else 0.0), offered, tuple(prober.probes)


def bracket(spec: GoodputSpec, prober: Prober, start: float) -> None:
    """`bisect`'s first two probes: `start` (a rate of the grid), then its grid neighbour on the
    side its verdict leaves open (above a pass, below a fail), where there is one."""
    rates = grid(spec)
    i = rates.index(start)
    j = i + 1 if prober.passes(start) else i - 1
    if 0 <= j < len(rates):
        prober.passes(rates[j])


def start_rate(spec: GoodputSpec, capacity: Callable[[float], float]) -> float | None:
    """Where a bisection should start: the highest grid rate below `rate_max` that the roofline's
    steady-state capacity at that rate reaches (`capacity(rate)`), or None when it does not
    reach even `rate_min`.
    """
    rates = grid(spec)
    return next((r for r in reversed(rates[:-1]) if capacity(r) >= r), None)


def describe(p: Probe) -> str:
    """A probe's verdict as its progress line says it (`pddgw sim`, `pddgw plan`)."""
    if p.window is None:
        return f"not simulated: the roofline bounds its attainment at {p.attainment_bound:.3f}"
    m = p.window.misses
    if p.window.bound:
        what = (f"attainment at most {p.attainment:.3f} of at most {p.window.requests} window requests "
                "(settled early, out of reach)")
    else:
        what = (f"attainment {p.attainment:.3f} of {p.window.requests} window requests"
                f"{' (settled early, window complete)' if p.decided else ''}")
    return what + f", missed: {m.failed} failed, {m.ttft} TTFT, {m.tpot} TPOT, {m.e2e} E2E"


def first_fail(probes: tuple[Probe, ...], offered: float) -> dict[str, Any] | None:
    """The lowest simulated probe above the goodput's offer, as JSON: the load at which the
    deployment stopped holding its SLO, and its misses say which SLO gave out (None: none
    failed, or the roofline pruned every failing rate)."""
    p = min((p for p in probes if p.window is not None and p.rate > offered), key=lambda p: p.rate, default=None)
    if p is None or p.window is None:
        return None
    return {"offered_rps": round(p.rate, 4), "attainment": round(p.attainment, 4), "misses": p.window.misses.json()}
