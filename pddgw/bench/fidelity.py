"""Fidelity of the simulator: one deployment and one workload, simulated and in real time.

`python -m pddgw.bench.fidelity [--json] [--requests N] [--conversations N] [--keep DIR]`

The simulator's claim (DESIGN.md §8) is that it runs the real router,
policy, state machine and workers, only on a virtual clock.  This benchmark
checks the claim end to end:

1. It writes one config.toml for a small deployment (router, P and RLD in
   cluster A, MD in cluster B; cost-model engines of a real model shape on
   H100/H200 profiles; a WAN shaped as `[[net.links]] name = "wan"`, which the
   router also takes as its bandwidth/RTT prior) with free loopback ports and
   a fresh random link secret.
2. Simulated: `run_virtual(run_deployment(load_config(file), conversations,
   prefix))` - in-process links, virtual time.
3. Real: the same file served by four `python -m pddgw serve --role R --node N`
   processes over real WebSocket links, the cost-model engines sleeping each
   step's modeled time and the links delaying each frame by its shaped time.
   A client replays the *same* conversations (same `pddgw.sim.workload`
   objects, seeds, arrival and think times, prompts built by `PromptBuilder`
   from the answers' token ids) against the router's `/v1/responses`
   WebSocket in real time, and records what `pddgw.sim.cluster` records:
   TTFT (send -> first delta), inter-token gaps, E2E, pipeline, tokens by
   role, MD's prefix hit.
4. It compares TTFT P50/P99, RLD's share of output tokens, mean E2E and the
   pipeline mix (real / sim, and whether each is within the tolerance, 15 %
   by default), and checks that every request produced exactly the same
   output token ids on both sides (by `pddgw.sim.cluster.token_digest`; the
   cost-model engine draws the token at output position i from (seed, i)
   alone, so any difference is a bug), and that no node holds a KV block
   or a pin once both runs are idle.

Why the numbers can agree: everything the user waits for is modeled time
(prefill and decode steps of a 32B model, tens of ms each; WAN latency and
serialization), and the real run only adds what the model leaves out -
Python, loopback sockets and process scheduling, ~0.1-1 ms per hop and step.
The default model (qwen3-32b, 1 GPU) keeps decode steps at ~19-26 ms so
those overheads stay a few per cent (with llama3-8b's ~8 ms steps the same
run drifted: RLD token share and P-RLD-MD share 16-17 % low); KV frames are
large (`kv_frame_bytes`) so a 2K-token prompt crosses a link in a few
frames, not hundreds.  Pipeline choices that depend on timing (a request
arriving while another's KV is still on the WAN sees it as backlog) may
differ between the two runs; the report counts the requests whose pipeline
agrees.
The processes are warmed up with one request on an unrelated prompt (shares
no prefix block with the workload) before the real clock starts, so the
first measured request does not pay for lazy imports and cold code paths.

`run_fidelity(...)` is the entry point for tests (tests/sim/test_fidelity.py
runs a CI-sized version).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

from pddgw.bench.common import add_output_args, emit, format_table, free_port, pdd_nodes_toml, ratio
from pddgw.config import load_config
from pddgw.logs import setup_logging
from pddgw.sim.clock import run_virtual
from pddgw.sim.cluster import RequestResult, play_conversation, run_deployment, token_digest
from pddgw.sim.report import percentile
from pddgw.sim.workload import AgenticSpec, Conversation, Turn, agentic, shared_prefix

TOLERANCE = 0.15
NODES = (("md0", "md"), ("rld0", "rld"), ("p0", "prefill"), ("router", "router"))   # start order


# ---- the deployment -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DeploymentSpec:
    """The small deployment both sides run (one config.toml)."""

    model: str = "qwen3-32b"                 # pddgw.sim.profiles.MODELS
    a_hardware: str = "H100-SXM"             # P and RLD (cluster A)
    b_hardware: str = "H200-SXM"             # MD (cluster B)
    wan_gbps: float = 10.0
    wan_latency_ms: float = 15.0             # one way
    p_md_max_transfer_ms: float = 200.0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Large frames: a virtual KV chunk carries no bytes, but each frame is one
    # message through Python on both ends.
    kv_frame_bytes: int = 64 << 20


def _engine_toml(spec: DeploymentSpec, hardware: str) -> str:
    return f'''implementation = "costmodel"
num_blocks = 0
block_size = {spec.block_size}
max_num_seqs = {spec.max_num_seqs}
max_num_batched_tokens = {spec.max_num_batched_tokens}
enable_prefix_caching = true
costmodel = {{ hardware = "{hardware}", tensor_parallel = 1, gpu_memory_utilization = 0.9 }}
'''


def write_config(directory: Path, spec: DeploymentSpec) -> tuple[Path, dict[str, int]]:
    """config.toml for `spec` in `directory`, on free loopback ports -> (path, ports by node)."""
    ports = {name: free_port() for name, _ in NODES}
    text = f'''# pddgw.bench.fidelity: the same deployment simulated and served by real processes.
[model]
profile = "{spec.model}"

[engine]
{_engine_toml(spec, spec.a_hardware)}
[server]
host = "127.0.0.1"
port = {ports["router"]}
request_timeout_s = 300

[log]
level = "warning"

[net]
secret = "{secrets.token_urlsafe(32)}"
kv_frame_bytes = {spec.kv_frame_bytes}
max_frame_bytes = {spec.kv_frame_bytes}
inbound_buffer_bytes = {max(spec.kv_frame_bytes, 64 << 20)}
heartbeat_s = 1.0
dead_after_s = 10.0
request_timeout_s = 30.0

[[net.links]]
name = "wan"
gbps = {spec.wan_gbps}
latency_ms = {spec.wan_latency_ms}

[policy]
p_md_max_transfer_ms = {spec.p_md_max_transfer_ms}

{pdd_nodes_toml(ports["p0"], ports["rld0"], ports["md0"], md_engine=_engine_toml(spec, spec.b_hardware))}'''
    path = directory / "config.toml"
    path.write_text(text)
    load_config(path)            # fail here, naming the key, rather than in four processes
    return path, ports


# ---- the workload -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: list[Conversation]
    shared_prefix: tuple[int, ...]


def default_workload(requests: int = 48, conversations: int = 8, seed: int = 0, *, rate: float = 1.0,
                     context_tokens: int = 2048, output_tokens: int = 48,
                     shared_prefix_tokens: int = 1024) -> Workload:
    """Agentic conversations of `requests // conversations` turns each.

    Follow-up turns keep 95-100 % of the previous context (a tail of tens
    of tokens crosses the WAN: P-MD) or, one time in three, 25-50 % (a
    thousand-plus missing tokens, far over the P-MD budget: P-RLD-MD).
    """
    turns = max(1, requests // conversations)
    spec = AgenticSpec(requests=turns * conversations, rate=rate, context_tokens=context_tokens,
                       output_tokens=output_tokens, shared_prefix_tokens=shared_prefix_tokens,
                       turns_min=turns, turns_max=turns, think_s_min=0.5, think_s_max=2.0,
                       hit_buckets=((2.0, 0.95, 1.0), (1.0, 0.25, 0.5)))
    return Workload(agentic(spec, seed), shared_prefix(shared_prefix_tokens, seed))


# ---- simulated --------------------------------------------------------------------------


@dataclass(slots=True)
class SideResult:
    # Sorted by (arrival, rid); `output_digest` identifies each request's output ids on both sides.
    requests: list[RequestResult]
    wall_s: float
    # KV blocks in use and prefix pins left on any node once everything finished (must be 0).
    leaked_blocks: int = 0
    leaked_pins: int = 0
    # rid -> output token ids (the real side; the simulator reports digests only).
    output_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)


def simulate(config_path: Path, workload: Workload) -> SideResult:
    """The workload on the deployment of `config_path`, on a virtual clock."""
    cfg = load_config(config_path)
    t0 = time.perf_counter()
    run = run_virtual(run_deployment(cfg, workload.conversations, workload.shared_prefix))
    return SideResult(run.requests, time.perf_counter() - t0, run.leaked_blocks, run.leaked_pins)


# ---- real processes ----------------------------------------------------------------------


class ServeProcesses:
    """The deployment of `config` as one `python -m pddgw serve` process per node.

    Every process started here is stopped here, by its pid.  Logs go to
    `<directory>/<node>.log`.
    """

    def __init__(self, config: Path, ports: dict[str, int], directory: Path):
        self.config = config
        self.ports = ports
        self.dir = directory
        self.procs: dict[str, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.ports['router']}/v1/responses"

    @property
    def state_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}/debug/state"

    def start(self, timeout_s: float = 120.0) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name, role in NODES:
            with open(self.dir / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(
                    [sys.executable, "-m", "pddgw", "serve", "--config", str(self.config), "--role", role,
                     "--node", name], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + timeout_s
        pending = [name for name, _ in NODES]
        while pending:
            for name in list(pending):
                p = self.procs[name]
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited early (rc {p.returncode}):\n{self.log(name)}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{self.ports[name]}/health", timeout=1.0) as r:
                        if r.status == 200:
                            pending.remove(name)
                except OSError:
                    pass
            if pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{', '.join(pending)} did not come up within {timeout_s:.0f} s:\n"
                                       + "\n".join(self.log(n) for n in pending))
                time.sleep(0.2)

    def log(self, name: str) -> str:
        try:
            return (self.dir / f"{name}.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for name, _ in reversed(NODES):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def __enter__(self) -> ServeProcesses:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Answer:
    """One response as the client saw it."""

    __slots__ = ("tokens", "first_t", "last_t", "itl", "final")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.first_t: float | None = None
        self.last_t = 0.0
        self.itl = array("d")
        self.final: dict | None = None


async def _ask(ws: aiohttp.ClientWebSocketResponse, prompt: tuple[int, ...], max_tokens: int, seed: int,
               loop: asyncio.AbstractEventLoop) -> tuple[float, _Answer]:
    """Send one response.create and read its events -> (send time, answer)."""
    ans = _Answer()
    t0 = loop.time()
    await ws.send_bytes(orjson.dumps({"type": "response.create", "prompt_token_ids": prompt,
                                      "max_output_tokens": max_tokens, "temperature": 1.0, "seed": seed}))
    while True:
        msg = await ws.receive()
        now = loop.time()
        if msg.type not in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            ans.final = {"type": "error", "error": {"code": "closed", "message": f"socket {msg.type.name}"}}
            return t0, ans
        ev = orjson.loads(msg.data)
        kind = ev["type"]
        if kind == "response.output_text.delta":
            ids = ev["pddgw"]["token_ids"]
            if ans.first_t is None:
                ans.first_t = now
            else:
                ans.itl.append(now - ans.last_t)
            ans.itl.extend([0.0] * (len(ids) - 1))
            ans.last_t = now
            ans.tokens += ids
        elif kind in ("response.completed", "error"):
            ans.final = ev
            return t0, ans


def _fill(res: RequestResult, t0: float, end: float, ans: _Answer) -> None:
    """The fields `pddgw.sim.cluster._one` fills, from the client's view of one response."""
    res.output_tokens = len(ans.tokens)
    if ans.first_t is not None:
        res.ttft_s = ans.first_t - t0
        res.itl_s = ans.itl
    final = ans.final or {}
    if final.get("type") != "response.completed":
        err = final.get("error", {})
        res.error = f"{err.get('code')}: {err.get('message')}"
        return
    resp = final["response"]
    tl = resp["pddgw"]
    res.e2e_s = end - t0
    if res.ttft_s is not None and len(ans.tokens) > 1:
        res.tpot_s = (ans.last_t - t0 - res.ttft_s) / (len(ans.tokens) - 1)
    res.pipeline, res.handoff_mode, res.handoff_stall_ms = tl["pipeline"], tl["handoff_mode"], tl["handoff_stall_ms"]
    res.catchup_rounds = max(0, len(tl["handoff_positions"]) - 1)
    res.rld_tokens = tl["tokens_by_role"].get("rld", 0)
    res.md_tokens = tl["tokens_by_role"].get("md", 0)
    res.md_cached_tokens = resp["usage"]["input_tokens_details"]["cached_tokens"]
    res.output_digest = token_digest(ans.tokens)
    if list(tl["output_token_ids"]) != ans.tokens:
        res.error = "client_mismatch: the streamed deltas differ from response.completed's output_token_ids"


def warmup_prompt(length: int) -> tuple[int, ...]:
    """A prompt that shares no prefix block with any workload prompt (ids below the workload's range)."""
    return tuple(100 + i % 800 for i in range(length))


async def _wait_idle(session: aiohttp.ClientSession, state_url: str, timeout_s: float) -> tuple[int, int]:
    """Until no node has a block in use or anything in flight -> (blocks in use, pins) at the end."""
    deadline = time.monotonic() + timeout_s
    while True:
        async with session.get(state_url) as r:
            st = await r.json()
        nodes = [n for n in st["nodes"].values() if n.get("healthy")]
        blocks = sum(n["kv_blocks_in_use"] for n in nodes)
        pins = sum(n["inflight"]["pins"] for n in nodes)
        busy = blocks or any(any(n["inflight"].values()) for n in nodes) or st["router"]["active_requests"]
        if not busy or time.monotonic() > deadline:
            return blocks, pins
        await asyncio.sleep(0.1)


async def play(url: str, workload: Workload, *, state_url: str | None = None, warmup_tokens: int = 256,
               warmup_output: int = 8, timeout_s: float = 600.0) -> SideResult:
    """Replay `workload` against a running router in real time (what `run_deployment` does in virtual time).

    `state_url`: the router's /debug/state, polled at the end until every
    node is idle, for the leak counts.
    """
    loop = asyncio.get_running_loop()
    results: list[RequestResult] = []
    outputs: dict[str, tuple[int, ...]] = {}
    wall0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        sockets = [await session.ws_connect(url, max_msg_size=64 << 20) for _ in workload.conversations]
        try:
            if warmup_tokens:
                _, ans = await _ask(sockets[0], warmup_prompt(warmup_tokens), warmup_output, 1, loop)
                if (ans.final or {}).get("type") != "response.completed":
                    raise RuntimeError(f"warm-up request failed: {ans.final}")
            t0 = loop.time()

            def over(ws: aiohttp.ClientWebSocketResponse):  # type: ignore[no-untyped-def]
                async def serve(res: RequestResult, prompt: tuple[int, ...], turn: Turn,
                                seed: int) -> tuple[int, ...]:
                    sent, ans = await _ask(ws, prompt, turn.max_tokens, seed, loop)
                    _fill(res, sent, loop.time(), ans)
                    outputs[res.rid] = tuple(ans.tokens)
                    return outputs[res.rid]
                return serve

            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(play_conversation(c, workload.shared_prefix, t0, over(ws), results.append)
                                       for c, ws in zip(workload.conversations, sockets)))
            wall = time.perf_counter() - wall0
            blocks, pins = await _wait_idle(session, state_url, 30.0) if state_url else (0, 0)
        finally:
            for ws in sockets:
                await ws.close()
    results.sort(key=lambda r: (r.arrival_s, r.rid))
    return SideResult(results, wall, blocks, pins, outputs)


def serve_and_play(config_path: Path, ports: dict[str, int], workload: Workload, directory: Path,
                   **play_kw) -> SideResult:
    with ServeProcesses(config_path, ports, directory) as procs:
        try:
            return asyncio.run(play(procs.url, workload, state_url=procs.state_url, **play_kw))
        except Exception as e:
            raise RuntimeError(f"real run failed: {e!r}\nrouter log:\n{procs.log('router')}") from e


# ---- comparison ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    sim: float | None
    real: float | None
    ratio: float | None                 # real / sim
    within: bool


@dataclass(frozen=True, slots=True)
class FidelityReport:
    model: str
    hardware: str
    wan: str
    requests: int
    completed_sim: int
    completed_real: int
    same_output_ids: int                # requests whose output ids agree on both sides
    same_pipeline: int
    leaked_sim: int                     # KV blocks + pins left in use once idle (must be 0)
    leaked_real: int
    tolerance: float
    metrics: list[Metric]
    sim_wall_s: float
    real_wall_s: float

    def metric(self, name: str) -> Metric:
        return next(m for m in self.metrics if m.name == name)


@dataclass(slots=True)
class FidelityRun:
    report: FidelityReport
    sim: SideResult
    real: SideResult
    directory: Path


def _stats(side: SideResult) -> dict[str, float | None]:
    ok = [r for r in side.requests if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    rld = sum(r.rld_tokens for r in ok)
    out = rld + sum(r.md_tokens for r in ok)
    mix = Counter(r.pipeline for r in ok)
    p50, p99 = percentile(ttft, 50), percentile(ttft, 99)
    return {
        "TTFT P50 (ms)": None if p50 is None else p50 * 1e3,
        "TTFT P99 (ms)": None if p99 is None else p99 * 1e3,
        "RLD token share": rld / out if out else None,
        "mean E2E (s)": sum(e2e) / len(e2e) if e2e else None,
        "P-RLD-MD share": mix["P-RLD-MD"] / len(ok) if ok else None,
    }


def _agree(sim: float | None, real: float | None, tol: float) -> bool:
    if sim is None or real is None:
        return sim is None and real is None
    if sim == 0:
        return real == 0
    return abs(real / sim - 1.0) <= tol


def compare(spec: DeploymentSpec, sim: SideResult, real: SideResult, tol: float = TOLERANCE) -> FidelityReport:
    a, b = _stats(sim), _stats(real)
    def r4(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    metrics = [Metric(k, r4(a[k]), r4(b[k]), r4(ratio(b[k], a[k])), _agree(a[k], b[k], tol)) for k in a]
    by_rid = {r.rid: r for r in real.requests}
    same_pipeline = sum(1 for r in sim.requests if r.rid in by_rid and r.pipeline is not None
                        and by_rid[r.rid].pipeline == r.pipeline)
    same_ids = sum(1 for r in sim.requests if r.rid in by_rid and r.error is None
                   and by_rid[r.rid].output_digest == r.output_digest)
    return FidelityReport(
        model=spec.model, hardware=f"A {spec.a_hardware}, B {spec.b_hardware} (TP 1)",
        wan=f"{spec.wan_gbps:g} Gbps, {2 * spec.wan_latency_ms:g} ms RTT",
        requests=len(sim.requests), completed_sim=sum(r.error is None for r in sim.requests),
        completed_real=sum(r.error is None for r in real.requests), same_output_ids=same_ids,
        same_pipeline=same_pipeline, leaked_sim=sim.leaked_blocks + sim.leaked_pins,
        leaked_real=real.leaked_blocks + real.leaked_pins, tolerance=tol, metrics=metrics,
        sim_wall_s=round(sim.wall_s, 2), real_wall_s=round(real.wall_s, 2))


def run_fidelity(workload: Workload, spec: DeploymentSpec = DeploymentSpec(), *, directory: Path | None = None,
                 tolerance: float = TOLERANCE, **play_kw) -> FidelityRun:
    """Write the config, simulate, serve for real, replay, compare.

    `directory` keeps the config and the node logs (default: a temporary
    directory, removed afterwards).
    """
    owned = directory is None
    d = Path(tempfile.mkdtemp(prefix="pddgw-fidelity-")) if owned else directory
    d.mkdir(parents=True, exist_ok=True)
    try:
        path, ports = write_config(d, spec)
        sim = simulate(path, workload)
        real = serve_and_play(path, ports, workload, d, **play_kw)
        return FidelityRun(compare(spec, sim, real, tolerance), sim, real, d)
    finally:
        if owned:
            shutil.rmtree(d, ignore_errors=True)


def table(rep: FidelityReport) -> str:
    rows = [(m.name, m.sim, m.real, m.ratio, m.within) for m in rep.metrics]
    head = (f"{rep.model} on {rep.hardware}; WAN {rep.wan}; {rep.requests} requests "
            f"(completed: sim {rep.completed_sim}, real {rep.completed_real}; same output ids "
            f"{rep.same_output_ids}/{rep.requests}; same pipeline {rep.same_pipeline}/{rep.requests})")
    tail = (f"KV blocks + pins left in use: simulated {rep.leaked_sim}, real {rep.leaked_real}; "
            f"wall time: simulated {rep.sim_wall_s:.1f} s, real {rep.real_wall_s:.1f} s")
    return "\n".join([head, "", format_table(
        ["metric", "simulated", "real", "real/sim", f"within {rep.tolerance:.0%}"], rows), "", tail])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_args(p)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second once conversations overlap")
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--context-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    dflt = DeploymentSpec()
    p.add_argument("--model", default=dflt.model)
    p.add_argument("--wan-gbps", type=float, default=dflt.wan_gbps)
    p.add_argument("--wan-latency-ms", type=float, default=dflt.wan_latency_ms)
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--keep", type=Path, help="keep config.toml and the node logs in this directory")
    args = p.parse_args(argv)
    setup_logging("warning")
    spec = DeploymentSpec(model=args.model, wan_gbps=args.wan_gbps, wan_latency_ms=args.wan_latency_ms)
    wl = default_workload(args.requests, args.conversations, args.seed, rate=args.rate,
                          context_tokens=args.context_tokens, output_tokens=args.output_tokens,
                          shared_prefix_tokens=args.context_tokens // 2)
    run = run_fidelity(wl, spec, directory=args.keep, tolerance=args.tolerance)
    emit(run.report, args.json, table(run.report))
    rep = run.report
    sound = (rep.completed_sim == rep.completed_real == rep.same_output_ids == rep.requests
             and not rep.leaked_sim and not rep.leaked_real)
    return 0 if sound and all(m.within for m in rep.metrics) else 1


if __name__ == "__main__":
    raise SystemExit(main())
