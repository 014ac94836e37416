"""From per-request results to the numbers a capacity plan needs.

`summarize` reduces one run: latency percentiles (TTFT, TPOT, ITL, E2E; nearest-rank, so
values that occurred), SLO attainment, RLD's share of tokens, pipelines, WAN bytes and link
utilisation, handoff stalls.  `sla_goodput` bisects for the highest offered rate at which at
least `attainment` of the requests meet every SLO (failed requests miss); `bcr` is goodput
per unit of cost relative to a baseline deployment's.

Goodput is counted the paper's way (`window_goodput`): open-loop arrivals, each probe judging
the requests that arrived in a fixed window after a warm-up; the goodput is the rate of those
that met every SLO at the highest offered rate whose attainment holds.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

from pddgw.sim.cluster import Decided, RequestResult, RunResult, served_rps
from pddgw.sim.scenario import SloSpec


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile q in [0, 100]; None for no values."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _pcts(xs: Sequence[float], scale: float = 1.0, digits: int = 3) -> dict[str, float | None]:
    def r(v: float | None) -> float | None:
        return None if v is None else round(v * scale, digits)

    return {"p50": r(percentile(xs, 50)), "p90": r(percentile(xs, 90)), "p99": r(percentile(xs, 99))}


def miss_cause(r: RequestResult, slo: SloSpec) -> str | None:
    """The first SLO a request missed, in `Misses`' order ("failed": an error or no first
    token), or None when it met every one."""
    if r.error is not None or r.ttft_s is None:
        return "failed"
    if slo.ttft_s and r.ttft_s > slo.ttft_s:
        return "ttft"
    if slo.tpot_ms and r.tpot_s is not None and r.tpot_s * 1000.0 > slo.tpot_ms:
        return "tpot"
    if slo.e2e_s and r.e2e_s is not None and r.e2e_s > slo.e2e_s:
        return "e2e"
    return None


def meets_slo(r: RequestResult, slo: SloSpec) -> bool:
    return miss_cause(r, slo) is None


def attainment(requests: Sequence[RequestResult], slo: SloSpec) -> float:
    return sum(meets_slo(r, slo) for r in requests) / max(1, len(requests))


@dataclass(frozen=True, slots=True)
class Misses:
    """A window's missed requests by the first SLO each missed (`miss_cause`): they partition the
    misses, so a TTFT miss may have missed TPOT too, a TPOT miss met TTFT.  What bounds a
    deployment at a rate: first tokens late (prefill, queues, the WAN) or decoding too slow."""

    failed: int = 0
    ttft: int = 0
    tpot: int = 0
    e2e: int = 0

    @classmethod
    def of(cls, causes: Counter[str]) -> Misses:
        return cls(**{f.name: causes[f.name] for f in fields(cls)})

    def json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Window:
    """What a measurement window [start_s, end_s) of arrivals saw."""

    requests: int          # requests that arrived in the window
    met: int               # of them, those that met every SLO
    seconds: float
    misses: Misses = Misses()   # the requests - met others, by cause
    # requests and met are bounds, not counts: the most that could still arrive and meet the SLO
    # when a probe stopped out of reach (`WindowVerdict`).
    bound: bool = False

    @property
    def arrival_rps(self) -> float:
        return self.requests / self.seconds

    @property
    def slo_rps(self) -> float:
        """Requests per second that met the SLO: the paper's goodput at this load."""
        return self.met / self.seconds

    @property
    def attainment(self) -> float:
        return self.met / max(1, self.requests)


def window_goodput(requests: Sequence[RequestResult], slo: SloSpec, start_s: float, end_s: float) -> Window:
    """The requests arriving in [start_s, end_s) and how many met every SLO; each is judged
    however late it finished (the run serves every conversation to its end)."""
    if not end_s > start_s >= 0:
        raise ValueError(f"need 0 <= start_s < end_s, got [{start_s}, {end_s})")
    inside = [r for r in requests if start_s <= r.arrival_s < end_s]
    causes = Counter(miss_cause(r, slo) for r in inside)
    return Window(len(inside), causes.pop(None, 0), end_s - start_s, Misses.of(causes))


class WindowVerdict:
    """Settles a goodput probe as soon as its window's outcome is known (a `cluster.Watch`),
    raising `cluster.Decided`; a probe never decided is judged by `window_goodput`.

    * Out of reach: `most` bounds the requests that can arrive in [start_s, end_s).  With
      `missed` window requests past their SLO the attainment is at most (most - missed) / most
      whatever the rest do; once that is below `target` the probe fails as the whole run would,
      and `window()` reports that bound.
    * Complete: once a request arrives at or after end_s and every window request has ended,
      `window()` is exact: request for request `window_goodput` of the whole run.
    """

    def __init__(self, slo: SloSpec, target: float, start_s: float, end_s: float, most: int):
        self.slo, self.target, self.start_s, self.end_s, self.most = slo, target, start_s, end_s, most
        self.missed = 0
        self._causes: Counter[str] = Counter()            # the missed by `miss_cause`
        self.arrivals = 0                                 # window requests arrived
        self.met = 0                                      # of them, ended within the SLO
        self._open = 0                                    # of them, not ended yet
        self._past_end = False                            # a request arrived at or after end_s
        self.complete = False
        self._waiting: deque[RequestResult] = deque()     # window requests by arrival, no verdict yet
        self._late: set[str] = set()                      # counted at their TTFT deadline

    def arrived(self, res: RequestResult) -> None:
        inside = self.start_s <= res.arrival_s < self.end_s
        if inside:
            self.arrivals += 1
            self._open += 1
        else:
            # One of `most` is now known to be outside the window: the bound tightens.
            self.most -= 1
            self._check_reach()
        ttft, waiting = self.slo.ttft_s, self._waiting
        if ttft:                    # without a TTFT deadline a request misses only when it ends
            while waiting and res.arrival_s - waiting[0].arrival_s > ttft:
                r = waiting.popleft()
                if r.ttft_s is None and r.e2e_s is None and r.error is None:
                    self._late.add(r.rid)
                    self._miss("ttft")
            if inside:
                waiting.append(res)
        if res.arrival_s >= self.end_s:
            self._past_end = True
            self._check_complete()

    def finished(self, res: RequestResult) -> None:
        if not self.start_s <= res.arrival_s < self.end_s:
            return
        self._open -= 1
        cause = miss_cause(res, self.slo)
        if res.rid in self._late:
            if cause is not None:                         # counted at its deadline; now its cause
                self._causes["ttft"] -= 1
                self._causes[cause] += 1
        elif cause is None:
            self.met += 1
        else:
            self._miss(cause)
        self._check_complete()

    def window(self) -> Window:
        misses = Misses.of(self._causes)
        if self.complete:
            return Window(self.arrivals, self.met, self.end_s - self.start_s, misses)
        return Window(self.most, self.most - self.missed, self.end_s - self.start_s, misses, bound=True)

    def _miss(self, cause: str) -> None:
        self.missed += 1
        self._causes[cause] += 1
        self._check_reach()

    def _check_reach(self) -> None:
        if self.missed and (self.most - self.missed) / max(1, self.most) < self.target:
            raise Decided(f"{self.missed} of at most {self.most} window requests missed the SLO")

    def _check_complete(self) -> None:
        if self._past_end and not self._open:
            self.complete = True
            raise Decided(f"all {self.arrivals} window requests have ended")


def summarize(run: RunResult, slo: SloSpec) -> dict[str, Any]:
    reqs = run.requests
    ok = [r for r in reqs if r.error is None]
    itl = [g for r in ok for g in r.itl_s]
    rld = sum(r.rld_tokens for r in reqs)
    md = sum(r.md_tokens for r in reqs)
    pipelines = Counter(str(r.pipeline or "failed") for r in reqs)
    stalls = [r.handoff_stall_ms for r in ok if r.handoff_stall_ms is not None]
    handoffs = [r for r in ok if r.handoff_mode is not None]
    rounds = Counter(r.catchup_rounds for r in handoffs if r.handoff_mode == "catch-up")
    prompt = sum(r.prompt_tokens for r in ok)
    hit = [r.md_cached_tokens / r.prompt_tokens for r in ok if r.pipeline in ("P-MD", "P-RLD-MD")]
    return {
        "requests": len(reqs),
        "failed": len(reqs) - len(ok),
        "errors": dict(Counter((r.error or "").split(":")[0] for r in reqs if r.error)),
        "ttft_s": _pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _pcts([r.tpot_s for r in ok if r.tpot_s is not None], 1000.0, 2),
        "itl_ms": _pcts(itl, 1000.0, 2),
        "e2e_s": _pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo_attainment": round(attainment(reqs, slo), 4),
        "throughput_rps": round(served_rps(run), 4),
        # Requests per second that met every SLO, over the whole run (first arrival to last answer).
        "slo_rps": round(sum(meets_slo(r, slo) for r in reqs) / run.duration_s, 4),
        "output_tokens": sum(r.output_tokens for r in ok),
        "rld_token_share": round(rld / max(1, rld + md), 4),
        "pipeline_share": {k: round(v / max(1, len(reqs)), 4) for k, v in sorted(pipelines.items())},
        "md_prefix_hit_mean": round(sum(hit) / len(hit), 4) if hit else None,
        "target_prefix_hit_mean": round(sum(r.target_hit for r in reqs) / max(1, len(reqs)), 4),
        "prompt_tokens": prompt,
        "wan_kv_gb": round(run.wan_kv_bytes / 1e9, 3),
        "link_utilisation": run.link_utilisation,
        "handoffs": len(handoffs),
        "handoff_modes": dict(Counter(r.handoff_mode for r in handoffs)),
        "handoff_stall_ms": {**_pcts(stalls, 1.0, 2), "max": round(max(stalls), 2) if stalls else None},
        "catchup_rounds": {"median": percentile([r.catchup_rounds for r in handoffs
                                                 if r.handoff_mode == "catch-up"], 50),
                           "histogram": {str(k): v for k, v in sorted(rounds.items())}},
        "alignments": run.alignments,
        "rld_full": run.rld_full,
        "wan_classes": run.wan_classes,
        # Over every wire: foreground / background GB, and background bytes that went
        # on the wire while a foreground frame waited (QoS holds: 0).
        "wan_qos": {"fg_gb": round(sum(c["foreground_gb"] for c in run.wan_classes.values()), 3),
                    "bg_gb": round(sum(c["background_gb"] for c in run.wan_classes.values()), 3),
                    "bg_ahead_of_fg": sum(c["bg_bytes_ahead_of_fg"] for c in run.wan_classes.values())},
        "redrives": run.redrives,
        "preemptions": run.preemptions,
        "engine_busy": {k: round(v, 4) for k, v in run.engine_busy.items()},
        "duration_s": round(run.duration_s, 3),
        "drain_s": round(run.drain_s, 3),
        "leaked_blocks": run.leaked_blocks,
        "leaked_pins": run.leaked_pins,
    }


def sla_goodput(probe: Callable[[float], float], target: float, lo: float, hi: float,
                probes: int) -> tuple[float, list[tuple[float, float]]]:
    """Highest rate in [lo, hi] whose attainment (probe(rate)) is >= target.

    Geometric bisection of `probes` probes (lo, hi and probes - 2 midpoints) -> (goodput, the
    (rate, attainment) points probed, in order); 0.0 when even `lo` fails.  The midpoints come
    first; `hi` is probed only when every midpoint passed (a probe above the goodput is the
    dearest), `lo` only when every one failed.  With attainment monotone in the rate, the answer
    is that of probing `lo` first and `hi` second.
    """
    points: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        a = probe(rate)
        points.append((rate, a))
        return a >= target

    bottom, top = lo, hi
    for _ in range(max(0, probes - 2)):
        mid = math.sqrt(bottom * top)
        if ok(mid):
            bottom = mid
        else:
            top = mid
    if top == hi and ok(hi):
        return hi, points
    if bottom == lo and not ok(lo):
        return 0.0, points
    return bottom, points


def bisection_rates(lo: float, hi: float, probes: int) -> list[float]:
    """Every rate `sla_goodput(.., lo, hi, probes)` can probe (its grid), computed as it does,
    ascending."""
    def mids(a: float, b: float, depth: int) -> list[float]:
        if depth <= 0:
            return []
        m = math.sqrt(a * b)
        return [m, *mids(a, m, depth - 1), *mids(m, b, depth - 1)]

    return sorted({lo, hi, *mids(lo, hi, probes - 2)})


def bcr(goodput: float, price: float, base_goodput: float, base_price: float) -> float | None:
    """Goodput per cost relative to the baseline's (1.0 = as cost-effective)."""
    if not (goodput and price and base_goodput and base_price):
        return None
    return (goodput / price) / (base_goodput / base_price)
