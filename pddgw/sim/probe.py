"""One SLA-goodput probe: the workload `pddgw sim` and `pddgw plan` offer a deployment at a rate,
and its run on the virtual clock, stopped once its window is settled.

Below both searches (`run`'s goodput jobs, `plan_search`) and the roofline bound that prunes
them (`plan_bounds`), so that every one of them measures the same probe.
"""

from __future__ import annotations

import dataclasses
import functools

from pddgw.config import Config
from pddgw.sim import report
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import RunResult, run_deployment
from pddgw.sim.scenario import Scenario
from pddgw.sim.workload import Conversation, agentic, gather, load_trace, shared_prefix


@dataclasses.dataclass(frozen=True, slots=True)
class ProbeWorkload:
    """One SLA-goodput probe: its conversations and the window [start_s, end_s) of arrivals it
    measures.  The one definition of a probe: `pddgw sim`'s goodput search and `pddgw plan`'s
    (simulated, and bounded by the roofline in plan_bounds) both take it from `probe_workload`."""

    conversations: tuple[Conversation, ...]
    prefix: tuple[int, ...]
    start_s: float
    end_s: float

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@functools.lru_cache(maxsize=16)
def _trace_head(path: str, limit: int, output_cap: int, seed: int) -> tuple[Conversation, ...]:
    # A search probes many rates of one trace: its records are read once per request count.
    return tuple(load_trace(path, limit, output_cap=output_cap, seed=seed))


def probe_workload(sc: Scenario, rate: float) -> ProbeWorkload:
    """The workload of one goodput probe at `rate` offered requests per second.

    Agentic: open-loop conversations over warmup_s + seconds, the window the arrivals of the last
    `seconds`.  A trace: its first rate x seconds requests (at least min_requests, at most
    `requests`) scaled to arrive at `rate`, all in the window [0, n / rate).
    """
    g = sc.goodput
    wl = sc.workload
    if wl.kind == "agentic":
        spec = dataclasses.replace(wl.agentic, rate=rate)
        convs = agentic(spec, sc.seed, g.warmup_s + g.seconds)
        return ProbeWorkload(tuple(convs), shared_prefix(spec.shared_prefix_tokens, sc.seed),
                             g.warmup_s, g.warmup_s + g.seconds)
    t = wl.trace
    n = g.requests(rate)
    head = _trace_head(t.path, min(n, t.requests) if t.requests else n, t.output_cap, sc.seed)
    if not head:
        raise ValueError(f"trace {t.path}: no requests to probe")
    span = head[-1].start_s - head[0].start_s
    # seconds per unit of recorded time: the n - 1 gaps of the head take (n - 1) / rate seconds.
    scale = (len(head) - 1) / rate / span if span > 0 else 0.0
    convs = tuple(dataclasses.replace(c, start_s=gather((c.start_s - head[0].start_s) * scale, t.burst_s))
                  for c in head)
    return ProbeWorkload(convs, (), 0.0, len(head) / rate)


def run_probe(sc: Scenario, cfg: Config, rate: float) -> tuple[report.Window, RunResult]:
    """One probe (`probe_workload`) simulated on deployment `cfg`: its window and the run.  A probe
    stops once its window is settled (`report.WindowVerdict`, `RunResult.decided`): when it can no
    longer reach the SLO's attainment (the same fail as the whole run, the window its bound), or
    when every window request has ended (the whole run's window exactly; the conversations'
    later turns are not simulated)."""
    pw = probe_workload(sc, rate)
    most = sum(len(c.turns) for c in pw.conversations if c.start_s < pw.end_s)
    verdict = report.WindowVerdict(sc.slo, sc.slo.attainment, pw.start_s, pw.end_s, most)
    run = run_virtual(run_deployment(cfg, list(pw.conversations), pw.prefix, watch=verdict))
    if run.decided:
        return verdict.window(), run
    return report.window_goodput(run.requests, sc.slo, pw.start_s, pw.end_s), run
