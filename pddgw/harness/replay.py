"""A simulator workload replayed against a real router in real time, recorded as the simulator records it.

`play(url, workload)` plays `pddgw.sim.workload` conversations with
`pddgw.sim.cluster.play_conversation` over one WebSocket each and fills a
`RequestResult` per request the way `pddgw.sim.cluster` does;
`serve_and_play` starts the deployment of a config.toml (one `pddgw serve`
process per node) and plays on it.  `Workload`: what is played;
`SideResult`: one side's record.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from pddgw.harness.client import Answer, respond
from pddgw.harness.cluster import serve_processes
from pddgw.harness.leaks import measure_leaks, router_state
from pddgw.sim.cluster import RequestResult, play_conversation, token_digest
from pddgw.sim.workload import Conversation, Turn


@dataclass(frozen=True, slots=True)
class Workload:
    conversations: list[Conversation]
    shared_prefix: tuple[int, ...]


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


async def _ask(ws: aiohttp.ClientWebSocketResponse, prompt: tuple[int, ...], max_tokens: int,
               seed: int) -> Answer:
    """One sampled response (temperature 1); a socket that closes first ends it as an error "closed"."""
    ans = await respond(ws, Answer(), prompt, max_tokens, temperature=1.0, seed=seed)
    if ans.final is None:
        ans.final = {"type": "error", "error": {"code": "closed", "message": f"socket {ans.closed}"}}
    return ans


def _fill(res: RequestResult, t0: float, end: float, ans: Answer) -> None:
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


async def play(url: str, workload: Workload, *, router_url: str | None = None, warmup_tokens: int = 256,
               warmup_output: int = 8, timeout_s: float = 600.0) -> SideResult:
    """Replay `workload` against a running router in real time (what `run_deployment` does in virtual time).

    `router_url`: the router's http://host:port, whose /debug/state is polled
    at the end until every node is idle, for the leak counts.
    """
    loop = asyncio.get_running_loop()
    results: list[RequestResult] = []
    outputs: dict[str, tuple[int, ...]] = {}
    wall0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        sockets = [await session.ws_connect(url, max_msg_size=64 << 20) for _ in workload.conversations]
        try:
            if warmup_tokens:
                ans = await _ask(sockets[0], warmup_prompt(warmup_tokens), warmup_output, 1)
                if (ans.final or {}).get("type") != "response.completed":
                    raise RuntimeError(f"warm-up request failed: {ans.final}")
            t0 = loop.time()

            def over(ws: aiohttp.ClientWebSocketResponse):  # type: ignore[no-untyped-def]
                async def serve(res: RequestResult, prompt: tuple[int, ...], turn: Turn,
                                seed: int) -> tuple[int, ...]:
                    ans = await _ask(ws, prompt, turn.max_tokens, seed)
                    _fill(res, ans.sent_t, loop.time(), ans)
                    outputs[res.rid] = tuple(ans.tokens)
                    return outputs[res.rid]
                return serve

            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(play_conversation(c, workload.shared_prefix, t0, over(ws), results.append)
                                       for c, ws in zip(workload.conversations, sockets)))
            wall = time.perf_counter() - wall0
            # Until no node has a block in use or anything in flight (or 30 s): what is left leaked.
            leaks = (await measure_leaks(router_state(session, router_url), 30.0))[0] if router_url else None
            blocks, pins = (leaks.blocks, leaks.pins) if leaks else (0, 0)
        finally:
            for ws in sockets:
                await ws.close()
    results.sort(key=lambda r: (r.arrival_s, r.rid))
    return SideResult(results, wall, blocks, pins, outputs)


def serve_and_play(config_path: Path, ports: dict[str, int], workload: Workload, directory: Path,
                   **play_kw) -> SideResult:
    """The deployment as one `pddgw serve` process per node (pddgw.harness), the workload replayed on it."""
    procs = serve_processes(directory, config_path, ports)
    router = f"127.0.0.1:{ports['router']}"
    procs.start()
    try:
        return asyncio.run(play(f"ws://{router}/v1/responses", workload, router_url=f"http://{router}", **play_kw))
    except Exception as e:
        raise RuntimeError(f"real run failed: {e!r}\nrouter log:\n{procs.log('router')}") from e
    finally:
        procs.stop()
