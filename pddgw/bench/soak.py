"""Soak: bounded load with scheduled faults against a real deployment; counts what must stay zero.

`python -m pddgw.bench.soak [--embedded] [--concurrency N] [--duration S] [--max-tokens N]
[--faults SPEC] [--json] [--keep DIR]`

1. Deployment: the 4-process PDD deployment on 127.0.0.1 (md0 in cluster B behind a TCP
   proxy this process owns, so the WAN can be cut or slowed), or `--embedded` (no faults).
   Node logs stay with `--keep DIR` or when the run fails.
2. Load (`pddgw.harness.client.run_load`): `--concurrency` clients send greedy multi-turn
   conversations (and, with `--singular-share`, long uncached prompts) for `--duration`
   seconds, then `--grace` seconds to end; `--faults` fire at seconds from the start.
3. Checks: every request completed, errored (by code) or lost; its tokens are
   `pddgw generate`'s (`--reference`; an error's a prefix), positions once and in order;
   then nothing in use on any reachable node within `--quiet-timeout`, else a leak.
   Also RSS per process, TTFT P50/P99, throughput.  Exit status: see --help.

float64 by default: in float32 a near-tie flip by batch composition would look like a wrong
token.  `run_soak(SoakOptions(...))` is the entry point for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from pddgw.harness import deployment
from pddgw.harness.client import Mix, run_load
from pddgw.harness.cluster import ClusterToml, toml_lines
from pddgw.harness.deployment import Fault, FaultRecord, OptionError, ProcRss, parse_faults
from pddgw.harness.leaks import Leaks
from pddgw.sim.report import percentile
from pddgw.tables import add_options, add_output_args, emit, format_table, from_options, option


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    """The 4-process deployment (tests/e2e/cluster.py's shape, larger pools for sustained load)."""

    dtype: str = option("float64", "model dtype of the deployment and the reference (float64: no near-tie flips)",
                        choices=["float64", "float32", "bfloat16", "float16"])
    wan_gbps: float = option(0.05, "4-process: the WAN's bandwidth")
    wan_latency_ms: float = option(20.0, "4-process: the WAN's one-way latency")
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


@dataclass(frozen=True, slots=True)
class SoakOptions:
    """What a run does; the fields made by `option` are the command line's options, in --help's order."""

    embedded: bool = option(False, "one `python -m pddgw serve` process (the embedded default) instead of 4 processes")
    concurrency: int = option(8, "clients, one WebSocket and one request each")
    duration_s: float = option(60.0, "seconds of load (no new request after)")
    max_tokens: int = option(128, "output tokens per conversation turn (each asks for N/2..N; singular prompts 8)")
    turns: int = option(4, "turns per conversation")
    singular_share: float = option(0.1, "share of requests that are a long uncached prompt with a short answer")
    # The option is the text `parse_faults` reads (in main, so that a bad item exits 2 with its message).
    faults: tuple[Fault, ...] = option((), "fault schedule, e.g. '10:kill=rld0@5,20:cut=wan,25:heal=wan' "
                                       "(see below; 4-process deployment only)", type=str, default="")
    grace_s: float = option(45.0, "seconds after the load for requests in flight to end (later: lost); the "
                            "4-process router times requests out after 30 s, the embedded default after 600 s")
    quiet_timeout_s: float = option(30.0, "seconds to wait for every node to hold nothing (later: leaked)")
    cluster: ClusterSpec = ClusterSpec()
    reference: str = option("engine", "engine: `pddgw generate`'s code path in this process; cli: the command "
                            "per prompt", choices=["engine", "cli"])
    seed: int = option(0)
    keep: Path | None = option(None, "keep config.toml and the node logs in this directory", type=Path)
    mix: Mix = Mix()
    progress: bool = True

    def __post_init__(self) -> None:
        for wrong, message in (
                (self.concurrency < 1, "--concurrency must be >= 1"),
                (self.duration_s <= 0 or self.grace_s < 0 or self.quiet_timeout_s < 0,
                 "--duration must be > 0; --grace and --quiet-timeout >= 0"),
                (self.max_tokens < 1 or self.turns < 1, "--max-tokens and --turns must be >= 1"),
                (not 0.0 <= self.singular_share <= 1.0, "--singular-share must be in [0, 1]"),
                (self.reference not in ("engine", "cli"), "--reference must be 'engine' or 'cli'"),
                (self.embedded and self.faults, "--faults needs the 4-process deployment (one embedded process "
                 "has no worker to kill and no WAN socket to cut)")):
            if wrong:
                raise OptionError(message)


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
    stuck_state: dict[str, Any] | None  # /debug/state after the grace period if requests were still open
    logs: str | None                    # where the node logs are (kept with --keep or on failure)
    wall_s: float
    ok: bool                            # nothing lost, wrong, out of order or leaked; no process crashed


def _tally(values: Iterable[str]) -> dict[str, int]:
    return dict(sorted(Counter(values).items()))


def run_soak(opts: SoakOptions) -> SoakReport:
    """Start the deployment, load it, inject the faults, check; the logs stay when kept or on failure."""
    wall0 = time.perf_counter()
    run = asyncio.run(run_load(
        None if opts.embedded else opts.cluster.toml(), opts.cluster.dtype, opts.faults, clients=opts.concurrency,
        duration_s=opts.duration_s, grace_s=opts.grace_s, quiet_timeout_s=opts.quiet_timeout_s,
        drain_timeout_s=opts.cluster.drain_timeout_s, reference=opts.reference, keep=opts.keep, name="soak",
        progress=opts.progress, seed=opts.seed, mix=opts.mix, singular_share=opts.singular_share,
        max_tokens=opts.max_tokens, turns=opts.turns))
    done, errs, lost = ([o for o in run.outcomes if o.status == s] for s in ("completed", "error", "lost"))
    ttft = [(o.first_t - o.sent_t) * 1e3 for o in done if o.first_t is not None]
    p50, p99 = (None if p is None else round(p, 1) for p in (percentile(ttft, 50), percentile(ttft, 99)))
    return SoakReport(
        deployment="embedded" if opts.embedded else "4-process", dtype=opts.cluster.dtype,
        concurrency=opts.concurrency, duration_s=opts.duration_s, max_tokens=opts.max_tokens, faults=run.faults,
        requests=len(run.outcomes), completed=len(done), errors=len(errs), errors_by_code=_tally(o.code for o in errs),
        lost=len(lost), lost_by_reason=_tally(o.lost_reason for o in lost),
        wrong_tokens=run.wrong_tokens, positions_not_in_order=run.positions_not_in_order,
        pipelines=_tally(o.pipeline or "?" for o in done),
        handoff_modes=_tally(o.handoff_mode for o in done if o.handoff_mode),
        redriven=sum(1 for o in done if o.redrives),
        router_counts=dict(run.state.get("router", {}).get("pipelines", {})),
        distinct_prompts=len({o.prompt for o in run.outcomes}), ttft_p50_ms=p50, ttft_p99_ms=p99,
        requests_per_s=round(len(done) / run.load_s, 2),
        output_tokens_per_s=round(sum(len(o.tokens) for o in done) / run.load_s, 1),
        load_s=round(run.load_s, 2), leaks=run.leaks, rss=run.rss, examples=run.examples,
        stuck_state=run.stuck_state, logs=run.logs, wall_s=round(time.perf_counter() - wall0, 1), ok=run.ok)


# ---- output -------------------------------------------------------------------------


def table(rep: SoakReport) -> str:
    """The human report: aligned tables like the other benches'."""
    def joined(counts: dict[str, int]) -> str:
        return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"

    lk = rep.leaks
    rows = [("requests", rep.requests), ("completed", rep.completed), ("errors", rep.errors),
            *((f"  error {code}", n) for code, n in rep.errors_by_code.items()),
            ("lost", rep.lost), *((f"  lost: {why}", n) for why, n in rep.lost_by_reason.items()),
            ("wrong tokens", rep.wrong_tokens), ("positions not once in order", rep.positions_not_in_order),
            ("leaked KV blocks", lk.blocks), ("leaked pins", lk.pins), ("leaked in-flight entries", lk.inflight),
            ("quiet after (s)", lk.waited_s if lk.quiet else None),
            ("pipelines (completed)", joined(rep.pipelines)), ("handoff modes", joined(rep.handoff_modes)),
            ("re-driven (completed)", rep.redriven), ("distinct prompts", rep.distinct_prompts),
            ("TTFT P50 (ms)", rep.ttft_p50_ms), ("TTFT P99 (ms)", rep.ttft_p99_ms),
            ("requests/s", rep.requests_per_s), ("output tokens/s", rep.output_tokens_per_s)]
    rss_rows = [(n, r.pid, r.start_kb, r.end_kb, r.growth_kb, r.kills, r.restarts,
                 "running" if r.exit_code is None else f"exited {r.exit_code}") for n, r in rep.rss.items()]
    rss_head = ["process", "pid", "RSS start kB", "RSS end kB", "growth kB", "kills", "restarts", "at the end"]
    head = (f"soak: {rep.deployment} deployment ({rep.dtype}), {rep.concurrency} clients for "
            f"{rep.duration_s:g} s, up to {rep.max_tokens} output tokens; load {rep.load_s:g} s, "
            f"wall {rep.wall_s:g} s -> {'OK' if rep.ok else 'FAILED'}")
    parts = [head, "", format_table(["metric", "value"], rows), "", format_table(rss_head, rss_rows)]
    if rep.faults:
        fault_rows = [(f.fault, f.at_s, f.note) for f in rep.faults]
        parts += ["", format_table(["fault", "at (s)", "what happened"], fault_rows)]
    extra = [f"left in use: {orjson.dumps(lk.leftovers).decode()}"] if lk.leftovers else []
    if lk.unhealthy_nodes:
        extra.append(f"not checked (unreachable at the end): {', '.join(lk.unhealthy_nodes)}")
    extra += [f"{e['what']}: {orjson.dumps(e).decode()}" for e in rep.examples]
    if rep.logs:
        extra.append(f"node logs: {rep.logs}")
    return "\n".join(parts + ([""] + extra if extra else []))


def build_parser() -> argparse.ArgumentParser:
    faults = (deployment.__doc__ or "").split("a bad one):\n")[1].split("\n\n")[0] + "\n" \
        + "   Faults not yet due when the last request has ended are skipped.\n"
    p = argparse.ArgumentParser(
        prog="python -m pddgw.bench.soak", description=(__doc__ or "").split("\n\n")[0],
        epilog="faults: comma-separated SECONDS:ACTION=TARGET[@ARG], seconds from the start of the load:\n"
        + faults + "exit status: 0 all requests accounted for, tokens exact, positions in order, nothing left\n"
        "in use; 1 a request lost, a wrong token, a position out of order, a leak or a process that died\n"
        "unbidden; 2 bad options or the deployment did not start.",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, SoakOptions)
    add_output_args(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        opts = from_options(SoakOptions, args, faults=tuple(parse_faults(args.faults)), progress=not args.json)
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
