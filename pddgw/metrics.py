"""Prometheus metrics: the router's request metrics and every worker node's engine and link metrics.

Names follow vLLM's with a `pddgw:` prefix (`pddgw:time_to_first_token_seconds`).  Each role
object owns its own `CollectorRegistry`, never the global one (`RouterMetrics`, `NodeMetrics`,
`FrontDoorMetrics`), so several deployments in one process never collide.

Series are either observed as they happen (Counters, Histograms; per-token ones counted
locally and applied at collection) or read at scrape time by custom collectors (pipeline
counters, engine stats, per-link KV bytes).  A scrape first awaits `refresh()` on every
source (engine stats are read on the engine's thread), then renders: the loop never blocks.
`scrape(sources)` merges several sources' families by name (node series carry `node` and
`role` labels): the embedded router's /metrics includes every in-process worker.

Lifecycle of one request's series on the router (`Router.run`):
  1. each run of tokens sent: `generation_tokens`; the first also
     `time_to_first_token_seconds` and `prompt_tokens`, the others
     `inter_token_latency_seconds` (the gap since the previous run);
  2. when it leaves the router (any outcome): `e2e_request_latency_seconds`,
     `request_queue_time_seconds`, its outcome, handoff (mode, stall) and WAN KV bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from pddgw.core.roles import PIPELINES, ROLES, Pipeline

if TYPE_CHECKING:
    from pddgw.engines.types import EngineStats

PREFIX = "pddgw:"

# vLLM's buckets (v1 loggers), with finer ones below 10 ms for the tiny model.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0, 30.0, 60.0, 120.0, 300.0)
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)

# Token runs the router counts locally before applying them to its series (RouterMetrics.__init__).
_MAX_PENDING = 1024

PRIORITIES = ("foreground", "background")      # net.link.Priority, by value


class MetricsSource(Protocol):
    """Something a scrape renders: its registry, refreshed first."""

    registry: CollectorRegistry

    async def refresh(self) -> None: ...


_PIPELINE_FIELDS = {Pipeline.P_MD: "p_md", Pipeline.P_RLD_MD: "p_rld_md",
                    Pipeline.P_RLD: "p_rld"}    # PIPELINES -> RouterCounts


@dataclass(slots=True)
class RouterCounts:
    """The router's decisions, counted (its Prometheus counters and /debug/state read them)."""

    p_md: int = 0
    p_rld_md: int = 0
    p_rld: int = 0
    redrives: int = 0          # requests re-driven after a lost node
    fallbacks: int = 0         # P-RLD-MD requests RLD finished alone (MD or WAN lost)
    rld_full: int = 0          # requests that found the relay pool full (went P-MD)

    def add_pipeline(self, pipeline: str) -> None:
        """One decision for `pipeline` (one of PIPELINES)."""
        field = _PIPELINE_FIELDS[pipeline]
        setattr(self, field, getattr(self, field) + 1)

    def pipeline(self, pipeline: str) -> int:
        return getattr(self, _PIPELINE_FIELDS[pipeline])

    def as_dict(self) -> dict[str, int]:
        """{"P-MD": n, "P-RLD-MD": n, "P-RLD": n, "redrives": n, "fallbacks": n, "rld_full": n}."""
        return {**{p.value: self.pipeline(p) for p in PIPELINES}, "redrives": self.redrives,
                "fallbacks": self.fallbacks, "rld_full": self.rld_full}


class RoomView(Sized, Protocol):
    @property
    def refused(self) -> int: ...


class RouterView(Protocol):
    """What the router's series read of a `pipeline.router.Router` at scrape time."""

    @property
    def counts(self) -> RouterCounts: ...
    @property
    def room(self) -> RoomView: ...
    @property
    def live(self) -> int: ...
    @property
    def alignments(self) -> Sized: ...


class RecordView(Protocol):
    """What `RouterMetrics.ended` reads of a `pipeline.state.RequestRecord`."""

    @property
    def total_ms(self) -> float: ...
    @property
    def final_state(self) -> Any: ...                 # a RequestState (its name is the outcome)
    @property
    def states(self) -> tuple[tuple[str, float, str], ...]: ...   # (state name, t_ms, reason)
    @property
    def handoff_mode(self) -> str | None: ...          # "one-shot" | "catch-up" (state.HandoffMode)
    @property
    def handoff_stall_ms(self) -> float | None: ...


class _Collector:
    """A custom collector over a function that yields families at scrape time."""

    def __init__(self, fn: Callable[[], Iterable[Metric]]):
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return self._fn()


# Every observed series is named `pddgw:NAME` and lives in its owner's registry, never the
# global default one (see the module docstring): these two say so once.
def _histogram(registry: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...],
               labels: Iterable[str] = ()) -> Histogram:
    return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)


def _counter(registry: CollectorRegistry, name: str, doc: str, labels: Iterable[str] = ()) -> Counter:
    return Counter(PREFIX + name, doc, labels, registry=registry)


# ---- router ---------------------------------------------------------------------------


class RouterMetrics:
    """The router's series (see the module docstring); `registry` is this router's own."""

    def __init__(self, router: RouterView | None = None):
        self.router = router
        self.registry = reg = CollectorRegistry()
        self._extra: list[MetricsSource] = []
        # Per-run observations wait here (an append instead of a locked observation) and are
        # applied in order at collection (this collector runs first) or at `_MAX_PENDING`:
        # every value at a scrape is exactly what observing at once would have made it.
        self._itl_pending: list[float] = []
        self._tokens_pending: dict[str, int] = {}
        reg.register(_Collector(self._flush))
        self.ttft = _histogram(reg, "time_to_first_token_seconds",
                               "Time from the request's arrival at the router to its first token sent.", TTFT_BUCKETS)
        self.itl = _histogram(reg, "inter_token_latency_seconds",
                              "Gap between consecutive runs of tokens sent to a client (one per run).", ITL_BUCKETS)
        self.e2e = _histogram(reg, "e2e_request_latency_seconds",
                              "Time from the request's arrival at the router to its end.", REQUEST_BUCKETS)
        self.queue_time = _histogram(reg, "request_queue_time_seconds",
                                     "Time a request waited in the router's room queue (0: never).", REQUEST_BUCKETS)
        self.prompt_tokens = _counter(reg, "prompt_tokens", "Prompt tokens of requests that got a first token.")
        self.generation_tokens = _counter(reg, "generation_tokens", "Output tokens sent to clients.")
        self.tokens_by_role = _counter(reg, "generation_tokens_by_role",
                                       "Output tokens sent to clients by the role that generated them.", ["role"])
        self.success = _counter(reg, "request_success", "Requests finished, by finish reason.", ["finished_reason"])
        self.errors = _counter(reg, "request_errors", "Requests that ended without finishing.", ["state"])
        self.handoffs = _counter(reg, "handoffs", "Requests handed off RLD -> MD, by handoff mode.", ["mode"])
        self.handoff_stall = _histogram(reg, "handoff_stall_seconds",
                                        "Longest gap the client saw across a request's final handoff round.",
                                        STALL_BUCKETS, ["mode"])
        self.wan_kv_bytes = _counter(reg, "wan_kv_bytes",
                                     "KV bytes P sent across the WAN for requests "
                                     "(reports after a response ended too).")
        self.front_door = FrontDoorMetrics(reg)
        # Children looked up once: `labels()` takes a lock and a dict lookup per call.
        self._role_tokens = {role: self.tokens_by_role.labels(role) for role in ROLES}
        for mode in ("one-shot", "catch-up"):
            self.handoffs.labels(mode)
        self._by_role: dict[str, int] = dict.fromkeys(ROLES, 0)
        if router is not None:
            reg.register(_Collector(self._router_state))

    # ---- observations ----------------------------------------------------------------
    def emitted(self, role: str, count: int, t: float, prev_t: float | None, t0: float, prompt_tokens: int) -> None:
        """`count` tokens sent at loop time `t`; `prev_t` the previous run's (None: the first)."""
        if prev_t is None:
            self.ttft.observe(max(0.0, t - t0))
            self.prompt_tokens.inc(prompt_tokens)
        else:
            pending = self._itl_pending
            pending.append(max(0.0, t - prev_t))
            if len(pending) >= _MAX_PENDING:
                self._flush()
        tokens = self._tokens_pending
        tokens[role] = tokens.get(role, 0) + count
        self._by_role[role] = self._by_role.get(role, 0) + count

    def _flush(self) -> tuple[()]:
        """Apply the pending observations (see `__init__`); a collector yielding no family.

        Token counts are whole numbers, so one increment of their sum is exactly the
        increments one by one."""
        pending, self._itl_pending = self._itl_pending, []
        observe = self.itl.observe
        for gap in pending:
            observe(gap)
        tokens, self._tokens_pending = self._tokens_pending, {}
        for role, count in tokens.items():
            self.generation_tokens.inc(count)
            child = self._role_tokens.get(role)
            if child is None:
                child = self._role_tokens[role] = self.tokens_by_role.labels(role)
            child.inc(count)
        return ()

    def ended(self, rec: RecordView, queue_s: float) -> None:
        """The request left the router (any outcome)."""
        self.e2e.observe(rec.total_ms / 1000.0)
        self.queue_time.observe(queue_s)
        state = rec.final_state.name.lower()
        if state == "finished":
            self.success.labels(_finish_reason(rec)).inc()
        else:
            self.errors.labels(state if state == "cancelled" else "failed").inc()
        if rec.handoff_mode is not None:
            self.handoffs.labels(rec.handoff_mode).inc()
            if rec.handoff_stall_ms is not None:
                self.handoff_stall.labels(rec.handoff_mode).observe(rec.handoff_stall_ms / 1000.0)

    # ---- scrape --------------------------------------------------------------------------
    def include(self, source: MetricsSource) -> None:
        """Render `source` with this router's series (an in-process worker's NodeMetrics)."""
        self._extra.append(source)

    async def refresh(self) -> None:
        return None

    async def scrape(self) -> bytes:
        """This router's series, and those of every included source."""
        return await scrape([self, *self._extra])

    def _router_state(self) -> Iterator[Metric]:
        r = self.router
        assert r is not None
        pipe = CounterMetricFamily(PREFIX + "pipeline_requests", "Pipeline decisions (a re-drive decides again).",
                                   labels=["pipeline"])
        for p in PIPELINES:
            pipe.add_metric([p], r.counts.pipeline(p))
        yield pipe
        for name, value, doc in (("redrives", r.counts.redrives, "Requests re-driven after a lost node."),
                                 ("fallbacks", r.counts.fallbacks,
                                  "P-RLD-MD requests RLD finished alone (MD or WAN lost)."),
                                 ("rld_full", r.counts.rld_full,
                                  "Requests that found the relay pool full (went P-MD).")):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        yield CounterMetricFamily(PREFIX + "request_queue_refused", "Requests refused at a room-queue bound.",
                                  value=r.room.refused)
        waiting = len(r.room)
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests on the router, not queued.",
                                value=max(0, r.live - waiting))
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting in the room queue.",
                                value=waiting)
        yield GaugeMetricFamily(PREFIX + "md_alignments", "Background MD cache alignments in progress.",
                                value=len(r.alignments))
        rld, md = self._by_role.get("rld", 0), self._by_role.get("md", 0)
        yield GaugeMetricFamily(PREFIX + "rld_token_share", "RLD's share of the output tokens RLD and MD sent.",
                                value=rld / (rld + md) if rld + md else 0.0)


def _finish_reason(rec: RecordView) -> str:
    for state, _t, reason in reversed(rec.states):
        if state == "FINISHED":
            return reason or "stop"
    return "stop"


# ---- front door -------------------------------------------------------------------------

# What the front door refuses (`front_door_refused`) and closes for a read timeout
# (`front_door_closed`), each a `reason` label named after the [server] setting it enforces.
REFUSED_REASONS = ("max_concurrent_requests", "max_connections_per_client", "max_message_bytes",
                   "malformed_head")
CLOSED_REASONS = ("header_read_timeout", "body_min_rate", "keepalive_timeout", "websocket_idle_timeout")


class FrontDoorMetrics:
    """The front door's counters (api/door.py's admission, api/guard.py's connection guard).

    Every reason's series exists from the start (value 0), so a scrape can be compared exactly;
    `requests_active` and `connections` read their owners at scrape time (`watch`)."""

    def __init__(self, registry: CollectorRegistry):
        self.refused = _counter(registry, "front_door_refused", "Requests or connections the front door refused.",
                                ["reason"])
        self.closed = _counter(registry, "front_door_closed",
                               "Connections the front door closed for a read timeout.", ["reason"])
        self._refused = {r: self.refused.labels(r) for r in REFUSED_REASONS}
        self._closed = {r: self.closed.labels(r) for r in CLOSED_REASONS}
        self._active: Callable[[], int] = lambda: 0
        self._connections: Callable[[], int] = lambda: 0
        registry.register(_Collector(self._gauges))

    def refuse(self, reason: str) -> None:
        self._refused[reason].inc()

    def close(self, reason: str) -> None:
        self._closed[reason].inc()

    def watch(self, active: Callable[[], int] | None = None, connections: Callable[[], int] | None = None) -> None:
        """Read the admitted requests / open client connections from these at scrape time."""
        if active is not None:
            self._active = active
        if connections is not None:
            self._connections = connections

    def _gauges(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(PREFIX + "front_door_requests_active",
                                "Requests admitted under [server] max_concurrent_requests.", value=self._active())
        yield GaugeMetricFamily(PREFIX + "front_door_connections", "Open client connections to the front door.",
                                value=self._connections())


# ---- worker node ------------------------------------------------------------------------


class NodeMetrics:
    """One worker node's series, labelled by node (and role, or peer and priority).

    `stats` reads the engine's stats on its thread; `links` gives the node's
    outbound peer links' KV bytes by priority class ({peer: (fg, bg)}, totals
    that never go back, so links replaced on a reconnect are folded in by the node).
    """

    def __init__(self, node: str, role: str, stats: Callable[[], Awaitable[EngineStats]],
                 links: Callable[[], Mapping[str, tuple[int, int]]]):
        self.node = node
        self.role = role
        self._stats_fn = stats
        self._links_fn = links
        self._stats: EngineStats | None = None
        self.registry = reg = CollectorRegistry()
        self.kv_transfer_time = _histogram(
            reg, "kv_transfer_time_seconds",
            "Wire seconds of one request's KV transfer to one peer (priority: its class when it ended).",
            TRANSFER_BUCKETS, ["node", "peer", "priority"])
        reg.register(_Collector(self._snapshot))

    def transfer(self, peer: str, priority: int, seconds: float) -> None:
        self.kv_transfer_time.labels(self.node, peer, PRIORITIES[priority]).observe(seconds)

    async def scrape(self) -> bytes:
        """This node's series (a worker's own /metrics)."""
        return await scrape([self])

    async def refresh(self) -> None:
        try:
            self._stats = await self._stats_fn()
        except Exception:          # a stopped engine: its last stats stand
            pass

    def _snapshot(self) -> Iterator[Metric]:
        labels = ["node", "role"]
        me = [self.node, self.role]
        st = self._stats
        if st is not None:
            families = [
                (GaugeMetricFamily, "kv_cache_usage_perc",
                 "Fraction of the node's KV blocks in use by requests or pins (0..1).",
                 st.used_blocks / st.num_blocks if st.num_blocks else 0.0),
                (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 st.prefix_query_tokens),
                (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens the prefix cache held.",
                 st.prefix_hit_tokens),
                (CounterMetricFamily, "num_preemptions", "Sequences the node's scheduler preempted.",
                 st.preemptions),
                (GaugeMetricFamily, "node_requests_running", "Sequences the node's engine runs.", st.running),
                (GaugeMetricFamily, "node_requests_waiting", "Sequences waiting or importing KV on the node.",
                 st.waiting + st.importing),
            ]
            for cls, name, doc, value in families:
                fam = cls(PREFIX + name, doc, labels=labels)
                fam.add_metric(me, value)
                yield fam
        sent = CounterMetricFamily(PREFIX + "kv_transfer_bytes", "KV payload bytes sent to a peer, by class.",
                                   labels=["node", "peer", "priority"])
        for peer, by_class in sorted(self._links_fn().items()):
            for cls_name, n in zip(PRIORITIES, by_class):
                sent.add_metric([self.node, peer, cls_name], n)
        yield sent


# ---- exposition ------------------------------------------------------------------------


class _Merged:
    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge(registries: Iterable[CollectorRegistry]) -> list[Metric]:
    """The families of several registries, one per name (their samples concatenated)."""
    out: dict[str, Metric] = {}
    for reg in registries:
        for fam in reg.collect():
            have = out.get(fam.name)
            if have is None:
                have = out[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            have.samples.extend(fam.samples)
    return list(out.values())


async def scrape(sources: Iterable[MetricsSource]) -> bytes:
    """Refresh every source (engine stats are read off the loop), then render them as one."""
    sources = list(sources)
    await asyncio.gather(*(s.refresh() for s in sources))
    return generate_latest(_Merged(merge(s.registry for s in sources)))  # type: ignore[arg-type]


Scrape = Callable[[], Awaitable[bytes]]


def metrics_handler(scrape_fn: Scrape) -> Callable[[web.Request], Awaitable[web.Response]]:
    """An aiohttp handler serving `scrape_fn()` in the Prometheus text format 0.0.4 (legacy
    metric names: every Prometheus reads it)."""

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=await scrape_fn(), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    return handler


def metrics_route(app: web.Application, scrape_fn: Scrape, path: str = "/metrics") -> None:
    """Serve `GET /metrics` on `app`: e.g. `metrics_route(app, router.metrics.scrape)`.

    No authentication: like vLLM's, the endpoint is for a Prometheus scraper on
    the deployment's network, and it holds counts only (no prompts, no tokens,
    no keys); put it behind the deployment's firewall like every node port.
    """
    app.router.add_get(path, metrics_handler(scrape_fn))
