"""Agentic multi-turn traffic through the embedded deployment: PDD vs naive cross-DC PD.

`python -m pddgw.bench.pipeline [--json] [--conversations N] [--turns T]`

Both deployments are the embedded default (router, P, RLD in cluster A; MD in
cluster B over the emulated WAN, built-in tiny model) and see the same
traffic in the same run:

* PDD: the policy picks P-MD or P-RLD-MD per request; MD keeps a prefix cache,
  so only missing KV crosses the WAN; RLD covers slow transfers.
* naive: P-MD only, MD without a prefix cache: every request waits for its
  whole prompt KV to cross the WAN before its first token.

Traffic: N conversations arrive as a Poisson process and overlap; each starts with a long system
prompt (a few hundred uncached tokens, different per conversation), then T
turns, each re-sending the conversation so far plus a new user message,
after a short think time.  Reports TTFT P50/P99 side by side (and their
ratio), the share of requests per pipeline, the share of output tokens RLD
produced and the largest handoff stall.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time

import orjson
from aiohttp.test_utils import TestClient, TestServer

from pddgw.bench.common import add_output_args, emit, format_table
from pddgw.config import Config, EngineConfig, PolicyConfig
from pddgw.logs import setup_logging
from pddgw.pipeline.deploy import Embedded, embedded_nodes


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def make_config(naive: bool) -> Config:
    cfg = Config(engine=EngineConfig(num_blocks=2048, max_num_batched_tokens=1024))
    if not naive:
        return cfg
    nodes = tuple(dataclasses.replace(n, engine=dataclasses.replace(n.engine, enable_prefix_caching=False))
                  if n.role == "md" else n for n in embedded_nodes(cfg))
    return dataclasses.replace(cfg, nodes=nodes, policy=PolicyConfig(pipeline="P-MD"))


async def _conversation(client: TestClient, conv: int, turns: int, out_tokens: int, rng: random.Random,
                        results: list[dict], start_s: float) -> None:
    await asyncio.sleep(start_s)
    ws = await client.ws_connect("/v1/responses")
    system = [rng.randrange(32, 127) for _ in range(rng.randrange(250, 450))]
    history = list(system)
    try:
        for turn in range(turns):
            history += [rng.randrange(32, 127) for _ in range(rng.randrange(15, 40))]   # the user's message
            t0 = time.perf_counter()
            await ws.send_str(orjson.dumps({"type": "response.create", "prompt_token_ids": history,
                                            "max_output_tokens": out_tokens, "temperature": 0}).decode())
            ttft = None
            while True:
                ev = orjson.loads((await ws.receive()).data)
                if ev["type"] == "response.output_text.delta" and ttft is None:
                    ttft = (time.perf_counter() - t0) * 1000.0
                if ev["type"] == "error":
                    raise RuntimeError(f"conversation {conv} turn {turn}: {ev['error']}")
                if ev["type"] == "response.completed":
                    break
            resp = ev["response"]
            tl = resp["pddgw"]
            results.append({"conversation": conv, "turn": turn, "ttft_ms": ttft, "pipeline": tl["pipeline"],
                            "tokens_by_role": tl["tokens_by_role"], "handoff_stall_ms": tl["handoff_stall_ms"],
                            "wan_kv_bytes": tl["wan_kv_bytes"],
                            "cached_tokens": resp["usage"]["input_tokens_details"]["cached_tokens"],
                            "input_tokens": resp["usage"]["input_tokens"]})
            history += tl["output_token_ids"]
            await asyncio.sleep(rng.uniform(1.0, 2.0))          # think time (tools, the user)
    finally:
        await ws.close()


async def run_one(naive: bool, conversations: int, turns: int, out_tokens: int, seed: int,
                  arrival_s: float = 1.5) -> list[dict]:
    emb = Embedded(make_config(naive))
    side = await emb.start()
    client = TestClient(TestServer(side.door.app()))
    await client.start_server()
    results: list[dict] = []
    try:
        rng = random.Random(seed)
        seeds = [rng.randrange(1 << 30) for _ in range(conversations)]
        starts = [0.0]
        for _ in range(conversations - 1):       # Poisson arrivals of new conversations
            starts.append(starts[-1] + rng.expovariate(1.0 / arrival_s))
        await asyncio.gather(*(_conversation(client, i, turns, out_tokens, random.Random(s), results, t)
                               for i, (s, t) in enumerate(zip(seeds, starts))))
        await side.router.drain()
    finally:
        await client.close()
        await emb.stop()
    return results


def summarize(results: list[dict]) -> dict:
    ttft = [r["ttft_ms"] for r in results]
    n = len(results)
    tokens = {"rld": 0, "md": 0}
    for r in results:
        for role, k in r["tokens_by_role"].items():
            tokens[role] = tokens.get(role, 0) + k
    stalls = [r["handoff_stall_ms"] for r in results if r["handoff_stall_ms"] is not None]
    pipelines = {}
    for r in results:
        pipelines[r["pipeline"]] = pipelines.get(r["pipeline"], 0) + 1
    return {"requests": n, "ttft_p50_ms": round(_percentile(ttft, 50), 1),
            "ttft_p90_ms": round(_percentile(ttft, 90), 1), "ttft_p99_ms": round(_percentile(ttft, 99), 1),
            "pipeline_share": {k: round(v / n, 3) for k, v in sorted(pipelines.items())},
            "rld_token_share": round(tokens.get("rld", 0) / max(1, sum(tokens.values())), 3),
            "max_handoff_stall_ms": max(stalls) if stalls else None,
            "wan_kv_mb": round(sum(r["wan_kv_bytes"] for r in results) / 1e6, 3)}


async def main_async(args: argparse.Namespace) -> dict:
    pdd = await run_one(False, args.conversations, args.turns, args.output_tokens, args.seed, args.arrival_s)
    naive = await run_one(True, args.conversations, args.turns, args.output_tokens, args.seed, args.arrival_s)
    a, b = summarize(pdd), summarize(naive)
    return {"pdd": a, "naive": b,
            "ttft_p50_ratio": round(a["ttft_p50_ms"] / b["ttft_p50_ms"], 3),
            "ttft_p99_ratio": round(a["ttft_p99_ms"] / b["ttft_p99_ms"], 3),
            "wan_bytes_ratio": round(a["wan_kv_mb"] / b["wan_kv_mb"], 3) if b["wan_kv_mb"] else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--output-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arrival-s", type=float, default=1.5, help="mean time between new conversations")
    add_output_args(p)
    args = p.parse_args(argv)
    setup_logging("warning")
    res = asyncio.run(main_async(args))
    a, b = res["pdd"], res["naive"]
    rows = [[k, a[k], b[k]] for k in ("requests", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "wan_kv_mb",
                                      "rld_token_share", "max_handoff_stall_ms")]
    rows += [["pipeline_share", a["pipeline_share"], b["pipeline_share"]],
             ["ttft p50 / p99 ratio (pdd/naive)", res["ttft_p50_ratio"], res["ttft_p99_ratio"]]]
    emit(res, args.json, format_table(["metric", "PDD", "naive cross-DC PD"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
