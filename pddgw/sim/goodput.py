"""The SLA-goodput bisection both searches run: `pddgw sim` on a scenario's deployment, `pddgw plan`
on each candidate.

`bisect` walks `report.sla_goodput` over the rates, after a start and its neighbour where the
roofline's capacity puts the goodput (`start_rate`); at each one the roofline's bound on the
probe's attainment (`plan_bounds.attainment_bound`, passed in) is asked first, and a probe it
puts below the target is not simulated and fails (a simulated probe never beats that bound, so
the walk is the one the simulation takes).  The searches differ only in what they simulate and
bound, so both pass those in (`Prober`); the records (`Probe`) and their JSON are the same.
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
    """One deployment's goodput probes, each rate simulated (or pruned by the roofline's bound on
    its attainment, `bound`) at most once, in the order asked (`probes`).

    `passes` answers from what is known where the bisection's own premise decides it (attainment
    falls as the offered rate rises): a rate at or below a passing one passes, at or above a
    failing one fails, without a simulation.  A search that probes a rate off the bisection's
    path first (`pddgw plan`'s refuting probe) thus spends no simulation on what that probe
    settled; a plain bisection never asks a rate its own probes decide, so for it every rate
    is simulated (or pruned), as before."""

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
        """Whether the deployment holds the SLO's attainment at `rate` (class docstring)."""
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
    rate, every probe in the order run).  The highest passing offer is always simulated: its
    window's requests within SLO are the goodput (if the premise failed there and it misses,
    its numbers are still what is reported).

    `start`, a rate of the bisection's grid (`grid`; `start_rate`), is
    probed first, then its neighbour on the grid on the side its verdict leaves open (above a
    pass, below a fail); the bisection then runs as without them, not simulating what they
    settled (`Prober.passes`).  When the two bracket the goodput, that is every rate it asks:
    two probes instead of the bisection's four or five, and none of the low rates it begins
    with.  With attainment monotone in the rate, the answer is the same either way (the
    grid's highest passing rate); a start off the mark costs at most two probes more."""
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
    """Where a bisection should start (`bisect`): the highest rate of its grid that the
    roofline's steady-state capacity at that rate (`plan_bounds.capacity`: requests per second
    its slowest side carries, `capacity(rate)`) reaches, below the top: `rate_max` is meant
    to fail, and a capacity that reaches it puts the goodput near it, so the search starts
    one step below and probes the top second.  A deployment's goodput lies at or below its
    capacity, most often within a step or two of the grid (16^(1/16) = 1.19 x each on the
    paper scenario).  None where that says nothing: the capacity does not reach even
    `rate_min`."""
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
