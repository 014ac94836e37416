"""Putting nodes together: the embedded all-in-one process, or one node of many.

Topology: nodes in different clusters talk over the `[[net.links]]` link named "wan" (shaped
when configured), within a cluster over the unshaped fabric.  Links: router -> every worker,
P -> every decoder (KV), RLD -> every MD (handoffs).  `pddgw serve` with no config is the
embedded default: router, P and RLD in cluster A, MD in cluster B, one process.

SIGTERM / SIGINT drains within `[server] drain_timeout_s`, so a rolling restart loses
nothing: a worker stops taking requests, tells its routers (`m.Draining`), finishes or
moves what is in flight (`WorkerNode.drain`) and answers /health 503 "draining"; the router's
front door admits nothing new and waits for admitted requests, then MD alignments.  Then a
node closes all its links at once and `exit_process` skips the interpreter's teardown: an
idle worker is gone within ~1 s of SIGTERM.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import errno
import gc
import hmac
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, NoReturn

import structlog
from aiohttp import web

from pddgw import messages as m
from pddgw.api.door import FrontDoor
from pddgw.api.guard import GuardedSite
from pddgw.api.server import build_app
from pddgw.config import Config, ConfigError, NodeConfig, StartupError
from pddgw.core.roles import Role
from pddgw.deploy import regime
from pddgw.engines.async_engine import in_passing_thread
from pddgw.engines.base import create_engine, engine_class
from pddgw.engines.dtypes import why
from pddgw.engines.kv_pool import DTYPES
from pddgw.engines.weights import SharedModels, load_spec_for, served_model_name
from pddgw.metrics import metrics_route
from pddgw.net.errors import LinkError
from pddgw.net.inproc import InProcNetwork
from pddgw.net.link import KvSink, Link
from pddgw.net.ws import WsServer
from pddgw.net.ws import connect as ws_connect
from pddgw.pipeline.node import WorkerNode
from pddgw.pipeline.router import NodeHandle, Router

log = structlog.get_logger(__name__)

WAN = "wan"
FABRIC = "fabric"


def embedded_nodes(cfg: Config) -> tuple[NodeConfig, ...]:
    """The default topology: router, P, RLD in cluster A; MD in cluster B with its own block size.

    Every engine steps on every core of the machine (at least `engine.cpu_threads`; 0 keeps
    torch's default): in one process they take turns on one compute thread
    (engines/compute_thread.py), so a step has the machine to itself."""
    threads = cfg.engine.cpu_threads and max(cfg.engine.cpu_threads, len(os.sched_getaffinity(0)))
    engine = dataclasses.replace(cfg.engine, cpu_threads=threads)
    md_engine = dataclasses.replace(engine, block_size=cfg.engine.block_size * 2)
    return (NodeConfig("router", Role.ROUTER, "A"), NodeConfig("p0", Role.PREFILL, "A", engine=engine),
            NodeConfig("rld0", Role.RLD, "A", engine=engine), NodeConfig("md0", Role.MD, "B", engine=md_engine))


def with_topology(cfg: Config) -> Config:
    return cfg if cfg.nodes else dataclasses.replace(cfg, nodes=embedded_nodes(cfg))


def shaping_between(cfg: Config, a: NodeConfig, b: NodeConfig) -> str:
    """The `[[net.links]]` entry between two nodes: "wan" across clusters, "fabric"
    (when configured) within one, "" for an unshaped link."""
    if a.cluster != b.cluster:
        return WAN
    return FABRIC if any(s.name == FABRIC for s in cfg.net.links) else ""


async def _router_link_handler(link: Link, msg: m.Message) -> None:
    """Messages to the router outside any open stream (a late token of an ended request): dropped."""
    return None


class RouterSide:
    """The router's process part: the Router, its front door and its node handles.

    Metrics: `self.router.metrics` (pddgw/metrics.py) holds the router's
    series and, when the deployment is embedded (`workers`), every in-process
    worker's node series; the front door serves them at /metrics.
    """

    def __init__(self, cfg: Config, nodes: list[NodeHandle], workers: Iterable[WorkerNode] = ()):
        spec, tokenizer, kv_dtype = load_spec_for(cfg.model)
        self.cfg = cfg
        kv_per_token = spec.kv_bytes_per_token(DTYPES[kv_dtype])
        wan = cfg.net.shaping(WAN)
        if wan is not None and wan.gbps:
            # An emulated WAN: its configured bandwidth is the estimator's prior.
            cfg = dataclasses.replace(cfg, policy=dataclasses.replace(
                cfg.policy, link_prior_mbps=wan.gbps * 1000.0, link_prior_rtt_ms=2 * wan.latency_ms))
        self.router = Router(cfg, spec, nodes, kv_per_token)
        name = served_model_name(cfg.model.path)
        self.door = FrontDoor(cfg, self.router, tokenizer, name, self.state)
        self._poller: asyncio.Task[None] | None = None
        for w in workers:           # in-process workers: the router's /metrics shows them too
            self.router.metrics.include(w.metrics)
        for n in nodes:             # a worker's messages outside any request (its drain)
            n.link.set_handler(self.router.on_link_message)

    async def drain(self) -> None:
        """SIGTERM: admit nothing new; every admitted request ends, then the background
        alignments; within `[server] drain_timeout_s`."""
        loop = asyncio.get_running_loop()
        bound = self.cfg.server.drain_timeout_s
        deadline = loop.time() + bound
        log.info("drain_started", node="router", inflight=self.door.drain.start(), timeout_s=bound)
        left = await self.door.drain.wait_idle(bound)
        alignments = len(self.router.alignments)
        if alignments and deadline > loop.time():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout_at(deadline):
                    await self.router.drain()
        log.info("drain_done", node="router", unfinished=left, alignments_left=len(self.router.alignments),
                 seconds=round(loop.time() - deadline + bound, 3))

    async def state(self) -> dict[str, Any]:
        async def one(n: NodeHandle) -> dict[str, Any]:
            if not n.healthy:       # a down link would hold the query until its timeout
                return {"node": n.name, "role": n.role, "healthy": False, "error": f"link {n.link.state.name}"}
            try:
                st = await n.link.request(m.StateQuery(n.name), timeout=self.cfg.net.request_timeout_s)
                assert isinstance(st, m.NodeState)
                return {**st.to_dict(), "healthy": True}
            except LinkError as e:
                return {"node": n.name, "role": n.role, "healthy": False, "error": str(e)}

        nodes = await asyncio.gather(*(one(n) for n in self.router.nodes.values()))
        return {"router": {"active_requests": self.door.active, "pipelines": self.router.counts.as_dict(),
                           "inflight": self.router.inflight()},
                "nodes": {n["node"]: n for n in nodes}}

    def start(self) -> None:
        self._poller = asyncio.create_task(self.router.poll_loads(), name="router-loads")

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        # A drain (graceful shutdown) has let them finish; otherwise they end here, links still up.
        await self.router.alignments.abandon()


def _handle(n: NodeConfig, cfg: Config, link: Link) -> NodeHandle:
    ecfg = cfg.engine_for(n)
    return NodeHandle(n, link, ecfg.block_size, ecfg.max_num_seqs * ecfg.dp_ranks, dp_ranks=ecfg.dp_ranks)


def _make_worker(cfg: Config, n: NodeConfig, connect, models: SharedModels | None) -> WorkerNode:
    ecfg = cfg.engine_for(n)
    engine, _ = create_engine(cfg, ecfg, models)
    return WorkerNode(n.name, n.role, engine, connect, cfg.net.kv_frame_bytes, ecfg.stream_interval, n.relay)


async def _build_worker(cfg: Config, n: NodeConfig, connect, models: SharedModels | None = None) -> WorkerNode:
    """Loading weights takes real time: off the loop, unless the engine only models time."""
    if engine_class(cfg.engine_for(n).implementation).runs_inline:
        return _make_worker(cfg, n, connect, models)
    return await in_passing_thread(_make_worker, cfg, n, connect, models)


class Embedded:
    """Every role in one process, in-process links (the WAN shaped between clusters).

    Unless the config gives the WAN's figures, `start` derives them from the
    decode step of MD's engine (deploy/regime.py): after `start`,
    `self.cfg` is the config the deployment runs with and `self.wan_regime`
    what was derived (None when the WAN was configured).  The engines (and
    the WAN probe's) share one load of the weights (`weights.SharedModels`).
    """

    def __init__(self, cfg: Config):
        self.cfg = with_topology(cfg)
        self.models = SharedModels()
        self.net = InProcNetwork(self.cfg.net)
        self.workers: dict[str, WorkerNode] = {}
        self.router_side: RouterSide | None = None
        self.wan_regime: regime.DerivedWan | None = None

    async def start(self) -> RouterSide:
        # The emulated WAN may come from this machine's decode step ([net.regime]):
        # derive it before any node or link exists, so every part sees the same figures.
        cfg, self.wan_regime = await regime.resolve(self.cfg, self.models)
        if self.wan_regime is not None:
            self.cfg = cfg
            self.net = InProcNetwork(cfg.net)
        by_name = {n.name: n for n in cfg.nodes}
        for n in cfg.nodes:
            if n.role == "router":
                continue

            def connect(remote: str, me: NodeConfig = n):
                return self._dial(me, by_name[remote])

            worker = await _build_worker(cfg, n, connect, self.models)
            self.workers[n.name] = worker
            self.net.listen(n.name, worker.handle, kv_sink=worker.kv_sink)
        router_cfg = next(n for n in cfg.nodes if n.role == "router")
        handles = [_handle(n, cfg, await self._dial(router_cfg, n, _router_link_handler))
                   for n in cfg.nodes if n.role != "router"]
        self.router_side = RouterSide(cfg, handles, workers=self.workers.values())
        self.router_side.start()
        return self.router_side

    async def _dial(self, me: NodeConfig, peer: NodeConfig, handler=None) -> Link:
        if handler is None:
            handler = self.workers[me.name].handle if me.name in self.workers else None
        worker = self.workers.get(me.name)
        return await self.net.connect(me.name, peer.name, handler=handler,
                                      kv_sink=worker.kv_sink if worker is not None else None,
                                      shaping=shaping_between(self.cfg, me, peer) or None,
                                      groups=(me.cluster, peer.cluster))

    def wan_kv_bytes(self) -> int:
        """KV payload bytes sent so far over links between clusters (both directions)."""
        cluster = {n.name: n.cluster for n in self.cfg.nodes}
        return sum(link.stats.kv_bytes_sent for link in self.net.links
                   if cluster.get(link.local) != cluster.get(link.peer))

    async def stop(self) -> None:
        if self.router_side is not None:
            await self.router_side.stop()
        for w in self.workers.values():
            await w.stop()
        await self.net.close()
        self.models.clear()


# ---- one node of a multi-process deployment ----------------------------------------


def link_url(n: NodeConfig, tls: bool) -> str:
    if not n.port:
        raise ConfigError(f"nodes.{n.name}.port: a worker node needs a port to be dialed "
                          "(set port = ... in its [[nodes]] entry)")
    return f"{'wss' if tls else 'ws'}://{n.host}:{n.port}/pddgw/link"


async def dial(cfg: Config, me: NodeConfig, peer: NodeConfig, handler, wait_s: float = 60.0,
               kv_sink: KvSink | None = None) -> Link:
    """Dial a peer node, retrying while it starts up; KV it sends us lands where `kv_sink` says."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        try:
            return await ws_connect(link_url(peer, cfg.net.tls.enabled), me.name, cfg.net, handler,
                                    shaping=shaping_between(cfg, me, peer), kv_sink=kv_sink)
        except LinkError as e:
            if asyncio.get_running_loop().time() > deadline:
                raise LinkError(f"cannot reach {peer.role} node {peer.name} at "
                                f"{link_url(peer, cfg.net.tls.enabled)} within {wait_s:g} s: {e}") from None
            await asyncio.sleep(0.2)


async def run_worker(cfg: Config, me: NodeConfig, host: str | None = None, port: int | None = None,
                     ready: asyncio.Event | None = None) -> None:
    """Serve one worker node until cancelled."""
    by_name = {n.name: n for n in cfg.nodes}
    worker: WorkerNode | None = None

    def connect(remote: str):
        return dial(cfg, me, by_name[remote], worker.handle if worker else None,
                    kv_sink=worker.kv_sink if worker else None)

    worker = await _build_worker(cfg, me, connect)
    server = WsServer(me.name, cfg.net, worker.handle, kv_sink=worker.kv_sink)
    app = web.Application()
    server.add_routes(app)

    async def health(request: web.Request) -> web.Response:
        if worker.drain_timeout_s is not None:
            return web.json_response({"status": "draining", "node": me.name, "role": me.role}, status=503)
        return web.json_response({"status": "ok", "node": me.name, "role": me.role})

    # An emulated wire still carries what was sent within its latency: closing the links
    # drops it (a cut cable), so a drained node lingers that long (a real one: TCP flushes).
    linger_s = max((2 * (s.latency_ms + s.jitter_ms) / 1000.0 for s in cfg.net.links if s.enabled), default=0.0)

    async def drain() -> None:
        await worker.drain(cfg.server.drain_timeout_s)
        await asyncio.sleep(linger_s + 0.05)

    # Anyone who can reach a peer can reach this port: the node's state is for the deployment only.
    expected = f"Bearer {cfg.net.load_secret()}".encode()

    async def state(request: web.Request) -> web.Response:
        if not hmac.compare_digest(request.headers.get("Authorization", "").encode(errors="replace"), expected):
            return web.json_response({"error": "/debug/state needs Authorization: Bearer <net secret>"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        return web.json_response((await worker.state()).to_dict())

    app.router.add_get("/health", health)
    app.router.add_get("/debug/state", state)
    # Unauthenticated, like vLLM's: counts only (no prompts, tokens or keys), for a Prometheus
    # scraper on the deployment's network (the port is a node port: firewall it like the link).
    metrics_route(app, worker.metrics.scrape)
    await _serve_app(app, host or me.host, me.port if port is None else port, cfg, ready,
                     cleanup=[server.close, worker.stop], drain=drain)


async def run_router(cfg: Config, me: NodeConfig, host: str | None = None, port: int | None = None,
                     ready: asyncio.Event | None = None, dial_wait_s: float = 60.0) -> None:
    """Serve the router (front door) until cancelled; dials every worker node first, waiting
    up to `dial_wait_s` for each (a StartupError naming the first it could not reach)."""
    workers = [n for n in cfg.nodes if n.role != "router"]
    results = await asyncio.gather(*(dial(cfg, me, n, _router_link_handler, wait_s=dial_wait_s)
                                     for n in workers), return_exceptions=True)
    links = [r for r in results if isinstance(r, Link)]
    failed = [r for r in results if not isinstance(r, Link)]
    if failed:
        for link in links:
            await link.close()
        if not isinstance(failed[0], LinkError):
            raise failed[0]
        raise StartupError(f"{failed[0]} (start every worker node with `pddgw serve --config ... --node NAME`;"
                           f" the router waits {dial_wait_s:g} s for them; every node needs the same net secret"
                           " and CA)")
    side = RouterSide(cfg, [_handle(n, cfg, link) for n, link in zip(workers, links)])
    side.start()

    async def close_links() -> None:
        await asyncio.gather(*(link.close() for link in links))

    await _serve_app(build_app(side.door), host or cfg.server.host, cfg.server.port if port is None else port,
                     cfg, ready, cleanup=[side.stop, close_links], tls=False, front_door=True, drain=side.drain)


async def run_embedded(cfg: Config, host: str | None = None, port: int | None = None,
                       ready: asyncio.Event | None = None) -> None:
    emb = Embedded(cfg)
    side = await emb.start()
    await _serve_app(build_app(side.door), host or cfg.server.host, cfg.server.port if port is None else port,
                     cfg, ready, cleanup=[emb.stop], tls=False, front_door=True, drain=side.drain)


_BIND_HINTS = {
    errno.EADDRINUSE: "address already in use",
    errno.EADDRNOTAVAIL: "not an address of this machine (listen on 0.0.0.0 with --host, "
                         "or fix the host in the config)",
    errno.EACCES: "permission denied (ports below 1024 need privileges)",
}


async def _serve_app(app: web.Application, host: str, port: int, cfg: Config, ready: asyncio.Event | None,
                     cleanup, tls: bool = True, front_door: bool = False,
                     drain: Callable[[], Awaitable[None]] | None = None) -> None:
    """Serve `app` until SIGTERM/SIGINT, then `drain` (bounded by its own timeout) and
    `cleanup`.  `tls`: the node-link TLS of
    `[net.tls]`; `front_door`: the front door's (`[net.tls] front_door`).  An address that
    cannot be bound is a StartupError naming it."""
    from pddgw.net.tls import front_door_context, server_context

    ssl_ctx = front_door_context(cfg.net.tls) if front_door else server_context(cfg.net.tls) if tls else None
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
    await runner.setup()
    # The front door's connections go through its guard (api/guard.py: read timeouts, per-address cap).
    site = (GuardedSite(runner, host, port, ssl_context=ssl_ctx) if front_door
            else web.TCPSite(runner, host, port, ssl_context=ssl_ctx))
    try:
        await site.start()
    except OSError as e:
        for fn in cleanup:
            with contextlib.suppress(Exception):
                await fn()
        await runner.cleanup()
        reason = _BIND_HINTS.get(e.errno, (e.strerror or str(e)).lower())
        raise StartupError(f"cannot listen on {host}:{port}: {reason}") from None
    scheme = ("https" if ssl_ctx is not None else "http")
    log.info("serving", host=host, port=site.port, scheme=scheme, dtype=why(cfg.model))
    if ready is not None:
        ready.set()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError):   # not the main thread / platform
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    t_stop: float | None = None
    try:
        await stop.wait()
        t_stop = time.monotonic()
        log.info("shutting_down")
        if drain is not None:
            await drain()
    finally:
        for fn in cleanup:
            t = time.monotonic()
            with contextlib.suppress(Exception):
                await fn()
            _slow_step(getattr(fn, "__qualname__", repr(fn)), t)
        t = time.monotonic()
        await runner.cleanup()
        _slow_step("http server", t)
        if t_stop is not None:
            log.info("exited", seconds=round(time.monotonic() - t_stop, 3))


async def frozen_once_ready(serving: Coroutine[Any, Any, None], ready: asyncio.Event) -> None:
    """Await `serving`; once it sets `ready`, the process's start-up heap (modules, weights'
    wrappers, tokenizer, configs) is frozen, so the garbage collector no longer walks it: a full
    collection of the embedded deployment's 205 K tracked objects held the GIL 49-78 ms, the event
    loop and every engine step stalled meanwhile; ~0 ms once frozen (vLLM freezes its own too).
    Cancelled, it cancels `serving` and waits for it to unwind."""
    task = asyncio.ensure_future(serving)
    up = asyncio.ensure_future(ready.wait())
    try:
        await asyncio.wait({task, up}, return_when=asyncio.FIRST_COMPLETED)
        if ready.is_set():
            gc.collect()
            gc.freeze()
            log.info("startup_heap_frozen", objects=gc.get_freeze_count())
        await task
    finally:
        up.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def exit_process(code: int = 0) -> NoReturn:
    """End a `pddgw serve` process whose loop has shut down (every link, socket and engine is
    closed by then): the exit handlers run (atexit, weakref finalizers such as staged-KV
    files, logging's flush); the interpreter's own teardown does not.  That teardown only
    frees memory, one object at a time (torch's modules, the weights), which took 1-1.4 s
    of CPU on a loaded 2-core machine; the OS reclaims it at once."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()
    os._exit(code)


def _slow_step(step: str, since: float) -> None:
    """A shutdown step that took long is named in the log (a slow exit says where it went)."""
    seconds = time.monotonic() - since
    if seconds > 0.5:
        log.info("slow_shutdown_step", step=step, seconds=round(seconds, 3))
