"""Soak: bounded load with scheduled faults against a real deployment; counts what must stay zero.

`python -m pddgw.bench.soak [--embedded] [--concurrency N] [--duration S] [--max-tokens N]
[--faults SPEC] [--json] [--keep DIR]`

1. Deployment.  By default four `python -m pddgw serve --role R --node N
   --config CFG` processes on 127.0.0.1, free ports (router, p0 and rld0 in
   cluster A; md0 in cluster B), from a generated config.toml: the WAN
   between the clusters is shaped by the links themselves (`[[net.links]]
   name = "wan"`), and md0 is reached through a TCP proxy this process owns
   (the config gives md0 the proxy's port, md0 listens on its own), so the
   bench can cut the WAN or collapse its bandwidth.  `--embedded`: one
   `python -m pddgw serve` process (the embedded default; no faults).  Every
   process is started here and stopped here, by its pid; logs go to
   `<dir>/<node>.log` (kept with `--keep DIR`, or when the run fails).
2. Load.  `--concurrency` clients, one WebSocket each on /v1/responses, send
   greedy requests (temperature 0) back to back for `--duration` seconds:
   multi-turn conversations (a system prompt every conversation shares, a
   context of their own long enough that a first turn relays: P-RLD-MD;
   each next turn re-sends the conversation so far plus a short message:
   P-MD) and, with probability `--singular-share`, a long uncached prompt
   with a short answer (singular traffic: P-RLD, as far as the router's
   limiter allows).  Then no new request; what is in flight has `--grace`
   seconds to end.
3. Faults (`--faults`), at seconds from the start of the load, comma-separated
   `SECONDS:ACTION=TARGET[@ARG]`:
     kill=NODE[@S]   SIGKILL worker NODE (p0, rld0, md0); with @S start it again S seconds later
     restart=NODE    start a killed worker again (waits for its /health)
     sigterm=NODE    graceful restart: SIGTERM worker NODE (it drains within `[server]
                     drain_timeout_s`), start it again once it exited (waits for its /health)
     cut=wan         the WAN goes dark: open connections drop, new ones are refused
     slow=wan@MBPS   bandwidth collapse: the proxy forwards at most MBPS megabit/s each way
     heal=wan        the WAN back (undoes cut and slow)
   e.g. "10:kill=rld0@5,20:cut=wan,25:heal=wan,30:slow=wan@2,40:heal=wan".
   Faults not yet due when the last request has ended are skipped.
4. Checks.  Every request ends as completed, error (counted by its code,
   e.g. "overloaded" from the router's admission queue) or lost (no
   completion and no error event by the end of the grace period, or the
   socket dropped under it).  Streamed tokens (completed: all of them;
   errors: those that came) must equal (be a prefix of) the reference, what
   `python -m pddgw generate --prompt-ids ... --json` prints for that prompt
   (`--reference engine`, the default, runs that same code path once per
   distinct prompt in this process after the deployment stopped; `cli` runs
   the command itself); `response.completed`'s output ids must equal the
   streamed ones; positions must come once, in order.  Then the router's
   GET /debug/state is polled until nothing is in use (or `--quiet-timeout`):
   what is still there is a leak (KV blocks, pins, in-flight entries).  RSS
   of every process (/proc/PID/status) after warm-up and at the end; TTFT
   P50/P99 and throughput of the completed requests.
5. Exit status 1 when a request was lost, a token was wrong, a position came
   twice or out of order, something leaked or a process died that the bench
   did not kill; 2 when the deployment could not be started or the options
   are wrong; else 0.

"Lost" depends on `--grace`: the 4-process deployment's router ends a
request with an error after 30 s (`server.request_timeout_s`, below the
default grace of 45 s), the embedded default's only after 600 s, so there a
request stuck for longer than the grace counts as lost.  A node the router
cannot reach at the end (killed and not restarted, behind a cut WAN) is
listed as unhealthy and its pool is not checked; one the bench restarted is
waited for (within `--quiet-timeout`) until the router reaches it again.

float64 by default (`--dtype`): with float32, batch composition can flip a
near-tie between two tokens and show up as a wrong token that is not a bug.

The deployment, the WAN proxy, the WebSocket client, the leak check and the
references are `pddgw.harness`'s; what is here is the scenario: the load
mix, the fault schedule and the report.

`run_soak(SoakOptions(...))` is the entry point for tests
(tests/bench/test_bench_soak.py runs a CI-sized version).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from pddgw.bench.common import add_output_args, emit, format_table
from pddgw.harness.client import Answer, respond
from pddgw.harness.cluster import WORKERS, ClusterToml, free_ports, serve_processes, toml_lines
from pddgw.harness.launch import Node, Processes
from pddgw.harness.leaks import Leaks, measure_leaks, router_state
from pddgw.harness.ports import free_port
from pddgw.harness.proxy import FaultProxy
from pddgw.harness.reference import generate_cli_many, generate_engine
from pddgw.sim.report import percentile

WAN = "wan"
ACTIONS = ("kill", "restart", "sigterm", "cut", "slow", "heal")
TOKEN_LO, TOKEN_HI = 32, 127                          # printable bytes of the tiny model's vocabulary


# ---- faults -------------------------------------------------------------------------


class OptionError(ValueError):
    """A bad option value; the message names it."""


@dataclass(frozen=True, slots=True)
class Fault:
    at_s: float
    action: str           # one of ACTIONS
    target: str           # a worker node or "wan"
    arg: float | None     # kill: restart after this many s; slow: megabit/s

    def __str__(self) -> str:
        arg = "" if self.arg is None else f"@{self.arg:g}"
        return f"{self.at_s:g}:{self.action}={self.target}{arg}"


def parse_faults(text: str) -> list[Fault]:
    """`SECONDS:ACTION=TARGET[@ARG],...` -> faults sorted by time; OptionError names the bad item."""
    out: list[Fault] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        try:
            when, rest = item.split(":", 1)
            action, target = rest.split("=", 1)
            target, _, arg_s = target.partition("@")
            at_s = float(when)
            arg = float(arg_s) if arg_s else None
        except ValueError:
            raise OptionError(f"--faults: {item!r} is not SECONDS:ACTION=TARGET[@ARG]") from None
        action, target = action.strip(), target.strip()
        if at_s < 0:
            raise OptionError(f"--faults: {item!r}: the time must be >= 0")
        if action not in ACTIONS:
            raise OptionError(f"--faults: {item!r}: the action must be one of {', '.join(ACTIONS)}")
        if action in ("kill", "restart", "sigterm"):
            if target not in WORKERS:
                raise OptionError(f"--faults: {item!r}: {action} takes a worker node ({', '.join(WORKERS)})")
            if action in ("restart", "sigterm") and arg is not None:
                raise OptionError(f"--faults: {item!r}: {action} takes no @ARG")
            if arg is not None and arg < 0:
                raise OptionError(f"--faults: {item!r}: the restart delay must be >= 0")
        else:
            if target != WAN:
                raise OptionError(f"--faults: {item!r}: {action} takes the target 'wan'")
            if action == "slow" and (arg is None or arg <= 0):
                raise OptionError(f"--faults: {item!r}: slow needs @MBPS > 0")
            if action != "slow" and arg is not None:
                raise OptionError(f"--faults: {item!r}: {action} takes no @ARG")
        out.append(Fault(at_s, action, target, arg))
    return sorted(out, key=lambda f: f.at_s)


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


class Deployment:
    """The processes (pddgw.harness) and the WAN proxy on this event loop; the RSS the report shows.

    `embedded` = one `pddgw serve` process, else router + 3 workers.
    """

    def __init__(self, directory: Path, embedded: bool, spec: ClusterSpec):
        self.dir = directory
        self.embedded = embedded
        self.spec = spec
        self.procs = Processes(directory)
        self.proxy: FaultProxy | None = None
        self.router_port = 0
        self.rss_start_kb: dict[str, int | None] = {}    # after warm-up (after its restart, if restarted)
        self.rss_end_kb: dict[str, int | None] = {}
        self.exit_codes: dict[str, int | None] = {}      # at the end, before the bench stopped them

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    async def start(self, timeout_s: float = 180.0) -> None:
        if self.embedded:
            self.router_port = free_port()
            self.procs.add("embedded", ["serve", "--model", "tiny", "--host", "127.0.0.1", "--port", str(self.router_port),
                                        "--dtype", self.spec.dtype], self.router_port)
        else:
            ports = free_ports()
            self.router_port = ports["router"]
            self.proxy = FaultProxy(ports["md0"])
            await self.proxy.start()
            config = self.spec.toml().write(self.dir / "config.toml", ports, md_dialed=self.proxy.port)
            self.procs = serve_processes(self.dir, config, ports)
        for name in self.procs.nodes:
            self.procs.spawn(name)
        await self.procs.wait_ready_async(timeout_s=timeout_s)

    def log(self, name: str) -> str:
        return self.procs.log(name)

    async def kill(self, name: str) -> int | None:
        """SIGKILL by pid -> the pid (None: it was not running)."""
        return await asyncio.to_thread(self.procs.kill, name)

    async def sigterm(self, name: str, timeout_s: float) -> float | None:
        """SIGTERM by pid and wait for the exit -> seconds it took (None: it was not running);
        RuntimeError when it is still running after `timeout_s` (then SIGKILLed)."""
        node = self.procs.nodes[name]
        if not node.alive:
            return None
        assert node.proc is not None
        t0 = time.monotonic()
        node.proc.terminate()
        try:
            await asyncio.to_thread(node.proc.wait, timeout_s)
        except subprocess.TimeoutExpired:
            await self.kill(name)
            raise RuntimeError(f"{name} still ran {timeout_s:g} s after SIGTERM (SIGKILLed)") from None
        return time.monotonic() - t0

    async def restart(self, name: str, timeout_s: float = 120.0) -> bool:
        """Start a dead node again and wait for its /health (-> True), or nothing when it runs (-> False)."""
        if not self.procs.restart(name):
            return False
        await self.procs.wait_ready_async([name], timeout_s)
        self.rss_start_kb[name] = self.procs.rss_kb(name)
        return True

    def sample_rss(self, end: bool) -> None:
        for name, node in self.procs.nodes.items():
            if end:
                self.rss_end_kb[name] = self.procs.rss_kb(name)
                self.exit_codes[name] = node.returncode
            else:
                self.rss_start_kb[name] = self.procs.rss_kb(name)

    async def stop(self) -> None:
        """SIGTERM every live process (router first), SIGKILL what has not exited after 10 s."""
        await asyncio.to_thread(self.procs.stop)
        if self.proxy is not None:
            await self.proxy.close()



# ---- the workload -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Mix:
    """Prompt shapes: conversations (shared system prompt + own context + turns) and singular prompts."""

    shared_prefix_tokens: int = 128
    context_min: int = 800              # a first turn misses its own context on MD: more than the P-MD
    context_max: int = 1100             # budget carries (~550 tokens in cluster mode, ~713 embedded)
    message_min: int = 15
    message_max: int = 40
    singular_tokens: int = 2200         # > policy.singular_min_uncached_tokens (2048 by default)
    singular_max_output: int = 8        # <= policy.singular_max_output_tokens (16)
    max_prompt_tokens: int = 3800       # start a new conversation before the 4096 context fills


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(n)]


# ---- one request --------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    kind: str                                 # "turn" | "singular" | "warmup"
    prompt: tuple[int, ...]
    max_tokens: int
    status: str = "lost"                      # "completed" | "error" | "lost"
    lost_reason: str | None = None            # "timeout" | "socket_closed"
    code: str | None = None
    message: str | None = None
    completed_ids: list[int] | None = None
    pipeline: str | None = None
    handoff_mode: str | None = None
    redrives: int = 0
    # What streamed, filled as it comes (a cancelled request keeps what came before the cancel).
    answer: Answer = field(default_factory=Answer)

    @property
    def tokens(self) -> list[int]:
        return self.answer.tokens

    @property
    def positions_ok(self) -> bool:
        return self.answer.positions_ok

    @property
    def response_id(self) -> str | None:
        return self.answer.response_id or (self.answer.final or {}).get("response_id")

    @property
    def sent_t(self) -> float:
        return self.answer.sent_t

    @property
    def first_t(self) -> float | None:
        return self.answer.first_t

    @property
    def end_t(self) -> float | None:
        return self.answer.end_t


async def ask(ws: aiohttp.ClientWebSocketResponse, out: Outcome) -> None:
    """One greedy request (seed 0) into `out` (cancellation leaves it lost)."""
    a = await respond(ws, out.answer, out.prompt, out.max_tokens, temperature=0, seed=0)
    ev = a.final
    if ev is None:
        out.lost_reason = "socket_closed"
    elif ev["type"] == "response.completed":
        tl = ev["response"].get("pddgw") or {}
        out.status = "completed"
        out.completed_ids = list(tl.get("output_token_ids", a.tokens))
        out.pipeline, out.handoff_mode = tl.get("pipeline"), tl.get("handoff_mode")
        out.redrives = len(tl.get("redrives") or ())
    else:
        err = ev.get("error") or {}
        out.status = "error"
        out.code, out.message = str(err.get("code") or err.get("type") or "unknown"), err.get("message")


async def _state(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    try:
        return await router_state(session, url)()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


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
class FaultRecord:
    fault: str
    at_s: float | None                  # when it was applied (s from the start of the load); None: skipped
    note: str
    utc: str | None = None              # the same moment on the node logs' clock


def _utc(unix_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(unix_s)) + f".{int(unix_s % 1 * 1e6):06d}Z"


@dataclass(frozen=True, slots=True)
class ProcRss:
    pid: int | None                     # the last incarnation's
    start_kb: int | None                # after the warm-up; a restarted node: once healthy again
    end_kb: int | None                  # once quiet (None: not running)
    growth_kb: int | None
    kills: int
    restarts: int
    exit_code: int | None               # None: still running at the end (-9: SIGKILLed here)


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


class _Progress:
    """A tqdm bar over the load's seconds on a terminal (stderr); nothing otherwise."""

    def __init__(self, enabled: bool, total_s: float):
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=round(total_s), unit="s", file=sys.stderr, desc="soak", leave=False)

    def update(self, elapsed_s: float, outcomes: list[Outcome]) -> None:
        if self.bar is None:
            return
        c = Counter(o.status for o in outcomes if o.end_t is not None)
        self.bar.n = min(self.bar.total, int(elapsed_s))
        self.bar.set_postfix(done=c["completed"], errors=c["error"], refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def _client(i: int, opts: SoakOptions, url: str, session: aiohttp.ClientSession,
                  shared: list[int], stop_at: float, outcomes: list[Outcome]) -> None:
    """One client: conversations and singular prompts back to back until `stop_at`."""
    loop = asyncio.get_running_loop()
    rng = random.Random(opts.seed * 7919 + i)
    mix = opts.mix
    history: list[int] | None = None
    turns_left = 0
    ws: aiohttp.ClientWebSocketResponse | None = None
    try:
        while loop.time() < stop_at:
            if ws is None or ws.closed:
                try:
                    ws = await session.ws_connect(url + "/v1/responses", max_msg_size=64 << 20)
                except (aiohttp.ClientError, OSError):
                    await asyncio.sleep(0.5)
                    continue
            if rng.random() < opts.singular_share:
                out = Outcome("singular", tuple(_tokens(rng, mix.singular_tokens)),
                              min(mix.singular_max_output, opts.max_tokens))
            else:
                if history is None or turns_left <= 0 or len(history) + mix.message_max + opts.max_tokens \
                        > mix.max_prompt_tokens:
                    history = shared + _tokens(rng, rng.randint(mix.context_min, mix.context_max))
                    turns_left = opts.turns
                prompt = history + _tokens(rng, rng.randint(mix.message_min, mix.message_max))
                out = Outcome("turn", tuple(prompt), rng.randint(max(1, opts.max_tokens // 2), opts.max_tokens))
            outcomes.append(out)
            try:
                await ask(ws, out)
            except (aiohttp.ClientError, OSError, RuntimeError):     # the socket broke under the send
                out.lost_reason = "socket_closed"
                await ws.close()
            if out.kind == "turn":
                if out.status == "completed":
                    history = list(out.prompt) + out.tokens        # the conversation goes on from what came
                    turns_left -= 1
                else:
                    history = None
            if out.status != "completed":
                await asyncio.sleep(0.2)        # an error or a dropped socket: do not spin on a failing path
    finally:
        if ws is not None:
            await ws.close()


async def _apply_faults(faults: Sequence[Fault], dep: Deployment, t0: float,
                        records: list[FaultRecord], pending: list[asyncio.Task[None]]) -> None:
    loop = asyncio.get_running_loop()
    unix0 = time.time() - (loop.time() - t0)

    def record(label: str, at: float, note: str) -> None:
        records.append(FaultRecord(label, round(at, 2), note, _utc(unix0 + at)))

    async def restart(f: Fault, label: str, delay: float) -> None:
        await asyncio.sleep(delay)
        at = loop.time() - t0
        try:
            started = await dep.restart(f.target)
            note = (f"healthy again after {loop.time() - t0 - at:.1f} s" if started else "was running")
        except RuntimeError as e:
            note = f"restart failed: {e}"[:500]
        record(label, at, note)

    async def graceful(f: Fault) -> None:
        at = loop.time() - t0
        bound = dep.spec.drain_timeout_s + 20.0
        try:
            secs = await dep.sigterm(f.target, bound)
        except RuntimeError as e:
            record(str(f), at, str(e)[:500])
            return
        if secs is None:
            record(str(f), at, "was not running")
            return
        record(str(f), at, f"SIGTERM: exited after {secs:.1f} s (drain bound {dep.spec.drain_timeout_s:g} s)")
        await restart(f, f"(restart {f.target} after sigterm at {f.at_s:g})", 0.0)

    for f in faults:
        await asyncio.sleep(max(0.0, t0 + f.at_s - loop.time()))
        at = loop.time() - t0
        if f.action == "kill":
            pid = await dep.kill(f.target)
            note = "was not running" if pid is None else f"SIGKILL pid {pid}"
            record(str(f), at, note)
            if f.arg is not None:
                pending.append(asyncio.create_task(restart(f, f"(restart {f.target} after kill at {f.at_s:g})",
                                                           f.arg)))
        elif f.action == "restart":
            pending.append(asyncio.create_task(restart(f, str(f), 0.0)))
        elif f.action == "sigterm":
            pending.append(asyncio.create_task(graceful(f)))
        else:
            assert dep.proxy is not None
            if f.action == "cut":
                dep.proxy.cut()
                note = "WAN cut"
            elif f.action == "slow":
                dep.proxy.slow(f.arg or 0.0)
                note = f"WAN at {f.arg:g} Mbit/s each way"
            else:
                dep.proxy.heal()
                note = "WAN healed"
            record(str(f), at, note)


async def _soak(opts: SoakOptions, directory: Path) -> SoakReport:
    wall0 = time.perf_counter()
    loop = asyncio.get_running_loop()
    dep = Deployment(directory, opts.embedded, opts.cluster)
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
                raise RuntimeError(f"warm-up request failed: {warm.code} {warm.message}\n{dep.log('router')}")
            dep.sample_rss(end=False)

            rng = random.Random(opts.seed)
            shared = _tokens(rng, opts.mix.shared_prefix_tokens)
            t0 = loop.time()
            unix0 = time.time()
            stop_at = t0 + opts.duration_s
            hard_deadline = stop_at + opts.grace_s
            progress = _Progress(opts.progress, opts.duration_s)
            clients = [asyncio.create_task(_client(i, opts, dep.url, session, shared, stop_at, outcomes))
                       for i in range(opts.concurrency)]
            faults = asyncio.create_task(_apply_faults(opts.faults, dep, t0, records, pending))
            try:
                while not all(c.done() for c in clients) and loop.time() < hard_deadline:
                    await asyncio.wait(clients, timeout=0.5)
                    progress.update(loop.time() - t0, outcomes)
                if not all(c.done() for c in clients):
                    stuck_state = await _state(session, dep.url)    # what holds the lost requests
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
    distinct = sorted({(o.prompt, o.max_tokens) for o in load if o.status != "lost" or o.tokens})
    if opts.reference == "cli":
        refs = await generate_cli_many(distinct, opts.cluster.dtype)
    else:
        refs = await asyncio.to_thread(generate_engine, distinct, opts.cluster.dtype)
    ref = dict(zip(distinct, refs))

    examples: list[dict[str, Any]] = []

    def example(o: Outcome, what: str, **extra: Any) -> None:
        if len(examples) < 10:
            examples.append({"what": what, "kind": o.kind, "response_id": o.response_id,
                             "prompt_tokens": len(o.prompt), "max_tokens": o.max_tokens,
                             "sent_s": round(o.sent_t - t0, 3), "sent_utc": _utc(unix0 + o.sent_t - t0),
                             "status": o.status, "code": o.code,
                             "pipeline": o.pipeline, "streamed": len(o.tokens), **extra})

    wrong = disorder = 0
    for o in load:
        if o.status == "lost" and not o.tokens:
            continue
        expected = ref[(o.prompt, o.max_tokens)]
        bad = o.tokens != expected if o.status == "completed" else o.tokens != expected[:len(o.tokens)]
        if o.status == "completed" and o.completed_ids != o.tokens:
            bad = True
        if bad:
            wrong += 1
            first = next((k for k, (a, b) in enumerate(zip(o.tokens, expected)) if a != b),
                         min(len(o.tokens), len(expected)))
            example(o, "wrong tokens", first_difference=first, expected_len=len(expected),
                    completed_ids_match=o.completed_ids == o.tokens if o.completed_ids is not None else None)
        if not o.positions_ok:
            disorder += 1
            example(o, "positions not once in order")
    for o in load:
        if o.status == "lost":
            example(o, "lost", reason=o.lost_reason)

    done = [o for o in load if o.status == "completed"]
    errs = [o for o in load if o.status == "error"]
    lost = [o for o in load if o.status == "lost"]
    ttft = [(o.first_t - o.sent_t) * 1e3 for o in done if o.first_t is not None]
    load_s = max(1e-9, load_end - t0)
    out_tokens = sum(len(o.tokens) for o in done)

    def r1(x: float | None) -> float | None:
        return None if x is None else round(x, 1)

    def proc_rss(name: str, node: Node) -> ProcRss:
        start, end = dep.rss_start_kb.get(name), dep.rss_end_kb.get(name)
        return ProcRss(node.proc.pid if node.proc else None, start, end,
                       None if start is None or end is None else end - start, node.kills, node.restarts,
                       dep.exit_codes.get(name))

    rss = {name: proc_rss(name, node) for name, node in dep.procs.nodes.items()}
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
    faults = doc.split("`SECONDS:ACTION=TARGET[@ARG]`:\n")[1].split("4. Checks")[0]
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
