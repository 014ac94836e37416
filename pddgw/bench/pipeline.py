"""Agentic multi-turn traffic through the embedded deployment: PDD vs naive cross-DC PD.

`python -m pddgw.bench.pipeline [--json] [--conversations N] [--turns T]`

Both run the embedded default (router, P, RLD in cluster A; MD in cluster B over the emulated WAN,
built-in tiny model) on the same traffic and the same WAN (derived once from the measured decode
step, see `[net.regime]`).  PDD: the policy picks P-MD or P-RLD-MD per request, MD keeps a prefix
cache (only missing KV crosses the WAN), RLD covers slow transfers.  Naive: P-MD only, MD without a
prefix cache (every request waits for its whole prompt KV to cross the WAN before its first token).

Traffic: N conversations arrive as a Poisson process and overlap; each is a long system prompt
(900-1,500 uncached tokens, different per conversation), then T turns, each re-sending the
conversation so far plus a new user message after a short think time.  With `--trace`, a
Mooncake-format trace is replayed instead (block ids -> shared token blocks, lengths scaled to the
tiny model).  Reports TTFT P50/P99 side by side (and their ratio), the share of requests per
pipeline, the share of output tokens RLD produced and the largest handoff stall.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time
from collections import Counter
from itertools import accumulate

from aiohttp.test_utils import TestClient, TestServer

from pddgw.api.server import build_app
from pddgw.config import Config, EngineConfig, NetConfig, PolicyConfig, RegimeConfig
from pddgw.logs import setup_logging
from pddgw.deploy.regime import DerivedWan
from pddgw.deploy.serve import Embedded, embedded_nodes
from pddgw.harness.client import Answer, respond, tokens
from pddgw.sim.report import percentile
from pddgw.sim.workload import TRACE_BLOCK_TOKENS, read_mooncake
from pddgw.tables import add_output_args, emit, format_table


def make_config(naive: bool, step_ms: float = 0.0) -> Config:
    """The embedded default; its WAN derived from `step_ms` (0 = measured at start, see [net.regime])."""
    cfg = Config(engine=EngineConfig(num_blocks=2048, max_num_batched_tokens=1024),
                 net=NetConfig(regime=RegimeConfig(step_ms=step_ms)))
    if not naive:
        return cfg
    nodes = tuple(dataclasses.replace(n, engine=dataclasses.replace(n.engine, enable_prefix_caching=False))
                  if n.role == "md" else n for n in embedded_nodes(cfg))
    return dataclasses.replace(cfg, nodes=nodes, policy=PolicyConfig(pipeline="P-MD"))


async def _ask(ws, prompt: list[int], max_tokens: int, what: str) -> dict:
    """One greedy response -> its `pddgw` timeline plus `ttft_ms`, the TTFT as the client saw it."""
    ans = await respond(ws, Answer(), prompt, max_tokens)
    final = ans.final or {"type": "error", "error": f"socket {ans.closed}"}
    if final["type"] == "error":
        raise RuntimeError(f"{what}: {final['error']}")
    ttft_ms = None if ans.first_t is None else (ans.first_t - ans.sent_t) * 1000.0
    return {**final["response"]["pddgw"], "ttft_ms": ttft_ms}


async def _conversation(client: TestClient, conv: int, turns: int, out_tokens: int, rng: random.Random,
                        results: list[dict], start_s: float) -> None:
    await asyncio.sleep(start_s)
    # An agent's system prompt with tool definitions: past the embedded WAN's ~713-token
    # P-MD threshold (docs/deployment.md, "The embedded default's WAN"), so first turns relay.
    history = tokens(rng, rng.randrange(900, 1500))
    async with await client.ws_connect("/v1/responses") as ws:
        for turn in range(turns):
            history += tokens(rng, rng.randrange(15, 40))   # the user's message
            row = await _ask(ws, history, out_tokens, f"conversation {conv} turn {turn}")
            results.append(row)
            history += row["output_token_ids"]
            await asyncio.sleep(rng.uniform(1.0, 2.0))          # think time (tools, the user)


def load_trace(path: str, limit: int, block_tokens: int, out_scale: float, seed: int) -> list[dict]:
    """A Mooncake-format trace -> requests on the tiny model's scale.

    Each 512-token block id becomes a fixed random block of `block_tokens` tokens (equal ids at the
    start of two prompts stay a shared prefix); input lengths scale by block_tokens / 512, output
    lengths by out_scale.
    """
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    out = []
    for r in read_mooncake(path, limit):
        for h in r.hash_ids:
            if h not in blocks:
                blocks[h] = tokens(rng, block_tokens)
        ids = [t for h in r.hash_ids for t in blocks[h]]
        n_in = max(1, min(len(ids), round(r.input_length * block_tokens / TRACE_BLOCK_TOKENS)))
        out.append({"t_s": r.t_s, "prompt": ids[:n_in], "max_tokens": max(1, round(r.output_length * out_scale))})
    return out


async def _replay_one(client: TestClient, i: int, req: dict, speed: float, results: list[dict]) -> None:
    await asyncio.sleep(req["t_s"] / speed)
    async with await client.ws_connect("/v1/responses") as ws:
        results.append(await _ask(ws, req["prompt"], req["max_tokens"], f"trace request {i}"))


async def run_one(naive: bool, args: argparse.Namespace, trace: list[dict] | None,
                  step_ms: float) -> tuple[dict, DerivedWan]:
    """One deployment under the traffic -> (`summarize`, the WAN it derived from `step_ms`)."""
    emb = Embedded(make_config(naive, step_ms))
    side = await emb.start()
    client = TestClient(TestServer(build_app(side.door)))
    await client.start_server()
    results: list[dict] = []
    try:
        if trace is not None:
            todo = [_replay_one(client, i, r, args.speed, results) for i, r in enumerate(trace)]
        else:
            rng = random.Random(args.seed)
            seeds = [rng.randrange(1 << 30) for _ in range(args.conversations)]
            # Poisson arrivals of new conversations.
            gaps = [rng.expovariate(1.0 / args.arrival_s) for _ in range(args.conversations - 1)]
            todo = [_conversation(client, i, args.turns, args.output_tokens, random.Random(s), results, t)
                    for i, (s, t) in enumerate(zip(seeds, accumulate(gaps, initial=0.0)))]
        await asyncio.gather(*todo)
        wan_bytes = emb.wan_kv_bytes()
        t0 = time.perf_counter()
        await side.router.drain()            # until every background transfer is done
        return summarize(results, wan_bytes, time.perf_counter() - t0), emb.wan_regime
    finally:
        await client.close()
        await emb.stop()


def summarize(results: list[dict], wan_bytes: int, drain_s: float) -> dict:
    """`wan_bytes`: the KV that crossed the WAN (response-time transfers and MD cache alignment after
    responses alike); `drain_s`: how long background work (MD cache alignment) ran on after the last answer."""
    n = len(results)
    ttft = [r["ttft_ms"] for r in results]
    rld = sum(r["tokens_by_role"].get("rld", 0) for r in results)
    decoded = rld + sum(r["tokens_by_role"].get("md", 0) for r in results)     # P's first tokens aside
    stalls = [r["handoff_stall_ms"] for r in results if r["handoff_stall_ms"] is not None]
    pipelines = Counter(r["pipeline"] for r in results)
    return {"requests": n, **{f"ttft_p{q}_ms": round(percentile(ttft, q), 1) for q in (50, 90, 99)},
            "pipeline_share": {k: round(v / n, 3) for k, v in sorted(pipelines.items())},
            "rld_token_share": round(rld / max(1, decoded), 3),
            "max_handoff_stall_ms": max(stalls) if stalls else None,
            "wan_kv_mb": round(wan_bytes / 1e6, 3), "background_drain_s": round(drain_s, 2)}


async def main_async(args: argparse.Namespace) -> dict:
    trace = (load_trace(args.trace, args.requests, args.block_tokens, args.output_scale, args.seed)
             if args.trace else None)
    # One decode-step measurement (the PDD run's) for both: side by side, they must see the same WAN.
    a, wan = await run_one(False, args, trace, 0.0)
    b, _ = await run_one(True, args, trace, wan.step_ms)
    return {"pdd": a, "naive": b,
            "wan": {"decode_step_ms": round(wan.step_ms, 4), "gbps": round(wan.shaping.gbps, 6),
                    "rtt_ms": round(2 * wan.shaping.latency_ms, 4),
                    "p_md_max_transfer_ms": round(wan.p_md_max_transfer_ms, 4)},
            "ttft_p50_ratio": round(a["ttft_p50_ms"] / b["ttft_p50_ms"], 3),
            "ttft_p99_ratio": round(a["ttft_p99_ms"] / b["ttft_p99_ms"], 3),
            "wan_bytes_ratio": round(a["wan_kv_mb"] / b["wan_kv_mb"], 3) if b["wan_kv_mb"] else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--conversations", 10), ("--turns", 6), ("--output-tokens", 160), ("--seed", 0)):
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--arrival-s", type=float, default=1.5, help="mean time between new conversations")
    p.add_argument("--trace", help="replay a Mooncake-format trace (e.g. data/traces/"
                   "mooncake_synthetic_trace.jsonl.gz) instead of the synthetic conversations")
    p.add_argument("--requests", type=int, default=100, help="trace: how many requests")
    p.add_argument("--block-tokens", type=int, default=16, help="trace: tokens per 512-token block id")
    p.add_argument("--output-scale", type=float, default=1.0, help="trace: output length factor")
    p.add_argument("--speed", type=float, default=1.0, help="trace: replay speed (2 = twice as fast)")
    add_output_args(p)
    args = p.parse_args(argv)
    setup_logging("warning")
    res = asyncio.run(main_async(args))
    a, b = res["pdd"], res["naive"]
    rows = [[k, a[k], b[k]] for k in ("requests", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "wan_kv_mb",
                                      "rld_token_share", "max_handoff_stall_ms", "background_drain_s",
                                      "pipeline_share")]
    rows.append(["ttft p50 / p99 ratio (pdd/naive)", res["ttft_p50_ratio"], res["ttft_p99_ratio"]])
    w = res["wan"]
    title = (f"emulated WAN {w['gbps']:.3g} Gbps, {w['rtt_ms']:.3g} ms RTT, P-MD budget "
             f"{w['p_md_max_transfer_ms']:.3g} ms (decode step {w['decode_step_ms']:.3g} ms, [net.regime])")
    emit(res, args.json, title + "\n" + format_table(["metric", "PDD", "naive cross-DC PD"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
