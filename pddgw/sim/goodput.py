"""The SLA-goodput bisection both searches run: `pddgw sim` on a scenario's deployment, `pddgw plan`
on each candidate.

`bisect` walks `report.sla_goodput` over the rates; at each one the roofline's bound on the
probe's attainment (`plan_bounds.attainment_bound`, passed in) is asked first, and a probe it
puts below the target is not simulated and fails (a simulated probe never beats that bound, so
the walk is the one the simulation takes).  The searches differ only in what they simulate and
bound, so both pass those in; the records (`Probe`) and their JSON are the same.
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


def bisect(spec: GoodputSpec, target: float, simulate: Simulate, bound: Callable[[float], float],
           exhaustive: bool = False, on_probe: Callable[[Probe], None] | None = None
           ) -> tuple[float, float, tuple[Probe, ...]]:
    """-> (the goodput: requests per second within SLO at the highest passing offer, that offered
    rate, every probe in order).  `exhaustive` simulates the probes the bound would prune too."""
    probes: list[Probe] = []

    def probe(rate: float) -> float:
        b = bound(rate)
        if b < target and not exhaustive:
            p = Probe(rate, 0.0, None, None, b)
        else:
            window, achieved, decided = simulate(rate)
            p = Probe(rate, window.attainment, window, achieved, b, decided)
        probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return p.attainment

    offered, _ = report.sla_goodput(probe, target, spec.rate_min, spec.rate_max, spec.probes)
    best = next((p.window for p in probes if p.rate == offered and p.window is not None), None)
    return (best.slo_rps if best else 0.0), offered, tuple(probes)


def first_fail(probes: tuple[Probe, ...], offered: float) -> dict[str, Any] | None:
    """The lowest simulated probe above the goodput's offer, as JSON: the load at which the
    deployment stopped holding its SLO, and its misses say which SLO gave out (None: none
    failed, or the roofline pruned every failing rate)."""
    p = min((p for p in probes if p.window is not None and p.rate > offered), key=lambda p: p.rate, default=None)
    if p is None or p.window is None:
        return None
    return {"offered_rps": round(p.rate, 4), "attainment": round(p.attainment, 4), "misses": p.window.misses.json()}
