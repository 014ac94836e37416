"""Soak: bounded load with scheduled faults against a real deployment; counts what must stay zero.

`python -m pddgw.bench.soak [--embedded] [--concurrency N] [--duration S] [--max-tokens N]
[--faults SPEC] [--json] [--keep DIR]`

1. Deployment (`pddgw.harness.deployment`): by default the 4-process PDD
   deployment on 127.0.0.1 (router, p0, rld0 in cluster A; md0 in cluster B
   behind a TCP proxy this process owns, so the WAN can be cut or slowed);
   `--embedded`: one `python -m pddgw serve` process (no faults).  Logs go
   to `<dir>/<node>.log`, kept with `--keep DIR` or when the run fails.
2. Load (`pddgw.harness.client`): `--concurrency` clients send greedy
   requests back to back for `--duration` seconds: multi-turn
   conversations (first turns P-RLD-MD, next turns P-MD) and, with
   probability `--singular-share`, a long uncached prompt with a short
   answer; then what is in flight has `--grace` seconds to end.
3. Faults (`--faults`, the actions: --help) at seconds from the start of
   the load; those not yet due when the last request has ended are skipped.
4. Checks: every request ends completed, with an error (by its code) or
   lost (no end by the grace period, or its socket dropped).  Streamed
   tokens must equal (errors: be a prefix of) what `pddgw generate` gives
   for that prompt (`--reference engine`: its code path here after the
   deployment stopped; `cli`: the command), `response.completed`'s ids the
   streamed ones, positions once and in order.  Then the router's
   /debug/state is polled until nothing is in use (or `--quiet-timeout`):
   what is left leaked (KV blocks, pins, in-flight entries).  Also RSS of
   every process after warm-up and at the end, TTFT P50/P99, throughput.
5. Exit 1 when a request was lost, a token wrong, a position out of order,
   something leaked or a process died unbidden; 2 when the deployment did
   not start or the options are wrong; else 0.

The 4-process router ends a request with an error after 30 s (below the
default grace of 45 s), the embedded default only after 600 s.  A node the
router cannot reach at the end is listed as unhealthy and not checked; one
the bench restarted is waited for.  float64 by default (`--dtype`): in
float32 a near-tie flip by batch composition would look like a wrong token.
`run_soak(SoakOptions(...))` is the entry point for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from pddgw.harness import deployment
from pddgw.harness.cluster import ClusterToml, toml_lines
from pddgw.harness.deployment import (Deployment, Fault, FaultRecord, OptionError, ProcRss, apply_faults,
                                      parse_faults)
from pddgw.harness.leaks import Leaks, measure_leaks, router_state
from pddgw.harness.client import Mix, Outcome, Progress, ask, check_outcomes, converse, references, tokens
from pddgw.sim.report import percentile
from pddgw.tables import add_output_args, emit, format_table

# ---- the deployment -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The 4-process deployment (tests/e2e/cluster.py's shape, larger pools for sustained load)."""

    dtype: str = "float64"
    wan_gbps: float = 0.05
    wan_latency_ms: float = 20.0         # one way
    p_md_max_transfer_ms: float = 100.0  # ~550 missing tokens of float64 tiny KV at 0.05 Gbps
    num_blocks: int = 1024               # P and RLD (block 16); MD: half as many blocks of 32
    # Below the default --grace: a request the router gives up on ends with an error, not lost.
    request_timeout_s: float = 30.0
    # A SIGTERMed worker (fault `sigterm`) finishes or moves its requests within this.
    drain_timeout_s: float = 10.0
    log_level: str = "info"

    def toml(self) -> ClusterToml:
        return ClusterToml(
            header="pddgw.bench.soak: router, p0, rld0 in cluster A; md0 in cluster B behind the bench's WAN proxy.",
            model=toml_lines(dtype=self.dtype),
            engine=toml_lines(num_blocks=self.num_blocks, block_size=16, max_num_batched_tokens=512),
            server=toml_lines(request_timeout_s=self.request_timeout_s, drain_timeout_s=self.drain_timeout_s),
            log=toml_lines(level=self.log_level),
            wan=toml_lines(gbps=self.wan_gbps, latency_ms=self.wan_latency_ms),
            policy=toml_lines(p_md_max_transfer_ms=self.p_md_max_transfer_ms),
            md_engine=toml_lines(block_size=32, num_blocks=self.num_blocks // 2, max_num_batched_tokens=512))


# ---- the run ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SoakOptions:
    embedded: bool = False
    concurrency: int = 8
    duration_s: float = 60.0
    max_tokens: int = 128
    turns: int = 4
    singular_share: float = 0.1
    faults: tuple[Fault, ...] = ()
    grace_s: float = 45.0
    quiet_timeout_s: float = 30.0
    seed: int = 0
    reference: str = "engine"           # "engine" | "cli"
    cluster: ClusterSpec = ClusterSpec()
    mix: Mix = Mix()
    keep: Path | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise OptionError("--concurrency must be >= 1")
        if self.duration_s <= 0 or self.grace_s < 0 or self.quiet_timeout_s < 0:
            raise OptionError("--duration must be > 0; --grace and --quiet-timeout >= 0")
        if self.max_tokens < 1 or self.turns < 1:
            raise OptionError("--max-tokens and --turns must be >= 1")
        if not 0.0 <= self.singular_share <= 1.0:
            raise OptionError("--singular-share must be in [0, 1]")
        if self.reference not in ("engine", "cli"):
            raise OptionError("--reference must be 'engine' or 'cli'")
        if self.embedded and self.faults:
            raise OptionError("--faults needs the 4-process deployment (one embedded process has no "
                              "worker to kill and no WAN socket to cut)")


@dataclass(frozen=True, slots=True)
class SoakReport:
    deployment: str                     # "4-process" | "embedded"
    dtype: str
    concurrency: int
    duration_s: float
    max_tokens: int
    faults: list[FaultRecord]
    requests: int                       # sent during the load (the warm-up is not counted)
    completed: int
    errors: int
    errors_by_code: dict[str, int]
    lost: int                           # no completion and no error by the end of the grace period
    lost_by_reason: dict[str, int]
    wrong_tokens: int                   # requests whose tokens differ from the reference
    positions_not_in_order: int         # requests whose positions came twice, skipped or out of order
    pipelines: dict[str, int]           # completed requests by the pipeline that finished them
    handoff_modes: dict[str, int]
    redriven: int                       # completed requests that were re-driven at least once
    router_counts: dict[str, int]       # the router's own decision counters at the end
    distinct_prompts: int
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    requests_per_s: float
    output_tokens_per_s: float
    load_s: float                       # from the first request to the last request's end
    leaks: Leaks
    rss: dict[str, ProcRss]
    examples: list[dict[str, Any]]      # the first wrong / out-of-order / lost requests, for the logs
    # GET /debug/state at the end of the grace period, when requests were still open (else None).
    stuck_state: dict[str, Any] | None
    logs: str | None                    # where the node logs are (kept with --keep or on failure)
    wall_s: float
    ok: bool                            # nothing lost, wrong, out of order or leaked; no process crashed


async def _soak(opts: SoakOptions, directory: Path) -> SoakReport:
    wall0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    dep = Deployment(directory, None if opts.embedded else opts.cluster.toml(), opts.cluster.dtype)
    outcomes: list[Outcome] = []
    records: list[FaultRecord] = []
    pending: list[asyncio.Task[None]] = []
    stuck_state: dict[str, Any] | None = None
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            await dep.start()
            # Warm-up: one request on a prompt that shares no block with the load (ids below its range).
            warm = Outcome("warmup", tuple(1 + i % 30 for i in range(64)), 4)
            async with session.ws_connect(dep.url + "/v1/responses") as ws:
                async with asyncio.timeout(120):
                    await ask(ws, warm)
            if warm.status != "completed":
                raise RuntimeError(f"warm-up request failed: {warm.code} {warm.message}\n{dep.procs.log('router')}")
            dep.sample_rss(end=False)

            rng = random.Random(opts.seed)
            shared = tokens(rng, opts.mix.shared_prefix_tokens)
            t0 = loop.time()
            unix0 = time.time()
            stop_at = t0 + opts.duration_s
            hard_deadline = stop_at + opts.grace_s
            progress = Progress(opts.progress, opts.duration_s, "soak")
            clients = [asyncio.create_task(converse(
                i, dep.url, session, shared, stop_at, outcomes, seed=opts.seed, mix=opts.mix,
                singular_share=opts.singular_share, max_tokens=opts.max_tokens, turns=opts.turns))
                for i in range(opts.concurrency)]
            faults = asyncio.create_task(apply_faults(opts.faults, dep, t0, opts.cluster.drain_timeout_s,
                                                       records, pending))
            try:
                while not all(c.done() for c in clients) and loop.time() < hard_deadline:
                    await asyncio.wait(clients, timeout=0.5)
                    progress.update(loop.time() - t0, outcomes)
                if not all(c.done() for c in clients):
                    with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                        stuck_state = await router_state(session, dep.url)()   # what holds the lost requests
            finally:
                progress.close()
                for c in clients:
                    c.cancel()              # past the grace period: what is still open is lost
                await asyncio.gather(*clients, return_exceptions=True)
                faults.cancel()
                await asyncio.gather(faults, return_exceptions=True)
            load_end = max([o.end_t for o in outcomes if o.end_t is not None], default=loop.time())
            for f in opts.faults:
                if not any(r.fault == str(f) for r in records):
                    records.append(FaultRecord(str(f), None, "skipped: the load was over"))
            if pending:                     # restarts under way: the node comes back before the leak check
                await asyncio.gather(*pending, return_exceptions=True)
            for o in outcomes:
                if o.status == "lost" and o.lost_reason is None:
                    o.lost_reason = "timeout"
            # A node restarted here must be reachable again before its pool counts as checked.
            restarted = [n for n, node in dep.procs.nodes.items() if node.restarts and node.alive]
            leaks, doc = await measure_leaks(router_state(session, dep.url), opts.quiet_timeout_s, restarted)
            dep.sample_rss(end=True)
        finally:
            await dep.stop()

    # References once per distinct (prompt, max tokens), after the deployment stopped.
    load = [o for o in outcomes if o.kind != "warmup"]
    ref = await references(load, opts.cluster.dtype, opts.reference)
    wrong, disorder, examples = check_outcomes(load, ref, t0, unix0)

    done = [o for o in load if o.status == "completed"]
    errs = [o for o in load if o.status == "error"]
    lost = [o for o in load if o.status == "lost"]
    ttft = [(o.first_t - o.sent_t) * 1e3 for o in done if o.first_t is not None]
    load_s = max(1e-9, load_end - t0)
    out_tokens = sum(len(o.tokens) for o in done)

    def r1(x: float | None) -> float | None:
        return None if x is None else round(x, 1)

    rss = dep.rss()
    crashed = [n for n, r in rss.items() if r.exit_code is not None and r.exit_code != -signal.SIGKILL]
    ok = not lost and not wrong and not disorder and leaks.quiet and not crashed
    report = SoakReport(
        deployment="embedded" if opts.embedded else "4-process", dtype=opts.cluster.dtype,
        concurrency=opts.concurrency, duration_s=opts.duration_s, max_tokens=opts.max_tokens,
        faults=sorted(records, key=lambda r: (r.at_s is None, r.at_s or 0.0)),
        requests=len(load), completed=len(done), errors=len(errs),
        errors_by_code=dict(sorted(Counter(o.code or "unknown" for o in errs).items())),
        lost=len(lost), lost_by_reason=dict(sorted(Counter(o.lost_reason or "timeout" for o in lost).items())),
        wrong_tokens=wrong, positions_not_in_order=disorder,
        pipelines=dict(sorted(Counter(o.pipeline or "?" for o in done).items())),
        handoff_modes=dict(sorted(Counter(o.handoff_mode for o in done if o.handoff_mode).items())),
        redriven=sum(1 for o in done if o.redrives),
        router_counts=dict(doc.get("router", {}).get("pipelines", {})),
        distinct_prompts=len({o.prompt for o in load}),
        ttft_p50_ms=r1(percentile(ttft, 50)), ttft_p99_ms=r1(percentile(ttft, 99)),
        requests_per_s=round(len(done) / load_s, 2), output_tokens_per_s=round(out_tokens / load_s, 1),
        load_s=round(load_s, 2), leaks=leaks, rss=rss, examples=examples, stuck_state=stuck_state, logs=None,
        wall_s=round(time.perf_counter() - wall0, 1), ok=ok)
    return report


def run_soak(opts: SoakOptions) -> SoakReport:
    """Start the deployment, load it, inject the faults, check; the logs stay when kept or on failure."""
    d = opts.keep if opts.keep is not None else Path(tempfile.mkdtemp(prefix="pddgw-soak-"))
    d.mkdir(parents=True, exist_ok=True)
    failed = True
    try:
        report = asyncio.run(_soak(opts, d))
        failed = not report.ok
        keep = opts.keep is not None or failed
        return replace(report, logs=str(d) if keep else None)
    finally:
        if opts.keep is None and not failed:
            shutil.rmtree(d, ignore_errors=True)
        elif failed:
            print(f"soak: node logs kept in {d}", file=sys.stderr)


# ---- output -------------------------------------------------------------------------


def _rows(rep: SoakReport) -> list[tuple[str, Any]]:
    lk = rep.leaks
    return [
        ("requests", rep.requests),
        ("completed", rep.completed),
        ("errors", rep.errors),
        *((f"  error {code}", n) for code, n in rep.errors_by_code.items()),
        ("lost", rep.lost),
        *((f"  lost: {why}", n) for why, n in rep.lost_by_reason.items()),
        ("wrong tokens", rep.wrong_tokens),
        ("positions not once in order", rep.positions_not_in_order),
        ("leaked KV blocks", lk.blocks),
        ("leaked pins", lk.pins),
        ("leaked in-flight entries", lk.inflight),
        ("quiet after (s)", lk.waited_s if lk.quiet else None),
        ("pipelines (completed)", ", ".join(f"{k} {v}" for k, v in rep.pipelines.items()) or "-"),
        ("handoff modes", ", ".join(f"{k} {v}" for k, v in rep.handoff_modes.items()) or "-"),
        ("re-driven (completed)", rep.redriven),
        ("distinct prompts", rep.distinct_prompts),
        ("TTFT P50 (ms)", rep.ttft_p50_ms),
        ("TTFT P99 (ms)", rep.ttft_p99_ms),
        ("requests/s", rep.requests_per_s),
        ("output tokens/s", rep.output_tokens_per_s),
    ]


def table(rep: SoakReport) -> str:
    """The human report: aligned tables like the other benches'."""
    head = (f"soak: {rep.deployment} deployment ({rep.dtype}), {rep.concurrency} clients for "
            f"{rep.duration_s:g} s, up to {rep.max_tokens} output tokens; load {rep.load_s:g} s, "
            f"wall {rep.wall_s:g} s -> {'OK' if rep.ok else 'FAILED'}")
    rss_rows = [(n, r.pid, r.start_kb, r.end_kb, r.growth_kb, r.kills, r.restarts,
                 "running" if r.exit_code is None else f"exited {r.exit_code}") for n, r in rep.rss.items()]
    rss_head = ["process", "pid", "RSS start kB", "RSS end kB", "growth kB", "kills", "restarts", "at the end"]
    fault_rows = [(f.fault, f.at_s, f.note) for f in rep.faults]
    extra = []
    if rep.leaks.leftovers:
        extra.append(f"left in use: {orjson.dumps(rep.leaks.leftovers).decode()}")
    if rep.leaks.unhealthy_nodes:
        extra.append(f"not checked (unreachable at the end): {', '.join(rep.leaks.unhealthy_nodes)}")
    extra += [f"{e['what']}: {orjson.dumps(e).decode()}" for e in rep.examples]
    if rep.logs:
        extra.append(f"node logs: {rep.logs}")
    parts = [head, "", format_table(["metric", "value"], _rows(rep)), "", format_table(rss_head, rss_rows)]
    if fault_rows:
        parts += ["", format_table(["fault", "at (s)", "what happened"], fault_rows)]
    return "\n".join(parts + ([""] + extra if extra else []))


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__ or ""
    faults = (deployment.__doc__ or "").split("a bad one):\n")[1].split("\n\n")[0] + "\n" \
        + "   Faults not yet due when the last request has ended are skipped.\n"
    p = argparse.ArgumentParser(
        prog="python -m pddgw.bench.soak", description=doc.split("\n\n")[0],
        epilog="faults: comma-separated SECONDS:ACTION=TARGET[@ARG], seconds from the start of the load:\n"
        + faults + "exit status: 0 all requests accounted for, tokens exact, positions in order, nothing left\n"
        "in use; 1 a request lost, a wrong token, a position out of order, a leak or a process that died\n"
        "unbidden; 2 bad options or the deployment did not start.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--embedded", action="store_true",
                   help="one `python -m pddgw serve` process (the embedded default) instead of 4 processes")
    p.add_argument("--concurrency", type=int, default=8, help="clients, one WebSocket and one request each")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (no new request after)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="output tokens per conversation turn (each asks for N/2..N; singular prompts 8)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--singular-share", type=float, default=0.1,
                   help="share of requests that are a long uncached prompt with a short answer")
    p.add_argument("--faults", default="", help="fault schedule, e.g. '10:kill=rld0@5,20:cut=wan,25:heal=wan' "
                   "(see below; 4-process deployment only)")
    p.add_argument("--grace", type=float, default=45.0,
                   help="seconds after the load for requests in flight to end (later: lost); the 4-process "
                   "router times requests out after 30 s, the embedded default after 600 s")
    p.add_argument("--quiet-timeout", type=float, default=30.0,
                   help="seconds to wait for every node to hold nothing (later: leaked)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16", "float16"],
                   help="model dtype of the deployment and the reference (float64: no near-tie flips)")
    spec = ClusterSpec()
    p.add_argument("--wan-gbps", type=float, default=spec.wan_gbps, help="4-process: the WAN's bandwidth")
    p.add_argument("--wan-latency-ms", type=float, default=spec.wan_latency_ms,
                   help="4-process: the WAN's one-way latency")
    p.add_argument("--reference", default="engine", choices=["engine", "cli"],
                   help="engine: `pddgw generate`'s code path in this process; cli: the command per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, help="keep config.toml and the node logs in this directory")
    add_output_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = SoakOptions(
            embedded=args.embedded, concurrency=args.concurrency, duration_s=args.duration,
            max_tokens=args.max_tokens, turns=args.turns, singular_share=args.singular_share,
            faults=tuple(parse_faults(args.faults)), grace_s=args.grace, quiet_timeout_s=args.quiet_timeout,
            seed=args.seed, reference=args.reference, keep=args.keep, progress=not args.json,
            cluster=ClusterSpec(dtype=args.dtype, wan_gbps=args.wan_gbps, wan_latency_ms=args.wan_latency_ms))
    except OptionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        rep = run_soak(opts)
    except RuntimeError as e:
        print(f"soak: the deployment failed: {e}", file=sys.stderr)
        return 2
    emit(rep, args.json, table(rep))
    return 0 if rep.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
