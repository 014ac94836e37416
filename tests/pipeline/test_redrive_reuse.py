"""A re-drive never starts a second copy of a transfer in flight (router.py).

The relay (RLD) of a P-RLD-MD request is lost while P's KV still crawls to MD
over a 1 Gbps WAN.  MD already imports that KV, so the router does not
cancel it and start over: MD takes over from the tokens already emitted once
its KV is in (a final token-ID round the router sends itself).  On the
virtual clock with the simulator's cost-model engines (the real router,
workers and shaped links), so the byte counts are exact.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from pddgw.config import PolicyConfig
from pddgw.engines.types import SamplingParams
from pddgw.net.errors import CloseCode
from pddgw.deploy.serve import Embedded
from pddgw.sim.clock import run_virtual
from pddgw.sim.scenario import deployment_config, load_scenario

TINY = Path(__file__).parent.parent / "sim" / "tiny.toml"
PROMPT = tuple(1000 + (i * 7919) % 30000 for i in range(1800))
MAX_TOKENS = 160
KILL_AT = 10           # RLD is lost once the user has this many tokens


def config():
    sc = load_scenario(TINY)
    dep = sc.deployment("pdd")
    return deployment_config(sc, dataclasses.replace(dep, policy=PolicyConfig(singular_max_share=0.0)),
                             wan_gbps=1.0)


async def run(lose_rld: bool):
    emb = Embedded(config())
    side = await emb.start()
    router = side.router
    p = emb.workers["p0"]
    prefills = []
    real_prefill = p.prefill.prefill

    async def counting(rid, *a, **k):
        prefills.append(rid)
        return await real_prefill(rid, *a, **k)

    p.prefill.prefill = counting
    out: list[int] = []
    lost = []

    async def lose() -> None:
        # RLD's process is gone: every link to it closes.
        for link in list(emb.net.links):
            if "rld0" in (link.local, link.peer):
                await link.close(CloseCode.GOING_AWAY, "rld0 lost")

    async def emit(run):
        out.extend(run.ids)
        if lose_rld and not lost and len(out) >= KILL_AT:
            lost.append((asyncio.get_running_loop().time(), len(out)))
            asyncio.get_running_loop().create_task(lose())

    try:
        res = await router.run("r", PROMPT, SamplingParams(max_tokens=MAX_TOKENS, seed=7), emit,
                               pipeline="P-RLD-MD")
        await router.drain()
        md = emb.workers["md0"].engine.stats()
        used = sum(w.engine.stats().used_blocks for name, w in emb.workers.items() if name != "rld0")
        return (res, tuple(out), emb.wan_kv_bytes(), list(prefills), router.counts.as_dict(), lost,
                router.kv_bytes_per_token, used, router.inflight(), md)
    finally:
        await emb.stop()


def test_rld_lost_mid_transfer_md_takes_over_and_each_byte_crosses_once():
    base, base_out, base_wan, base_prefills, base_counts, _, bpt, _, _, _ = run_virtual(run(False))
    res, out, wan, prefills, counts, lost, _, used, inflight, _ = run_virtual(run(True))
    # 32 layers x (K, V) x 8 KV heads x 128 dims x 2 bytes (float16): llama3-8b's KV per token.
    assert bpt == 32 * 2 * 8 * 128 * 2 == 131_072
    # The undisturbed run hands off by token IDs; MD caches nothing of this prompt.
    assert base.record.pipeline == "P-RLD-MD" and base_counts["redrives"] == 0
    assert base_wan == 1800 * bpt
    # RLD lost after 10 tokens, long before MD had the KV (1800 x 128 KiB over 1 Gbps ~ 1.9 s).
    assert lost and lost[0][1] == KILL_AT and lost[0][0] < 1.0
    rec = res.record
    assert counts["redrives"] == 1 and len(rec.redrives) == 1 and "MD md0 takes over" in rec.redrives[0][0]
    # The same answer (position-keyed sampling), RLD's 10 tokens then MD's.
    assert out == base_out and len(out) == MAX_TOKENS
    assert rec.tokens_by_role == (("md", MAX_TOKENS - KILL_AT), ("rld", KILL_AT))
    # One prefill on P, one copy of the KV over the WAN: exactly MD's missing bytes.
    assert prefills == ["r"] and base_prefills == ["r"]
    assert wan == 1800 * bpt
    # Nothing left behind on the live nodes or in the router.
    assert used == 0
    assert all(v == 0 for v in inflight.values()), inflight
